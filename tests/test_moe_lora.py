"""LoRA on the experts of Mixtral and Qwen3-MoE (`target_parameters`, PEFT's
`ParamWrapper`): files and logits against PEFT on tiny random transformers models, the
grouped products against every expert run densely on every token (written here), no dense
update ever built, merging, QLoRA over quantized experts, and PEFT's defaults."""

import json
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from test_llama import BF16_U, TOL, real_diff, torch_forward

import peftx
import peftx.models as pm
from peftx import LoraConfig, get_peft_model, partition
from peftx.adapters import AdapterSet, ExpertLoraArray, expert_lora
from peftx.implicit import assert_no_dense, materialize, strict, use_implicit_args
from peftx.models._moe import SparseMoeBlock, sparse_moe

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# batch 2 x 7 tokens: no activation axis has a weight's length (for assert_no_dense)
IDS = np.array([[0, 0, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
MASK = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts_per_tok=2,
    initializer_range=0.2,
    attn_implementation="eager",
)
BUILD = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **COMMON)
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            intermediate_size=40,
            moe_intermediate_size=12,
            num_experts=4,
            head_dim=8,
            norm_topk_prob=True,
            **COMMON,
        )
    ),
}
# PEFT wraps Mixtral's router (not an nn.Linear in transformers) as a parameter too
MODULES = {"mixtral": ["q_proj", "gate"], "qwen3_moe": ["v_proj"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory of the saved random model, its base logits)."""
    out = {}
    for name, build in BUILD.items():
        torch.manual_seed(0)
        model = build().eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, torch_forward(model, IDS, MASK).logits.numpy())
    return out


def _torch_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager"
    ).eval()


def _peft_config(name, **kwargs):
    return dict(
        r=2,
        lora_alpha=3,
        target_modules=MODULES[name],
        target_parameters=EXPERTS,
        init_lora_weights=False,
        **kwargs,
    )


def _run(model):
    return np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)).logits)


@pytest.fixture(scope="module")
def peft_files(checkpoints, tmp_path_factory):
    """name -> (PEFT's adapter directory, PEFT's logits, PEFT's trainable count)."""
    out = {}
    for name, (path, _) in checkpoints.items():
        torch.manual_seed(1)
        model = peft.get_peft_model(_torch_model(path), peft.LoraConfig(**_peft_config(name)))
        model.eval()
        directory = tmp_path_factory.mktemp(f"{name}_peft")
        model.save_pretrained(directory)
        trainable, _ = model.get_nb_trainable_parameters()
        out[name] = (directory, torch_forward(model, IDS, MASK).logits.numpy(), trainable)
    return out


# each architecture in one layout (the other runs the same code on a stack split or not);
# Qwen3-MoE's is torch_round_trip: the fast tier reads its PEFT adapters unrolled in
# test_mixed_batches_on_experts_equal_peft_row_by_row
@pytest.mark.parametrize(
    "name, layout",
    [
        ("mixtral", "stacked"),
        pytest.param("qwen3_moe", "unrolled", marks=pytest.mark.torch_round_trip),
    ],
)
def test_peft_to_peftx(checkpoints, peft_files, name, layout):
    path, base_logits = checkpoints[name]
    directory, theirs, trainable = peft_files[name]
    ours = peftx.PeftModel.from_pretrained(
        pm.from_pretrained(path, layout=layout), directory, is_trainable=True
    )
    assert real_diff(_run(ours), theirs, MASK) < TOL
    assert real_diff(base_logits, theirs, MASK) > 100 * TOL  # the adapters matter
    assert ours.get_nb_trainable_parameters()[0] == trainable
    stacks = [x for x in jax.tree.leaves(ours, is_leaf=_is_expert) if _is_expert(x)]
    assert len(stacks) == (2 if layout == "stacked" else 4)


def _is_expert(x):
    return isinstance(x, ExpertLoraArray)


def _randomized(model, seed):
    trainable, frozen = partition(model)
    leaves, tree = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), frozen)


@pytest.mark.parametrize(
    "layout", ["stacked"]
)  # unrolled: test_peft_to_peftx's Qwen3-MoE (make test)
def test_peftx_to_peft(checkpoints, peft_files, layout, tmp_path):
    path, _ = checkpoints["mixtral"]
    config = LoraConfig(**_peft_config("mixtral"))
    ours = get_peft_model(pm.from_pretrained(path, layout=layout), config, key=jax.random.key(2))
    ours = _randomized(ours, 3)
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(_torch_model(path), tmp_path).eval()
    assert real_diff(_run(ours), torch_forward(theirs, IDS, MASK).logits, MASK) < TOL
    # the file as PEFT writes it for the same config: keys, shapes, dtypes
    mine, peft_file = (
        load_file(tmp_path / "adapter_model.safetensors"),
        load_file(peft_files["mixtral"][0] / "adapter_model.safetensors"),
    )
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {
        k: (v.shape, v.dtype) for k, v in peft_file.items()
    }
    assert "model.layers.0.mlp.experts.base_layer.lora_A.weight" in "".join(mine)
    # the config as PEFT writes it: the router named `gate` becomes `gate.weight` there
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    theirs = json.loads((peft_files["mixtral"][0] / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == sorted(theirs["target_parameters"])
    assert sorted(saved["target_modules"]) == sorted(theirs["target_modules"])


# ---------------------------------------------------------------- grouped vs dense


def _block(dtype, key):
    """A Mixtral-like block (4 experts, top 2) with random LoRA on both expert stacks."""
    c = types.SimpleNamespace(
        hidden_size=16, num_experts=4, moe_intermediate_size=6, initializer_range=0.3
    )
    k = jax.random.split(key, 3)
    block = SparseMoeBlock(c, key=k[0], dtype=dtype)

    def adapted(w, key):
        a = expert_lora(w, r=2, lora_alpha=3, init="random", key=key)
        return eqx.tree_at(lambda a: a.lora_B, a, 3 * a.lora_B)  # an update as large as W

    return eqx.tree_at(
        lambda b: (b.experts.gate_up_proj, b.experts.down_proj),
        block,
        (adapted(block.experts.gate_up_proj, k[1]), adapted(block.experts.down_proj, k[2])),
    )


def _dense_reference(router, a_gu, b_gu, a_d, b_d, block, x, adapted=True):
    """Every expert on every token, `W_e + s·B_e·A_e` formed from PEFT's layouts, weighted
    by the renormalized top-2 router weights (zero for the other experts)."""
    gu, d = block.experts.gate_up_proj, block.experts.down_proj
    experts = gu.weight.shape[0]

    def full(base, a, b, s):
        if not adapted:
            return base.astype(jnp.float32)
        a_e = a.reshape(experts, -1, a.shape[-1])  # (E, r, in): expert-major
        b_e = b.reshape(b.shape[0], -1, experts)  # (out, r, E): expert-minor
        return base.astype(jnp.float32) + s * jnp.einsum("ore,eri->eoi", b_e, a_e)

    w_gu = full(materialize(gu.weight), a_gu, b_gu, gu.scaling)
    w_d = full(materialize(d.weight), a_d, b_d, d.scaling)
    xf = x.astype(jnp.float32)
    probs = jax.nn.softmax(xf @ router.astype(jnp.float32).T, axis=-1)
    top = jnp.sort(probs, axis=-1)[:, -2:-1]  # the second largest
    weights = jnp.where(probs >= top, probs, 0.0)
    weights = weights / weights.sum(-1, keepdims=True)
    gate, up = jnp.split(jnp.einsum("ti,eoi->teo", xf, w_gu), 2, axis=-1)
    y = jnp.einsum("tei,eoi->teo", jax.nn.silu(gate) * up, w_d)
    return jnp.einsum("te,teo->to", weights, y)


def _ours(router, a_gu, b_gu, a_d, b_d, block, x):
    block = eqx.tree_at(
        lambda b: (
            b.gate.weight,
            b.experts.gate_up_proj.lora_A,
            b.experts.gate_up_proj.lora_B,
            b.experts.down_proj.lora_A,
            b.experts.down_proj.lora_B,
        ),
        block,
        (router, a_gu, b_gu, a_d, b_d),
    )
    out, _ = use_implicit_args(lambda b, x: sparse_moe(b, x, 2, True, jax.nn.silu))(block, x)
    return out.astype(jnp.float32)


@pytest.mark.parametrize(
    "dtype, path",
    [
        # the fast tier runs each path in one dtype (float32 blocked, bfloat16 ragged)
        pytest.param(dtype, path, id=f"{dtype}-{path}", marks=pytest.mark.variant_sweep)
        if (dtype, path) in (("bfloat16", "blocked"), ("float32", "ragged"))
        else pytest.param(dtype, path, id=f"{dtype}-{path}")
        for dtype in ("float32", "bfloat16")
        for path in ("blocked", "ragged")
    ],
)
def test_grouped_products_equal_dense_experts(path, dtype, monkeypatch):
    """Values and gradients (input, router, every factor) of the block with adapted
    experts, by the CPU's expert-blocked products and by `ragged_dot_general` (what GPUs
    and TPUs run), against the dense formula."""
    if path == "ragged":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    block = _block(jnp.dtype(dtype), jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (13, 16), dtype)
    gu, d = block.experts.gate_up_proj, block.experts.down_proj
    args = (block.gate.weight, gu.lora_A, gu.lora_B, d.lora_A, d.lora_B)

    def loss(fn):
        cot = jax.random.normal(jax.random.key(2), (13, 16))
        return lambda *a: jnp.sum(fn(*a[:5], block, a[5]) * cot)

    # each side jitted whole: one compile, not one per operation
    with strict():
        got = jax.jit(lambda *a: _ours(*a, block, x))(*args)
        got_grads = jax.jit(jax.grad(loss(_ours), argnums=range(6)))(*args, x)
    want = jax.jit(lambda *a: _dense_reference(*a, block, x))(*args)
    want_grads = jax.jit(jax.grad(loss(_dense_reference), argnums=range(6)))(*args, x)
    # fp32: a few roundings; bf16: each product and activation rounds its output (u each)
    rel = TOL if dtype == "float32" else 64 * BF16_U
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(got, want, atol=rel * scale)
    base_only = jax.jit(lambda *a: _dense_reference(*a, block, x, adapted=False))(*args)
    assert float(jnp.abs(base_only - want).max()) > 0.3 * scale  # the adapter matters
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), atol=rel * float(jnp.abs(w).max())
        )
        assert float(jnp.abs(w).max()) > 0


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def adapted(checkpoints):
    """layout -> the Mixtral with random LoRA on its experts (and q_proj, the router)."""
    path, _ = checkpoints["mixtral"]
    config = LoraConfig(**_peft_config("mixtral"))
    return {
        layout: _randomized(
            get_peft_model(pm.from_pretrained(path, layout=layout), config, key=jax.random.key(4)),
            5,
        )
        for layout in ("stacked", "unrolled")
    }


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_no_dense_update_in_a_training_step(checkpoints, layout, monkeypatch):
    """A training step builds no dense update: checked on the traced program of the
    grouped products GPUs run (`ragged_dot_general`; the CPU's blocked products gather a
    copy of the base experts per block, adapter or not), and run on both paths under
    `strict()`. The router is left out: its weight `(experts, hidden)` has the shape of
    a factor's expert slices."""
    path, _ = checkpoints["mixtral"]
    config = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    model = get_peft_model(pm.from_pretrained(path, layout=layout), config, key=jax.random.key(4))
    trainable, frozen = partition(_randomized(model, 5))
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)

    def step(trainable, frozen):
        def loss(t):
            return jnp.mean(eqx.combine(t, frozen)(ids, mask).logits ** 2)

        return jax.grad(loss)(trainable)

    with strict():
        grads = eqx.filter_jit(step)(trainable, frozen)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert_no_dense(step, trainable, frozen)
        eqx.filter_jit(step)(trainable, frozen)
    experts = [x for x in jax.tree.leaves(grads, is_leaf=_is_expert) if _is_expert(x)]
    assert experts and all(
        float(jnp.abs(g).max()) > 0 for e in experts for g in (e.lora_A, e.lora_B)
    )


def test_merge_and_unload(adapted, checkpoints):
    model = adapted["stacked"]
    merged = model.merge_and_unload()
    assert not any(
        isinstance(x, ExpertLoraArray) for x in jax.tree.leaves(merged, is_leaf=_is_expert)
    )
    logits = _run(model)
    assert real_diff(_run(merged), logits, MASK) < TOL
    base = model.unload()
    assert real_diff(_run(base), checkpoints["mixtral"][1], MASK) < TOL
    assert real_diff(logits, checkpoints["mixtral"][1], MASK) > 100 * TOL


def _run_traced(model):
    return model(jnp.asarray(IDS), jnp.asarray(MASK)).logits[:, -1]


# ---------------------------------------------------------------- config


def test_peft_defaults_with_target_parameters(checkpoints, tmp_path):
    """`target_modules=None` beside `target_parameters`: PEFT adapts the experts alone,
    also for Mixtral, which has a default (q_proj, v_proj) without them; Qwen3-MoE has no
    default at all."""
    for name in ("mixtral", "qwen3_moe"):
        model = pm.from_pretrained(checkpoints[name][0], layout="unrolled")
        config = LoraConfig(r=2, target_parameters=EXPERTS)
        ours = get_peft_model(model, config, key=jax.random.key(0))
        torch_model = peft.get_peft_model(
            _torch_model(checkpoints[name][0]), peft.LoraConfig(r=2, target_parameters=EXPERTS)
        )
        theirs = {
            k.removeprefix("base_model.model.") for k in peft.get_peft_model_state_dict(torch_model)
        }
        assert ours.get_nb_trainable_parameters()[0] == torch_model.get_nb_trainable_parameters()[0]
        assert _adapted_linears(ours) == []
        assert theirs == {
            f"model.layers.{i}.mlp.experts.{nest}lora_{f}.weight"
            for i in range(2)
            for nest in ("", "base_layer.")
            for f in "AB"
        }
        ours.save_pretrained(tmp_path / name)
        saved = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert saved["target_modules"] == []
    mixtral = pm.from_pretrained(checkpoints["mixtral"][0], layout="unrolled")
    without = get_peft_model(mixtral, LoraConfig(r=2), key=jax.random.key(0))
    assert {p.rsplit(".", 1)[-1] for p in _adapted_linears(without)} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="no LORA default for model type 'qwen3_moe'"):
        get_peft_model(model, LoraConfig(r=2), key=jax.random.key(0))


def _adapted_linears(model):
    layers = peftx.select(model.base_model).at(peftx.of_type(eqx.nn.Linear))
    return [p for p, n in zip(layers.paths(), layers.get()) if not isinstance(n.weight, jax.Array)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lora_dropout=0.1), "lora_dropout"),
        (dict(use_dora=True), "use_dora"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(target_parameters="mlp.experts.down_proj"), "target_parameters"),
    ],
)
def test_refused_with_target_parameters(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LoraConfig(**{"target_parameters": EXPERTS, **kwargs})


def test_unmatched_parameter_names_its_stacks(checkpoints):
    model = pm.from_pretrained(checkpoints["qwen3_moe"][0])
    config = LoraConfig(target_parameters=["mlp.experts.up_proj"])
    with pytest.raises(KeyError, match=r"mlp\.experts\.gate_up_proj"):
        get_peft_model(model, config, key=jax.random.key(0))


@pytest.mark.parametrize(
    "name, target",
    [
        ("mixtral", "all-linear"),
        ("mixtral", ["q_proj", "w1", "w3", "w2"]),
        ("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]),
    ],
)
def test_transformers_4_expert_names_select_what_peft_selects(checkpoints, name, target, tmp_path):
    """PEFT reads the expert and router names of transformers 4 (and `all-linear`, which
    meant them) as `target_parameters` on transformers 5's fused experts, `gate_up_proj`
    at twice the rank: the same file keys, shapes and config as PEFT's."""
    path = checkpoints[name][0]
    kwargs = dict(r=2, lora_alpha=3, target_modules=target)
    theirs = peft.get_peft_model(_torch_model(path), peft.LoraConfig(**kwargs))
    theirs.save_pretrained(tmp_path / "peft")
    ours = get_peft_model(pm.from_pretrained(path), LoraConfig(**kwargs), key=jax.random.key(0))
    ours.save_pretrained(tmp_path / "ours")
    files = [load_file(tmp_path / d / "adapter_model.safetensors") for d in ("peft", "ours")]
    assert [{k: v.shape for k, v in f.items()} for f in files][0] == {
        k: v.shape for k, v in files[1].items()
    }
    assert any("experts.base_layer.lora_A" in k for k in files[1])
    configs = [
        json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("peft", "ours")
    ]
    for field in ("target_parameters", "target_modules"):
        assert sorted(configs[0][field]) == sorted(configs[1][field]), field
    for field in ("rank_pattern", "alpha_pattern"):
        assert configs[0][field] == configs[1][field], field


def test_half_of_a_fused_pair_is_refused(checkpoints):
    model = pm.from_pretrained(checkpoints["qwen3_moe"][0])
    with pytest.raises(ValueError, match="fused into one `gate_up_proj`"):
        get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj"]), key=jax.random.key(0))


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_a_layer_in_target_modules_and_target_parameters_is_refused(checkpoints, layout):
    """PEFT refuses a layer named by `target_modules` and, by its weight, by
    `target_parameters`; so does peftx, naming the layer."""
    path = checkpoints["qwen3_moe"][0]
    kwargs = dict(r=2, target_modules=["q_proj"], target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="not also targeted with `target_modules`"):
        peft.get_peft_model(_torch_model(path), peft.LoraConfig(**kwargs))
    model = pm.from_pretrained(path, layout=layout)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj is targeted twice"):
        get_peft_model(model, LoraConfig(**kwargs), key=jax.random.key(0))
    # one layer named twice among others named once is refused too
    kwargs.update(target_modules=["v_proj", "layers.1.self_attn.q_proj"])
    with pytest.raises(ValueError, match="not also targeted"):
        peft.get_peft_model(_torch_model(path), peft.LoraConfig(**kwargs))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj is targeted twice"):
        get_peft_model(model, LoraConfig(**kwargs), key=jax.random.key(0))


# ---------------------------------------------------------------- mixed batches

# five examples (no activation axis of a weight's length) routed to three adapters and
# the base; the router `gate`, v_proj and both expert stacks adapted
MIXED_IDS = np.array([[0, 0, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 8, 9, 10, 11]] * 2)[
    :5
]
MIXED_MASK = (MIXED_IDS != 0).astype(np.int64)
ROWS = ["e1", "__base__", "e2", "e0", "e1"]


@pytest.fixture(scope="module")
def three_adapters(checkpoints, tmp_path_factory):
    """(directory holding PEFT's adapters e0, e1, e2 on Qwen3-MoE, {name: PEFT's logits
    with that adapter alone, "__base__": with none})."""
    path = checkpoints["qwen3_moe"][0]
    directory = tmp_path_factory.mktemp("three_adapters")
    kwargs = dict(_peft_config("qwen3_moe"), target_modules=["v_proj", "gate"])
    for i, name in enumerate(("e0", "e1", "e2")):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(_torch_model(path), peft.LoraConfig(**kwargs))
        model.save_pretrained(directory / name)
    # PEFT refuses mixed batches on target_parameters: each row is compared with its
    # adapter run alone
    theirs = peft.PeftModel.from_pretrained(_torch_model(path), directory / "e0", "e0").eval()
    for name in ("e1", "e2"):
        theirs.load_adapter(directory / name, name)
    logits = {}
    for name in ("e0", "e1", "e2"):
        theirs.set_adapter(name)
        logits[name] = torch_forward(theirs, MIXED_IDS, MIXED_MASK).logits.numpy()
    with theirs.disable_adapter():
        logits["__base__"] = torch_forward(theirs, MIXED_IDS, MIXED_MASK).logits.numpy()
    return directory, logits


@pytest.mark.parametrize("layout, path", [("stacked", "blocked"), ("unrolled", "ragged")])
def test_mixed_batches_on_experts_equal_peft_row_by_row(
    checkpoints, three_adapters, layout, path, monkeypatch
):
    """`adapter_names` routes every adapted weight, the expert stacks included, row by
    row: each row equals PEFT's logits with that row's adapter alone (or none), on the
    CPU's blocked products and on `ragged_dot_general`, building no dense update."""
    if path == "ragged":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    directory, theirs = three_adapters
    model = pm.from_pretrained(checkpoints["qwen3_moe"][0], layout=layout)
    ours = peftx.PeftModel.from_pretrained(model, directory / "e0", "e0")
    for name in ("e1", "e2"):
        ours = ours.load_adapter(directory / name, name)
    ids, mask = jnp.asarray(MIXED_IDS), jnp.asarray(MIXED_MASK)

    @eqx.filter_jit
    def run(model, names):
        return model(ids, mask, adapter_names=names).logits

    for names in (ROWS, ["e1"] * 5):
        with strict():
            got = np.asarray(run(ours, names))
        for i, name in enumerate(names):
            real = MIXED_MASK[i] == 1
            assert np.abs(got[i][real] - theirs[name][i][real]).max() < TOL, (names, i)
    for name in ("e0", "e1", "e2"):  # each adapter matters on every row
        assert real_diff(theirs[name], theirs["__base__"], MIXED_MASK) > 100 * TOL
    if path == "ragged":
        # the router left out: its weight (experts, hidden) has the shape of a factor's
        # expert slices
        def unrouted(x):
            return x.weight if isinstance(x, AdapterSet) and x.shape == (4, 32) else x

        is_set = lambda x: isinstance(x, AdapterSet)  # noqa: E731
        checked = jax.tree.map(unrouted, ours, is_leaf=is_set)
        assert_no_dense(lambda m: m(ids, mask, adapter_names=ROWS).logits, checked)
