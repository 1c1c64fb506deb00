"""The adapter bank: many LoRA adapters in slots on one base, each row of a batch with its
own, checked against PyTorch PEFT with each adapter active alone; slots filled and freed
without a recompile; training that leaves absent adapters bit for bit as they were."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_llama_config

import peftx
from peftx.implicit import assert_no_dense

VOCAB = 64
TARGETS = ["q_proj", "v_proj", "down_proj"]
# twelve adapters: ranks 4, 8 and 16, several alphas, every third rsLoRA
SPECS = [
    (r, alpha, k % 3 == 2)
    for k, (r, alpha) in enumerate(
        [
            (4, 8),
            (8, 16),
            (16, 4),
            (4, 1),
            (8, 8),
            (16, 32),
            (4, 12),
            (8, 2),
            (16, 16),
            (4, 4),
            (8, 24),
            (16, 8),
        ]
    )
]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny Llama saved by transformers, and twelve LoRA adapters saved by PyTorch PEFT."""
    import peft
    import torch
    import transformers

    root = tmp_path_factory.mktemp("bank")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(VOCAB)).save_pretrained(root / "base")
    for k, (r, alpha, rslora) in enumerate(SPECS):
        torch.manual_seed(100 + k)
        model = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        config = peft.LoraConfig(
            r=r,
            lora_alpha=alpha,
            use_rslora=rslora,
            target_modules=TARGETS,
            init_lora_weights=False,  # random B: every adapter changes the output
        )
        peft.get_peft_model(model, config).save_pretrained(root / f"a{k}")
    return root


def _peft_logits(root, adapter, ids):
    import peft
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def _bank(root, layout, n=12, max_adapters=16, dtype=None):
    base = peftx.from_pretrained(root / "base", layout=layout, dtype=dtype)
    bank = peftx.PeftModel.from_pretrained(
        base, root / "a0", "a0", is_trainable=True, max_adapters=max_adapters, max_rank=16
    )
    for k in range(1, n):
        bank = bank.load_adapter(root / f"a{k}", f"a{k}", is_trainable=True)
    return bank


def _optax_promotion():
    """optax's bias correction mixes Python floats and its int32 count."""
    return jax.numpy_dtype_promotion("standard")


_logits = eqx.filter_jit(lambda m, ids, rows: m(ids, adapter_names=rows).logits)


@pytest.mark.parametrize(
    "layout, products",
    [
        ("unrolled", "gathered"),
        pytest.param("stacked", "gathered", marks=pytest.mark.torch_round_trip),
        pytest.param("unrolled", "grouped", marks=pytest.mark.torch_round_trip),
    ],
)
def test_each_row_equals_peft_with_its_adapter(zoo, layout, products, monkeypatch):
    if products == "grouped":  # rows sorted by slot, two ragged_dots (the GPU/TPU form)
        monkeypatch.setitem(peftx.adapters._bank.GROUPED_FROM_TOKENS, jax.default_backend(), 1)
    bank = _bank(zoo, layout)
    names = [f"a{k}" for k in range(12)] + [peftx.BASE]
    ids = np.random.default_rng(0).integers(1, VOCAB, (len(names), 6))
    got = np.asarray(_logits(bank, jnp.asarray(ids), bank.adapter_ids(names)))
    for row, name in enumerate(names):
        adapter = None if name == peftx.BASE else zoo / name
        want = _peft_logits(zoo, adapter, ids[row : row + 1])[0]
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.torch_round_trip
def test_a_bf16_base_is_within_its_epsilon(zoo):
    bank = _bank(zoo, "stacked", n=4, dtype=jnp.bfloat16)
    names = ["a3", "a1", peftx.BASE, "a2"]
    ids = np.random.default_rng(1).integers(1, VOCAB, (4, 6))
    got = np.asarray(_logits(bank, jnp.asarray(ids), bank.adapter_ids(names)), np.float32)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for row, name in enumerate(names):
        adapter = None if name == peftx.BASE else zoo / name
        want = _peft_logits(zoo, adapter, ids[row : row + 1])[0]
        # a bf16 forward of two layers: each logit within a few roundings of its size
        bound = 64 * eps * (1.0 + np.abs(want))
        assert np.all(np.abs(got[row] - want) <= bound), name


def test_no_product_forms_a_dense_update(zoo):
    # max_rank 8: no gathered factor shares a weight's shape (the value projection is
    # (16, 32), as a rank-16 slot's `(rows, 16, 32)` factors would look)
    base = peftx.from_pretrained(zoo / "base")
    bank = peftx.PeftModel.from_pretrained(base, zoo / "a0", "a0", max_adapters=4, max_rank=8)
    bank = bank.load_adapter(zoo / "a1", "a1").load_adapter(zoo / "a3", "a3")
    ids = jnp.ones((3, 5), jnp.int32)
    rows = bank.adapter_ids(["a3", "a0", "a1"])
    assert_no_dense(lambda m, x, r: m(x, adapter_names=r).logits, bank, ids, rows)


class _Compiles:
    """Counts XLA compilations while active."""

    count = 0

    def __enter__(self):
        def listen(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                self.count += 1

        self._listen = listen
        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_slots_come_and_go_without_a_recompile(zoo):
    bank = _bank(zoo, "stacked", n=3, max_adapters=4)
    ids = jnp.asarray(np.random.default_rng(2).integers(1, VOCAB, (3, 6)))
    prompt = ids[:, :3]
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)

    def train_batch(model, names):
        labels = jnp.where(jnp.arange(6) < 2, -100, ids)
        return {
            "input_ids": ids,
            "attention_mask": jnp.ones_like(ids),
            "labels": labels,
            "adapter_ids": model.adapter_ids(names),
        }

    def everything(model, names):
        _logits(model, ids, model.adapter_ids(names)).block_until_ready()
        peftx.generate(model, prompt, 3, adapter_names=names).block_until_ready()
        state, frozen = peftx.train.init_state(
            model, optimizer, key=jax.random.key(0), adapters=list(model.adapter_names)
        )
        state, metrics = step(state, frozen, train_batch(model, names))
        return float(metrics["loss"])

    with _optax_promotion():
        _slots_come_and_go(zoo, bank, everything)


def _slots_come_and_go(zoo, bank, everything):
    """The jitted programs compile once; loading and deleting run small eager ops, which
    compile once per new shape (an adapter's first rank) and then never again."""
    everything(bank, ["a0", "a1", "a2"])  # compiles each program once
    counted = _Compiles()
    calls = 0

    def run(model, names):
        nonlocal calls
        with counted:
            everything(model, names)
        calls += 1
        return counted.count

    for cycle in range(2):
        with _Compiles() as loading:
            one = bank.load_adapter(zoo / "a3", "a3", True)  # a free slot
            two = one.delete_adapter("a1").load_adapter(zoo / "a5", "a5", True)  # rank 16 for 8
            three = two.delete_adapter("a0").delete_adapter("a5")
        if cycle == 1:
            assert loading.count == 0  # the same loads again: nothing new to compile
        assert run(one, ["a3", "a1", peftx.BASE]) == 0
        assert run(two, ["a5", "a0", "a3"]) == 0
        assert run(three, ["a2", "a3", peftx.BASE]) == 0
    assert calls == 6


# 6 rows: the step cuts the 8-slot bank down to the batch's slots; 10 rows: it steps the
# whole bank and masks the slots without rows
@pytest.mark.parametrize("rows", [6, pytest.param(10, marks=pytest.mark.variant_sweep)])
def test_training_leaves_absent_adapters_bit_for_bit(zoo, rows):
    bank = _bank(zoo, "stacked", n=8, max_adapters=8)
    bank = jax.tree.map(lambda x: x, bank)
    names = (["a1", "a4", "a1", "a6", "a7", "a4"] * 2)[:rows]
    present, absent = {"a1", "a4", "a6", "a7"}, ["a0", "a2", "a3", "a5"]
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(1, VOCAB, (rows, 8)))
    labels = jnp.where(jnp.asarray(rng.random((rows, 8))) < 0.3, -100, ids)
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.ones_like(ids),
        "labels": labels,
        "adapter_ids": bank.adapter_ids(names),
    }
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    state, frozen = peftx.train.init_state(
        bank, optimizer, key=jax.random.key(0), adapters=list(bank.adapter_names)
    )
    # one pass of AdamW over every slot first, so that absent slots have moments to decay
    warm_names = (["a0", "a2", "a3", "a5", "a6", "a7"] * 2)[:rows]
    warm = dict(batch, adapter_ids=bank.adapter_ids(warm_names))
    step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)
    with _optax_promotion():
        state, _ = step(state, frozen, warm)
        before = state
        for _ in range(3):
            state, _ = step(state, frozen, batch)

    def slot_arrays(tree, slot):
        banks = [x for x in jax.tree.leaves(tree, is_leaf=_is_bank) if _is_bank(x)]
        return [np.asarray(a[..., slot, :, :]) for b in banks for a in (b.lora_A, b.lora_B)]

    table = bank.table
    for name in absent:
        slot = table.slot(name)
        for tree_now, tree_then in (
            (state.trainable, before.trainable),
            (state.opt_state, before.opt_state),
        ):
            for now, then in zip(slot_arrays(tree_now, slot), slot_arrays(tree_then, slot)):
                np.testing.assert_array_equal(now, then, err_msg=name)
    for name in present:
        slot = table.slot(name)
        assert any(
            not np.array_equal(now, then)
            for now, then in zip(
                slot_arrays(state.trainable, slot), slot_arrays(before.trainable, slot)
            )
        ), name


def _is_bank(x):
    return isinstance(x, peftx.adapters.LoraBank)


@pytest.mark.parametrize(  # stepped whole; cut to the batch's slots
    "max_adapters", [4, pytest.param(8, marks=pytest.mark.variant_sweep)]
)
def test_each_adapters_gradient_is_its_own_rows_alone(zoo, max_adapters):
    """The step's gradient for an adapter equals the gradient of the mean loss over its
    own rows, computed with that adapter alone as a plain PeftModel."""
    bank = _bank(zoo, "unrolled", n=4, max_adapters=max_adapters)
    names = ["a1", "a3", "a1", "a3"]
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(1, VOCAB, (4, 7)))
    labels = jnp.where(jnp.asarray(rng.random((4, 7))) < 0.3, -100, ids)
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.ones_like(ids),
        "labels": labels,
        "adapter_ids": bank.adapter_ids(names),
    }
    # plain SGD at rate 1: the step moves each slot by minus its gradient
    optimizer = optax.sgd(1.0)
    state, frozen = peftx.train.init_state(
        bank, optimizer, key=jax.random.key(0), adapters=list(bank.adapter_names)
    )
    with _optax_promotion():
        new, _ = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)(
            state, frozen, batch
        )
    g = jax.tree.map(lambda a, b: a - b, state.trainable, new.trainable)
    layer = lambda m: m.base_model.model.layers[1].self_attn.v_proj.weight  # noqa: E731
    for name in ("a1", "a3"):
        rows = [i for i, n in enumerate(names) if n == name]
        one = bank.to_peft_model([name])
        trainable, fro = peftx.partition(one, [name])
        sub = {k: v[jnp.asarray(rows)] for k, v in batch.items() if k != "adapter_ids"}

        alone = _mean_loss_grad(trainable, fro, sub)
        want = layer(alone).adapters[name]
        slot = bank.table.slot(name)
        r = want.lora_A.shape[0]
        got_a = layer(g).lora_A[slot, :r]
        got_b = layer(g).lora_B[slot, :r].T  # the bank holds B rank-major
        np.testing.assert_allclose(got_a, want.lora_A, rtol=1e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got_b, want.lora_B, rtol=1e-4, atol=1e-6, err_msg=name)


@eqx.filter_jit
def _mean_loss_grad(trainable, frozen, batch):
    """The gradient of the mean loss over `batch` of a plain PeftModel's adapter."""

    def mean_loss(t):
        total, sums = peftx.train.causal_lm_loss(eqx.combine(t, frozen), batch)
        return total / sums["count"]

    return jax.grad(mean_loss)(trainable)


def test_greedy_generation_equals_each_adapters_own(zoo):
    bank = _bank(zoo, "stacked", n=5, max_adapters=8)
    names = ["a4", peftx.BASE, "a2"]
    prompt = jnp.asarray(np.random.default_rng(5).integers(1, VOCAB, (len(names), 5)))
    mixed = np.asarray(peftx.generate(bank, prompt, 6, adapter_names=names))
    for row, name in enumerate(names):
        if name == peftx.BASE:
            alone = peftx.generate(bank.disable_adapters(), prompt[row : row + 1], 6)
        else:
            alone = peftx.generate(bank.to_peft_model([name]), prompt[row : row + 1], 6)
        np.testing.assert_array_equal(mixed[row], np.asarray(alone)[0], err_msg=name)


@pytest.mark.torch_round_trip
def test_saved_adapters_load_in_peft_with_equal_logits(zoo, tmp_path):
    bank = _bank(zoo, "stacked", n=3, max_adapters=4)
    bank.save_pretrained(tmp_path / "out")
    ids = np.random.default_rng(6).integers(1, VOCAB, (1, 6))
    for k in range(3):
        folder = tmp_path / "out" / f"a{k}"
        r = SPECS[k][0]
        import safetensors.numpy

        tensors = safetensors.numpy.load_file(folder / "adapter_model.safetensors")
        assert {v.shape[0] for key, v in tensors.items() if "lora_A" in key} == {r}
        np.testing.assert_allclose(
            _peft_logits(zoo, folder, ids), _peft_logits(zoo, zoo / f"a{k}", ids), atol=1e-5
        )


@pytest.mark.variant_sweep  # test_each_adapters_gradient_is_its_own_rows_alone at scale
def test_a_large_bank_trains_many_adapters_in_one_step(zoo):
    base = peftx.from_pretrained(zoo / "base", layout="stacked")
    config = peftx.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    bank = peftx.get_peft_model(base, config, key=jax.random.key(0), max_adapters=256, max_rank=8)
    keys = jax.random.split(jax.random.key(1), 63)
    for k in range(63):
        bank = bank.add_adapter(f"t{k}", dataclasses.replace(config, r=8), key=keys[k])
    one = peftx.get_peft_model(base, dataclasses.replace(config, r=8), key=jax.random.key(0))
    single = sum(x.nbytes for x in jax.tree.leaves(peftx.partition(one)[0]) if eqx.is_array(x))
    banks = [x for x in jax.tree.leaves(bank.base_model, is_leaf=_is_bank) if _is_bank(x)]
    scalings = sum(b.scaling.nbytes for b in banks)  # one float32 per slot and layer
    # 256 adapters of the bank's rank; the first, of rank 4, is padded to it
    assert bank.bank_bytes() == 256 * single + scalings
    names = list(bank.adapter_names)
    assert len(names) == 64
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(1, VOCAB, (64, 6)))
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.ones_like(ids),
        "labels": ids,
        "adapter_ids": bank.adapter_ids(names),
    }
    optimizer = optax.adam(1e-2)
    state, frozen = peftx.train.init_state(bank, optimizer, key=jax.random.key(0), adapters=names)
    with _optax_promotion():
        new, metrics = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)(
            state, frozen, batch
        )
    assert bool(metrics["finite"])
    first = lambda tree: next(x for x in jax.tree.leaves(tree, is_leaf=_is_bank) if _is_bank(x))  # noqa: E731
    b_now, b_then = (
        first(new.trainable).lora_B,
        first(state.trainable).lora_B,
    )  # (layers, slots, ...)
    moved = np.any(np.asarray(b_now != b_then), axis=(0, 2, 3))
    assert moved[:64].all() and not moved[64:].any()


def test_bad_input_is_refused_and_changes_nothing(zoo):
    import peft  # noqa: F401  (the files below are PEFT's)

    bank = _bank(zoo, "unrolled", n=2, max_adapters=2)
    before = jax.tree.leaves(bank)
    with pytest.raises(ValueError, match=r"the bank is full: max_adapters=2"):
        bank.load_adapter(zoo / "a2", "a2")
    small = peftx.PeftModel.from_pretrained(
        peftx.from_pretrained(zoo / "base"), zoo / "a0", "a0", max_adapters=3
    )
    with pytest.raises(ValueError, match=r"rank 8 exceeds the bank's max_rank=4"):
        small.load_adapter(zoo / "a1", "a1")
    with pytest.raises(ValueError, match=r"'__base__' cannot name an adapter"):
        small.add_adapter(
            peftx.BASE, peftx.LoraConfig(r=4, target_modules=TARGETS), key=jax.random.key(0)
        )
    with pytest.raises(peftx.UnknownAdapterError, match=r"no adapter named 'a9'"):
        bank.adapter_ids(["a0", "a9"])
    with pytest.raises(
        ValueError,
        match=r"adapts model\.layers\.0\.self_attn\.k_proj.*which the "
        r"bank does not hold",
    ):
        small.add_adapter(
            "k", peftx.LoraConfig(r=4, target_modules=["k_proj"]), key=jax.random.key(0)
        )
    with pytest.raises(TypeError, match=r"a bank holds LoRA adapters .* got a IA3Config"):
        small.add_adapter(
            "ia3",
            peftx.IA3Config(target_modules=TARGETS, feedforward_modules=[]),
            key=jax.random.key(0),
        )
    with pytest.raises(ValueError, match=r"this config has use_dora=True"):
        small.add_adapter(
            "d", peftx.LoraConfig(r=4, target_modules=TARGETS, use_dora=True), key=jax.random.key(0)
        )
    with pytest.raises(
        ValueError,
        match=r"adapter id 3 is out of range: ids are slots 0 to 1, "
        r"or 2 for the base",
    ):
        bank(jnp.ones((1, 4), jnp.int32), adapter_names=jnp.asarray([3]))
    with pytest.raises(ValueError, match=r"max_adapters must be a positive integer, got 0"):
        peftx.get_peft_model(
            peftx.from_pretrained(zoo / "base"),
            peftx.LoraConfig(target_modules=TARGETS),
            key=jax.random.key(0),
            max_adapters=0,
        )
    after = jax.tree.leaves(bank)
    assert all(a is b for a, b in zip(before, after)) and small.adapter_names == ("a0",)


def test_dropout_draws_each_rows_own_slots_rate():
    """Slot 0 drops at 0.5, slot 1 not at all, the base row has no branch: with a dropout
    key only slot 0's row changes, and over many keys its mean is the row without dropout
    (inverted dropout)."""
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (6, 5))
    a = jax.random.normal(k[1], (2, 3, 5))
    b = jax.random.normal(k[2], (2, 3, 6))  # rank-major: (slots, rank, out)
    bank = peftx.adapters.LoraBank(
        w, a, b, jnp.asarray([0.7, 1.3]), jnp.asarray([0.5, 0.0]), jnp.asarray([0, 1, 2])
    )
    x = jax.random.normal(k[3], (3, 4, 5))
    product = peftx.use_implicit_args(
        lambda m, x: jax.lax.dot_general(x, m, (((2,), (1,)), ((), ())))
    )
    plain = product(bank, x)
    want = [x[i] @ (w + s * b[i].T @ a[i]).T for i, s in ((0, 0.7), (1, 1.3))] + [x[2] @ w.T]
    np.testing.assert_allclose(plain, jnp.stack(want), rtol=1e-5, atol=1e-5)

    def dropped(key):
        return product(
            eqx.tree_at(lambda m: m.dropout_key, bank, key, is_leaf=lambda n: n is None), x
        )

    one = dropped(jax.random.key(1))
    np.testing.assert_array_equal(one[1:], plain[1:])
    assert not np.allclose(one[0], plain[0])
    mean = jnp.mean(jax.vmap(dropped)(jax.random.split(jax.random.key(2), 4000)), axis=0)
    # 4000 draws: the mean is within a few standard errors of the undropped row
    np.testing.assert_allclose(mean[0], plain[0], atol=0.1 * float(jnp.max(jnp.abs(plain[0]))))


@pytest.fixture(scope="module")
def moe_zoo(tmp_path_factory):
    """A tiny Qwen3-MoE saved by transformers, and four PEFT adapters on its experts
    (`target_parameters`) and value projections, of ranks 2, 4, 2 and 3."""
    import peft
    import torch
    import transformers

    root = tmp_path_factory.mktemp("moe_bank")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
        initializer_range=0.2,
        intermediate_size=40,
        moe_intermediate_size=12,
        num_experts=4,
        head_dim=8,
        norm_topk_prob=True,
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(root / "base")
    for k, (r, alpha, rslora) in enumerate(
        [(2, 3, False), (4, 8, True), (2, 1, False), (3, 6, False)]
    ):
        torch.manual_seed(200 + k)
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
        lora = peft.LoraConfig(
            r=r,
            lora_alpha=alpha,
            use_rslora=rslora,
            target_modules=["v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,
        )
        peft.get_peft_model(model, lora).save_pretrained(root / f"m{k}")
    return root


@pytest.mark.parametrize(
    "layout", ["unrolled", pytest.param("stacked", marks=pytest.mark.torch_round_trip)]
)
def test_expert_rows_equal_peft_with_their_adapter(moe_zoo, layout):
    """Each row routes through its own adapter's experts: (adapter, expert) pairs."""
    base = peftx.from_pretrained(moe_zoo / "base", layout=layout)
    bank = peftx.PeftModel.from_pretrained(base, moe_zoo / "m0", "m0", max_adapters=6, max_rank=4)
    for k in range(1, 4):
        bank = bank.load_adapter(moe_zoo / f"m{k}", f"m{k}")
    names = ["m2", peftx.BASE, "m0", "m3", "m1"]
    ids = np.random.default_rng(8).integers(1, VOCAB, (len(names), 7))
    got = np.asarray(_logits(bank, jnp.asarray(ids), bank.adapter_ids(names)))
    for row, name in enumerate(names):
        adapter = None if name == peftx.BASE else moe_zoo / name
        want = _moe_logits(moe_zoo, adapter, ids[row : row + 1])[0]
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=1e-4, err_msg=name)
    if layout == "unrolled":  # and each adapter saved from the bank is PEFT's again
        import safetensors.numpy

        out = moe_zoo / f"saved_{layout}"
        bank.save_pretrained(out, ["m1", "m3"])
        for name in ("m1", "m3"):
            mine = safetensors.numpy.load_file(out / name / "adapter_model.safetensors")
            theirs = safetensors.numpy.load_file(moe_zoo / name / "adapter_model.safetensors")
            assert mine.keys() == theirs.keys()
            for key in theirs:
                np.testing.assert_allclose(mine[key], theirs[key], atol=1e-7, err_msg=key)


def _moe_logits(root, adapter, ids):
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def test_grouped_expert_product_gathers_each_rows_slot_and_expert():
    """`ragged_dot_general` (the GPU and TPU path of a mixture of experts) over an expert
    bank: row m of expert e(m), slot s(m), gets x·(W[e] + s_k B[s,e] A[s,e])ᵀ, written
    densely here; rows past the groups get zeros, as `ragged_dot` gives them."""
    from jax import lax

    from peftx.models._moe import GROUPED

    k = jax.random.split(jax.random.key(3), 4)
    experts, slots, rank, d_in, d_out = 3, 4, 2, 5, 6
    w = jax.random.normal(k[0], (experts, d_out, d_in))
    a = jax.random.normal(k[1], (slots, experts, rank, d_in))
    b = jax.random.normal(k[2], (slots, experts, d_out, rank))
    scaling = jnp.asarray([0.5, 2.0, 0.0, 1.5])
    group_sizes = jnp.asarray([3, 0, 4], jnp.int32)  # 7 rows in groups, 2 past them
    rows = jnp.asarray([1, 4, 0, 3, 1, 4, 0, 2, 1], jnp.int32)  # 4 is the base
    x = jax.random.normal(k[3], (9, d_in))
    bank = peftx.adapters.ExpertLoraBank(w, a, b, scaling, rows)
    got = peftx.use_implicit_args(lambda bank, x, gs: lax.ragged_dot_general(x, bank, gs, GROUPED))(
        bank, x, group_sizes
    )
    expert_of = [0, 0, 0, 2, 2, 2, 2]
    want = []
    for m in range(9):
        if m >= 7:
            want.append(jnp.zeros(d_out))
            continue
        e, s = expert_of[m], int(rows[m])
        dense = w[e] if s == slots else w[e] + scaling[s] * b[s, e] @ a[s, e]
        want.append(dense @ x[m])
    np.testing.assert_allclose(got, jnp.stack(want), rtol=1e-5, atol=1e-5)


@pytest.mark.zoo_sweep  # the Llama bank's isolation test covers the step's masking
def test_a_step_on_expert_banks_leaves_absent_adapters_as_they_were(moe_zoo):
    base = peftx.from_pretrained(moe_zoo / "base", layout="stacked")
    bank = peftx.PeftModel.from_pretrained(
        base, moe_zoo / "m0", "m0", True, max_adapters=3, max_rank=4
    )
    for k in range(1, 3):
        bank = bank.load_adapter(moe_zoo / f"m{k}", f"m{k}", True)
    ids = jnp.asarray(np.random.default_rng(9).integers(1, VOCAB, (4, 6)))
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.ones_like(ids),
        "labels": ids,
        "adapter_ids": bank.adapter_ids(["m0", "m2", "m2", "m0"]),
    }
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    state, frozen = peftx.train.init_state(
        bank, optimizer, key=jax.random.key(0), adapters=list(bank.adapter_names)
    )
    with _optax_promotion():
        new, metrics = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)(
            state, frozen, batch
        )
    assert bool(metrics["finite"])
    experts = lambda t: [  # noqa: E731
        x
        for x in jax.tree.leaves(t, is_leaf=_is_any_bank)
        if isinstance(x, peftx.adapters.ExpertLoraBank)
    ]
    assert len(experts(new.trainable)) == 2  # gate_up_proj and down_proj, stacked over layers
    for now, then in zip(experts(new.trainable), experts(state.trainable)):
        for name in ("m1",):
            slot = bank.table.slot(name)
            np.testing.assert_array_equal(now.lora_A[:, slot], then.lora_A[:, slot])
            np.testing.assert_array_equal(now.lora_B[:, slot], then.lora_B[:, slot])
        for name in ("m0", "m2"):
            slot = bank.table.slot(name)
            assert not np.array_equal(now.lora_B[:, slot], then.lora_B[:, slot]), name


def _is_any_bank(x):
    return isinstance(x, peftx.adapters.LoraBank | peftx.adapters.ExpertLoraBank)


def test_the_active_adapter_is_data_too(zoo):
    """A call without `adapter_names` uses the active adapter, whose slot is data: after
    `set_adapter` and after deleting every adapter (the base), the same compiled program."""
    bank = _bank(zoo, "unrolled", n=2, max_adapters=2)
    ids = jnp.asarray(np.random.default_rng(10).integers(1, VOCAB, (1, 5)))
    call = eqx.filter_jit(lambda m, x: m(x).logits)
    first = np.asarray(call(bank, ids))
    np.testing.assert_allclose(first[0], _peft_logits(zoo, zoo / "a0", ids)[0], atol=1e-4)
    with _Compiles() as compiles:
        second = np.asarray(call(bank.set_adapter("a1"), ids))
        empty = bank.delete_adapter("a0").delete_adapter("a1")
        base = np.asarray(call(empty, ids))
    assert compiles.count == 0 and empty.active_adapter is None
    np.testing.assert_allclose(second[0], _peft_logits(zoo, zoo / "a1", ids)[0], atol=1e-4)
    np.testing.assert_allclose(base[0], _peft_logits(zoo, None, ids)[0], atol=1e-4)


@pytest.mark.variant_sweep  # the step by another path: a loop written with optax
def test_a_users_own_optax_loop_matches_the_step(zoo):
    """The recipe for your own optax loop (README, docs/selection.md): the whole bank's
    gradient, each adapter's own mean, `keep_untrained_slots` on parameters and optimizer
    state. It updates the slots as the step does (which cuts the bank down to the batch's
    slots instead), and leaves the others bit for bit."""
    bank = _bank(zoo, "unrolled", n=4, max_adapters=6)
    rng = np.random.default_rng(11)
    ids = jnp.asarray(rng.integers(1, VOCAB, (4, 6)))
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.ones_like(ids),
        "labels": ids,
        "adapter_ids": bank.adapter_ids(["a2", "a0", "a2", peftx.BASE]),
    }
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    names = list(bank.adapter_names)
    state, frozen = peftx.train.init_state(bank, optimizer, key=jax.random.key(0), adapters=names)
    with _optax_promotion():
        stepped, _ = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)(
            state, frozen, batch
        )

        @eqx.filter_jit
        def own_step(trainable, opt_state):
            def loss(t):
                return peftx.train.causal_lm_loss(eqx.combine(t, frozen), batch)[0]

            grads = jax.grad(loss)(trainable)
            counts = peftx.train.slot_counts(
                batch["adapter_ids"], peftx.train.row_counts(batch), bank.max_adapters
            )
            grads = peftx.train.per_slot_mean(grads, counts)
            updates, new_state = optimizer.update(grads, opt_state, trainable)
            new = eqx.apply_updates(trainable, updates)
            trained = frozen.trained_slots & (counts > 0)
            return (
                peftx.train.keep_untrained_slots(new, trainable, trained),
                peftx.train.keep_untrained_slots(new_state, opt_state, trained),
            )

        trainable, opt_state = own_step(state.trainable, state.opt_state)
    for mine, theirs, then in zip(
        jax.tree.leaves(trainable),
        jax.tree.leaves(stepped.trainable),
        jax.tree.leaves(state.trainable),
    ):
        # AdamW's first step moves each entry by about lr·g/(|g| + eps): where |g| nears
        # eps, the two gradients' last bits (summed in another order) show, within 1e-3 of
        # a step of lr = 1e-2
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
        for name in ("a1", "a3"):  # no rows: bit for bit as before, in both
            slot = bank.table.slot(name)
            np.testing.assert_array_equal(mine[slot], then[slot])
            np.testing.assert_array_equal(theirs[slot], then[slot])
