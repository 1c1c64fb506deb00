"""AdaLoRA against HF PEFT in PyTorch on the same tiny Llama: PEFT's pruned file (with its
`rank_pattern`) both ways with equal logits and an identical file, merging, and the
orthogonality penalty against the term PEFT adds to the loss."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from test_llama import BF16_U, IDS, MASK, TOL, real_diff, torch_forward
from test_vera import _logits, _randomized, checkpoint  # noqa: F401 (a fixture)

import peftx
import peftx.models as pm
from peftx.adapters import AdaLoraArray, orthogonality_penalty
from peftx.implicit import assert_no_dense, strict

TARGETS = ["q_proj", "v_proj", "down_proj"]  # in and out sizes differ
INIT_R = 4
WEIGHTS = "adapter_model.safetensors"
IDS_J, MASK_J = jnp.asarray(IDS), jnp.asarray(MASK)
KEY = jax.random.key(0)


class Tiny(eqx.Module):
    q: eqx.nn.Linear = eqx.nn.Linear(4, 4, key=KEY)


def _pattern():
    """A rank pattern as PEFT's allocator leaves it: some ranks of some layers pruned."""
    return {
        "model.layers.0.self_attn.q_proj.lora_E": [True, False, True, True],
        "model.layers.1.mlp.down_proj.lora_E": [False, True, False, True],
        "model.layers.1.self_attn.v_proj.lora_E": [True, True, True, True],
    }


def _torch_adalora(
    path, orth_reg_weight=0.5, pattern=None, scale=0.5, dtype=torch.float32, **schedule
):
    """PEFT's AdaLoRA on the checkpoint, every factor random and non-zero (standard
    deviation `scale`), the ranks `pattern` prunes masked (their singular values zero) as
    PEFT's allocator masks them."""
    base = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = peft.AdaLoraConfig(
        init_r=INIT_R,
        lora_alpha=6,
        target_modules=TARGETS,
        init_lora_weights=False,
        orth_reg_weight=orth_reg_weight,
        **({"target_r": 2, "total_step": 10} | schedule),
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    if pattern is not None:
        model.peft_config["default"].rank_pattern = pattern
        with torch.no_grad():
            for name, p in model.base_model.model.named_parameters():
                key = name.replace(".default", "")
                if key in pattern:
                    p.mul_(torch.tensor(pattern[key], dtype=p.dtype)[:, None])
    return model


def test_pruned_peft_file_loads_into_peftx_and_back(checkpoint, tmp_path):  # noqa: F811
    """PEFT -> peftx with a `rank_pattern`: the file holds the kept ranks only; the
    logits equal PEFT's; peftx writes PEFT's file again (keys, shapes, dtypes, values,
    config); and PEFT reads peftx's file to the same logits."""
    theirs = _torch_adalora(checkpoint, pattern=_pattern())
    theirs.save_pretrained(tmp_path / "peft")
    stored = load_file(tmp_path / "peft" / WEIGHTS)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert stored[f"{q}.lora_A"].shape == (3, 32)  # pruned to the kept ranks
    assert not any("ranknum" in k for k in stored)
    base = pm.from_pretrained(checkpoint, layout="unrolled")
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft")
    adapter = ours.base_model.model.layers[0].self_attn.q_proj.weight.adapter("default")
    assert isinstance(adapter, AdaLoraArray) and adapter.r == INIT_R
    want = torch_forward(theirs, IDS, MASK).logits
    assert real_diff(_logits(ours), want, MASK) < TOL
    assert real_diff(_logits(base), want, MASK) > 100 * TOL
    # the pruned ranks matter: keeping the file's values at the first ranks differs
    shifted = eqx.tree_at(
        lambda m: m.base_model.model.layers[0].self_attn.q_proj.weight.adapters["default"].lora_E,
        ours,
        jnp.asarray(np.r_[stored[f"{q}.lora_E"], np.zeros((1, 1), np.float32)]),
    )
    assert real_diff(_logits(shifted), want, MASK) > 100 * TOL

    ours.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / WEIGHTS)
    assert sorted(again) == sorted(stored)
    for k in stored:
        assert again[k].dtype == stored[k].dtype, k
        np.testing.assert_array_equal(again[k], stored[k], err_msg=k)
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    want_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    want_config["target_modules"] = sorted(want_config["target_modules"])  # a set to PEFT
    drop = ("base_model_name_or_path",)
    assert {k: v for k, v in config.items() if k not in drop} == {
        k: v for k, v in want_config.items() if k not in drop
    }
    torch_base = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    back = peft.PeftModel.from_pretrained(torch_base, tmp_path / "again")
    assert real_diff(_logits(ours), torch_forward(back, IDS, MASK).logits, MASK) < TOL


def test_peftx_adapter_loads_into_peft(checkpoint, tmp_path):  # noqa: F811
    """peftx -> PEFT on the stacked layout, and PEFT's trainable count."""
    base = pm.from_pretrained(checkpoint, layout="stacked")
    config = peftx.AdaLoraConfig(init_r=INIT_R, lora_alpha=6, total_step=10, target_modules=TARGETS)
    ours = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 1)
    ours.save_pretrained(tmp_path)
    torch_base = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    theirs = peft.PeftModel.from_pretrained(torch_base, tmp_path)
    want = torch_forward(theirs, IDS, MASK).logits
    assert real_diff(_logits(ours), want, MASK) < TOL
    assert real_diff(_logits(base), want, MASK) > 100 * TOL
    count = _torch_adalora(checkpoint).get_nb_trainable_parameters()
    assert ours.get_nb_trainable_parameters() == count


def test_merge_and_unmerge(checkpoint):  # noqa: F811
    base = pm.from_pretrained(checkpoint, layout="unrolled")
    config = peftx.AdaLoraConfig(init_r=INIT_R, total_step=10, target_modules=TARGETS)
    model = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 2)
    merged = model.merge_and_unload()
    assert real_diff(_logits(merged), _logits(model), MASK) < TOL
    assert real_diff(_logits(merged), _logits(base), MASK) > 100 * TOL
    layer = model.base_model.model.layers[1].mlp.down_proj.weight
    adapter = layer.adapter("default")
    dense = merged.model.layers[1].mlp.down_proj.weight
    a, e, b = (np.asarray(x) for x in (adapter.lora_A, adapter.lora_E, adapter.lora_B))
    want = np.asarray(layer.weight) + 8 / (INIT_R + 1e-5) * b @ (a * e)
    np.testing.assert_allclose(dense, want, atol=1e-5)
    np.testing.assert_allclose(adapter.unmerged(dense), layer.weight, atol=1e-5)


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.variant_sweep)]
)
def test_gradients_match_peft(checkpoint, dtype, tmp_path):  # noqa: F811
    """Every factor's gradient equals PEFT's for the same loss of the logits; on a
    bfloat16 base the factors stay float32 on both sides and get float32 gradients."""
    theirs = _torch_adalora(checkpoint, dtype=getattr(torch, dtype))
    theirs.save_pretrained(tmp_path / "peft")
    base = pm.from_pretrained(checkpoint, dtype=getattr(jnp, dtype))
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft", is_trainable=True)
    weights = np.random.RandomState(3).standard_normal((*IDS.shape, 100)).astype(np.float32)
    kwargs = dict(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
    kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(MASK, -1) - 1, 0))
    logits = theirs(**kwargs).logits.float()
    (logits * torch.tensor(weights) * torch.tensor(MASK)[..., None]).sum().backward()
    want = {
        n.removesuffix(".default").replace(".base_model.model.", ".", 1): p.grad.numpy()
        for n, p in theirs.named_parameters()
        # on a bf16 base, PEFT's upcast of the adapter makes `ranknum` trainable too
        if p.requires_grad and "lora_" in n
    }
    trainable, frozen = peftx.partition(ours)
    proj = jnp.asarray(weights)

    @eqx.filter_jit
    def grad(t):
        def loss(t):
            logits = eqx.combine(t, frozen)(IDS_J, MASK_J).logits.astype(jnp.float32)
            return jnp.sum(logits * proj * MASK_J[..., None].astype(jnp.float32))

        return jax.grad(loss)(t)

    eqx.combine(grad(trainable), frozen).save_pretrained(tmp_path / "grads")
    got = load_file(tmp_path / "grads" / WEIGHTS)
    assert sorted(got) == sorted(want) and len(got) == 3 * len(TARGETS) * 2
    # bf16: activations rounded at every layer; a few hundred units of bf16's rounding,
    # relative to each gradient's scale
    tol = TOL if dtype == "float32" else 400 * BF16_U
    for k, g in got.items():
        assert g.dtype == np.float32, k
        scale = np.abs(want[k]).max()
        assert scale > 0, k
        np.testing.assert_allclose(g, want[k], atol=tol * scale, rtol=0, err_msg=k)


def test_training_step_builds_no_dense_update_and_jvp(checkpoint):  # noqa: F811
    """A training step with dropout builds no weight-sized array, and forward mode
    agrees with reverse mode along a random tangent."""
    base = pm.from_pretrained(checkpoint, layout="stacked")
    config = peftx.AdaLoraConfig(
        init_r=INIT_R, total_step=10, target_modules=TARGETS, lora_dropout=0.1
    )
    model = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 4)
    trainable, frozen = peftx.partition(model)

    def loss(t, key):
        m = peftx.adapters.with_dropout(eqx.combine(t, frozen), key)
        return jnp.mean(m(IDS_J, MASK_J).logits ** 2)

    def step(t, frozen, key):
        return jax.grad(loss)(t, key)

    key = jax.random.key(1)
    with strict():
        assert_no_dense(step, trainable, frozen, key)
        grads = eqx.filter_jit(step)(trainable, frozen, key)
        tangent, _ = peftx.partition(_randomized(model, 5))
        _, forward = eqx.filter_jit(lambda t, d: jax.jvp(lambda t: loss(t, key), (t,), (d,)))(
            trainable, tangent
        )
    reverse = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(tangent)))
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)


def test_two_adapters_switch_train_one_at_a_time_and_refuse_mixed_batches(checkpoint):  # noqa: F811
    """Two AdaLoRA adapters: each active one gives its own logits; training one carries
    that one's allocator only; a mixed batch is refused, as PEFT's AdaLoRA has none."""
    base = pm.from_pretrained(checkpoint, layout="stacked")
    config = peftx.AdaLoraConfig(init_r=INIT_R, target_r=1, total_step=10, target_modules=TARGETS)
    model = peftx.get_peft_model(base, config, key=jax.random.key(0))
    model = model.add_adapter("b", dataclasses.replace(config, init_r=2), key=jax.random.key(1))
    model = _randomized(_randomized(model, 8).set_adapter("b"), 9)
    assert real_diff(_logits(model), _logits(model.set_adapter("default")), MASK) > 100 * TOL
    state, _ = peftx.train.init_state(model, optax.sgd(0.1), key=KEY)
    (hook,) = state.hooks
    assert hook.adapter_name == "b" and hook.init_budget == 2 * 2 * len(TARGETS)
    with pytest.raises(ValueError, match="mixes adapters within a batch.*ADALORA"):
        model(IDS_J, MASK_J, adapter_names=["default", "b", "b", "default"])


def test_orthogonality_penalty_is_peft_s(checkpoint, tmp_path):  # noqa: F811
    """The term PEFT adds to the loss, `orth_reg_weight` times the penalty, on the same
    factors (loaded from PEFT's file)."""
    weight = 0.7
    theirs = _torch_adalora(checkpoint, orth_reg_weight=weight)
    plain = _torch_adalora(checkpoint, orth_reg_weight=0.0)
    ids = torch.tensor(IDS).long()
    batch = dict(input_ids=ids, attention_mask=torch.tensor(MASK), labels=ids)
    # `AdaLoraModel.forward` adds it (a `PeftModel` without a task type skips it)
    with torch.no_grad():
        term = (theirs.base_model(**batch).loss - plain.base_model(**batch).loss).item() / weight
    theirs.save_pretrained(tmp_path)
    ours = peftx.PeftModel.from_pretrained(
        pm.from_pretrained(checkpoint, layout="unrolled"), tmp_path
    )
    penalty = float(orthogonality_penalty(ours))
    assert term > 1.0  # random factors are far from orthogonal
    assert abs(penalty - term) < 1e-4 * term
    # a stack's layers count one by one
    stacked = peftx.PeftModel.from_pretrained(
        pm.from_pretrained(checkpoint, layout="stacked"), tmp_path
    )
    assert abs(float(orthogonality_penalty(stacked)) - term) < 1e-4 * term


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="total_step"):
        peftx.AdaLoraConfig()
    with pytest.raises(ValueError, match="tinit=5 must be below"):
        peftx.AdaLoraConfig(total_step=8, tinit=5, tfinal=3)
    with pytest.raises(ValueError, match="init_r=4 bools per layer"):
        peftx.AdaLoraConfig(total_step=8, init_r=4, rank_pattern={"a.lora_E": [True]})
    # PEFT loads such a config, and fails at its first allocation; peftx before training
    model = peftx.get_peft_model(
        Tiny(), peftx.AdaLoraConfig(total_step=8, init_r=4, target_modules=["q"]), key=KEY
    )
    with pytest.raises(ValueError, match="target_r=8 must not exceed init_r=4"):
        peftx.train.init_state(model, optax.sgd(0.1), key=KEY)
    with pytest.raises(ValueError, match="beta1"):
        peftx.AdaLoraConfig(total_step=8, beta1=1.0)
    with pytest.raises(ValueError, match="use_dora"):
        peftx.load_config({"peft_type": "ADALORA", "total_step": 8, "use_dora": True})


# steps 3-6 shrink the budget (24 ranks to 12), allocating at 4 and 6; step 7 allocates
# the final ranks, which steps 8 and 9 keep
SCHEDULE = dict(target_r=2, tinit=2, tfinal=3, deltaT=2, total_step=10, beta1=0.6, beta2=0.7)
LR = 0.05


def _lm_batch():
    """Right-padded rows (transformers' positions are then peftx's) labelled for the
    causal-LM loss, padding left out."""
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 100, (3, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    ids = ids * mask
    return ids, mask, np.where(mask == 1, ids, -100)


def _peft_training(path, tmp_path):
    """PEFT's loop as its docs write it (SGD, `update_and_allocate` after each step):
    the initial adapter saved to `tmp_path / "start"`, the rank pattern after each step,
    and the trained adapter saved to `tmp_path / "peft"`."""
    model = _torch_adalora(path, orth_reg_weight=0.3, scale=0.2, **SCHEDULE)
    model.save_pretrained(tmp_path / "start")
    model.train()
    ids, mask, labels = (torch.tensor(x) for x in _lm_batch())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    patterns = []
    for step in range(SCHEDULE["total_step"]):
        loss = model.base_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        model.base_model.update_and_allocate(step)
        optimizer.zero_grad()
        pattern = model.peft_config["default"].rank_pattern
        patterns.append(
            None
            if pattern is None
            else {k.replace(".default", ""): list(v) for k, v in pattern.items()}
        )
    model.save_pretrained(tmp_path / "peft")
    return patterns


# the unrolled arm repeats the stacked arm's PEFT loop on the other layout: make test-fast
# leaves it out, make test runs it
@pytest.mark.parametrize(
    "layout", ["stacked", pytest.param("unrolled", marks=pytest.mark.torch_round_trip)]
)
def test_rank_allocation_is_peft_s(checkpoint, tmp_path, layout):  # noqa: F811
    """The same start, batch and SGD steps in PEFT's loop and in `peftx.train`'s step,
    whose allocator runs by itself: after every step the rank pattern is PEFT's; the
    trained adapter's file is PEFT's (the kept ranks only, `rank_pattern` in its config),
    with values equal to fp32 rounding, and PEFT reads it to the same logits."""
    patterns = _peft_training(checkpoint, tmp_path)
    assert patterns[3] is None and patterns[4] is not None  # the schedule as above
    assert sum(map(sum, patterns[-1].values())) == 2 * len(patterns[-1])  # target_r each
    assert patterns[4] != patterns[-1]

    base = pm.from_pretrained(checkpoint, layout=layout)
    model = peftx.PeftModel.from_pretrained(base, tmp_path / "start", is_trainable=True)
    optimizer = optax.sgd(LR)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(0))
    step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)
    ids, mask, labels = _lm_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for want in patterns:
        state, _ = step(state, frozen, batch)
        got = peftx.train.trained_model(state, frozen).peft_config["default"].rank_pattern
        got = None if got is None else {k: list(v) for k, v in got.items()}
        assert got == want, int(state.step)

    trained = peftx.train.trained_model(state, frozen)
    trained.save_pretrained(tmp_path / "ours")
    stored, ours = load_file(tmp_path / "peft" / WEIGHTS), load_file(tmp_path / "ours" / WEIGHTS)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in stored.items()}
    for k in stored:
        np.testing.assert_allclose(ours[k], stored[k], rtol=1e-4, atol=1e-5, err_msg=k)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == patterns[-1]
    torch_base = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    back = peft.PeftModel.from_pretrained(torch_base, tmp_path / "ours")
    assert real_diff(_logits(trained), torch_forward(back, IDS, MASK).logits, MASK) < TOL
