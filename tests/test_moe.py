"""Mixtral and Qwen3-MoE against transformers in PyTorch
(`transformers/models/{mixtral,qwen3_moe}`), and the grouped expert products against
every expert run on every token, written out here.

Tiny random models with four experts, two per token, saved with `save_pretrained` (which
writes the Hub's per-expert keys) and loaded with `peftx.models.from_pretrained`.
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import close_in_scale
from safetensors import safe_open
from test_checkpoint import random_model
from test_llama import (
    BF16_U,
    COMMON,
    IDS,
    LAYERS,
    MASK,
    TOL,
    assert_layers_match,
    read_back,
    real_diff,
    torch_forward,
)

import peftx
import peftx.models as pm
from peftx.models import LlamaConfig
from peftx.models._moe import SparseMoeBlock, load_balancing_loss, sparse_moe
from peftx.train import causal_lm_loss

# a further architecture of the zoo: the whole suite runs it, the fast tier runs Llama
pytestmark = pytest.mark.zoo_sweep

EXPERTS = 4
CASES = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_key_value_heads=2, num_local_experts=EXPERTS, sliding_window=6),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=EXPERTS,
            moe_intermediate_size=24,
            head_dim=16,
            norm_topk_prob=False,
        ),
    ),
}


def hf_config(name: str, **overrides) -> transformers.PretrainedConfig:
    cls, extra = CASES[name]
    return cls(**{**COMMON, **extra, "num_experts_per_tok": 2, **overrides})


def torch_moe(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = hf_config(name, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from one, so q/k norms and layer norms matter
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """`moe(name)`: `(torch model, its save_pretrained directory)`, built once."""
    built = {}

    def get(name: str):
        if name not in built:
            model = torch_moe(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            built[name] = model, path
        return built[name]

    return get


@pytest.mark.parametrize("name, layout", [("mixtral", "unrolled"), ("qwen3_moe", "stacked")])
def test_causal_lm_matches_transformers(moe, name, layout):
    model, path = moe(name)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        assert any(".experts.3." in k for k in f.keys())  # the Hub's per-expert keys
    ours = pm.from_pretrained(path, layout=layout)
    assert ours.config.num_experts == EXPERTS
    ref = torch_forward(model, IDS, MASK, output_hidden_states=True, output_router_logits=True)
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours.model, ref.hidden_states, MASK, TOL)
    assert real_diff(out.logits, ref.logits, MASK) <= TOL
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-5)
    theirs = np.stack([r.numpy() for r in ref.router_logits])
    np.testing.assert_allclose(np.asarray(out.router_logits), theirs, atol=TOL)


@pytest.mark.parametrize(
    "name, change",
    [("qwen3_moe", dict(norm_topk_prob=True)), ("mixtral", dict(num_experts_per_tok=1))],
)
def test_each_feature_changes_the_output(moe, name, change):
    """Renormalizing the top-k weights, and the number of experts per token, move the
    logits far past the tolerance on the same weights: the parity test sees them."""
    model, _ = moe(name)
    other = torch_moe(name, **change)
    other.load_state_dict(model.state_dict())
    want = torch_forward(model, IDS, MASK).logits.numpy()
    assert real_diff(want, torch_forward(other, IDS, MASK).logits, MASK) > 1000 * TOL


def test_fused_checkpoint_layout_loads_the_same(moe, tmp_path):
    """transformers' in-memory layout (`save_original_format=False`: fused expert keys)
    loads to the same arrays as the Hub's per-expert layout."""
    model, path = moe("mixtral")
    model.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    a, b = pm.from_pretrained(path), pm.from_pretrained(tmp_path)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_model_loads_in_transformers(name, tmp_path):
    """A model made in peftx, saved, is read by transformers' Auto class with the same
    logits; the file has the per-expert keys transformers writes by default."""
    config = LlamaConfig.from_hf_config(hf_config(name))
    model = random_model(pm.LlamaForCausalLM, config, 1)
    peftx.save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert not any(k.endswith("gate_up_proj") for k in keys)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    got = model(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(got, torch_forward(theirs, IDS, MASK).logits, MASK) <= TOL


def test_bfloat16_matches_transformers(moe):
    """bf16 on both sides within a first-order rounding bound of the fp32 logits (the
    bound of test_llama's bf16 test, plus the router's and the experts' roundings)."""
    model, path = moe("mixtral")
    ours16 = pm.from_pretrained(path, dtype=jnp.bfloat16)
    exact = torch_forward(model, IDS, MASK).logits.numpy()
    theirs = torch_forward(copy.deepcopy(model).to(torch.bfloat16), IDS, MASK).logits
    out = ours16(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert out.dtype == jnp.bfloat16
    scale = float(np.max(np.abs(exact[MASK.astype(bool)])))
    bound = BF16_U * ((16 + 8) * LAYERS + 4) * scale
    ours_error = real_diff(out, exact, MASK)
    assert ours_error <= bound, (ours_error, bound)
    assert ours_error <= 2 * real_diff(theirs.float().numpy(), exact, MASK)


def test_training_loss_adds_the_aux_loss_as_transformers_does(moe):
    """`causal_lm_loss`'s mean equals transformers' `loss` with `output_router_logits`:
    the next-token cross-entropy plus `router_aux_loss_coef` times the aux loss."""
    model, path = moe("qwen3_moe")
    ours = pm.from_pretrained(path)
    labels = np.where(MASK.astype(bool), IDS, -100)
    ref = torch_forward(
        model, IDS, MASK, labels=torch.tensor(labels, dtype=torch.long), output_router_logits=True
    )
    batch = {"input_ids": IDS, "attention_mask": MASK, "labels": labels}
    total, sums = causal_lm_loss(ours, jax.tree.map(jnp.asarray, batch))
    np.testing.assert_allclose(float(total / sums["count"]), float(ref.loss), rtol=1e-5)
    assert float(ref.aux_loss) * model.config.router_aux_loss_coef > 1e-4  # it shows


# -- the grouped products against every expert on every token ----------------------------


def dense_moe(block: SparseMoeBlock, x, top_k: int, normalize: bool):
    """Every expert on every token, each weighted by the token's routing weight (zero for
    experts outside its top k, chosen by a stable sort: ties to the lower index)."""
    x2 = x.reshape(-1, x.shape[-1])
    logits = x2 @ block.gate.weight.T
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    rank = jnp.argsort(jnp.argsort(-probs, axis=-1, stable=True), axis=-1, stable=True)
    weights = jnp.where(rank < top_k, probs, 0.0)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    gate_up = jnp.einsum("th,eoh->teo", x2, block.experts.gate_up_proj)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    y = jnp.einsum("tei,ehi->teh", jax.nn.silu(gate) * up, block.experts.down_proj)
    out = jnp.einsum("teh,te->th", y, weights.astype(y.dtype))
    return out.reshape(x.shape).astype(x.dtype), logits


def _block(experts: int = 8, key: int = 0, dtype=jnp.float32) -> SparseMoeBlock:
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=12,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        initializer_range=0.5,
    )
    return SparseMoeBlock(config, key=jax.random.PRNGKey(key), dtype=dtype)


@pytest.mark.parametrize("shape", [(3, 5), (1, 3)])  # the second leaves experts idle
@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_products_equal_every_expert_on_every_token(normalize, shape):
    """Values and gradients (input, router, experts) of the grouped path equal the dense
    all-experts computation, also when some experts get no token."""
    block = _block()
    x = jax.random.normal(jax.random.PRNGKey(1), (*shape, 16))

    def loss(fn):
        def f(block, x):
            out, logits = fn(block, x, 2, normalize)
            return jnp.sum(jnp.sin(out)) + jnp.sum(logits**2) / 100

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    grouped = loss(lambda b, x, k, n: sparse_moe(b, x, k, n, jax.nn.silu))
    (v1, (gb1, gx1)), (v2, (gb2, gx2)) = grouped(block, x), loss(dense_moe)(block, x)
    # sums of a few products of order one: 64 ulps of each result's scale
    close_in_scale((v1, gx1, gb1), (v2, gx2, gb2), 64)


def test_top_k_ties_route_alike():
    """Tokens whose router logits tie (here, all equal) go to the same experts in both
    paths: the lower indices, as torch.topk picks them."""
    block = _block()
    block = eqx.tree_at(lambda b: b.gate.weight, block, jnp.zeros_like(block.gate.weight))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 4, 16))
    grouped = jax.jit(lambda b, x: sparse_moe(b, x, 2, True, jax.nn.silu)[0])
    got = grouped(block, x)
    np.testing.assert_allclose(
        got, jax.jit(dense_moe, static_argnums=(2, 3))(block, x, 2, True)[0], atol=1e-5
    )
    # and only experts 0 and 1 served them: zeroing the others changes nothing
    idle = eqx.tree_at(lambda b: b.experts.down_proj, block, block.experts.down_proj.at[2:].set(0))
    np.testing.assert_allclose(grouped(idle, x), got, atol=1e-6)


def test_aux_loss_leaves_padding_out():
    logits = jax.random.normal(jax.random.PRNGKey(3), (2, 6, EXPERTS))
    mask = jnp.asarray([[1, 1, 1], [0, 0, 1]])
    kept = load_balancing_loss(logits[:, jnp.asarray([0, 1, 2, 5])], 2)
    np.testing.assert_allclose(load_balancing_loss(logits, 2, mask), kept, rtol=1e-6)


# -- configs --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_round_trips_through_transformers(name, tmp_path):
    original = hf_config(name)
    ours = LlamaConfig.from_hf_config(original.to_dict())
    back = read_back(ours.to_hf_config(), tmp_path)
    assert type(back) is type(original)
    for field in ("num_experts_per_tok", "router_aux_loss_coef", "num_local_experts"):
        assert getattr(back, field) == getattr(original, field), field
    if name == "qwen3_moe":
        assert back.moe_intermediate_size == original.moe_intermediate_size
        assert back.norm_topk_prob == original.norm_topk_prob
    assert LlamaConfig.from_hf_config(back.to_dict()) == ours


@pytest.mark.parametrize(
    "name, change, words",
    [
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers must be empty"),
        ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step must be"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise must be 0"),
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
    ],
)
def test_configs_peftx_cannot_run_are_refused(name, change, words):
    d = hf_config(name).to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=words):
        LlamaConfig.from_hf_config(d)
