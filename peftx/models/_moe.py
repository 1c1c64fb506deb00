"""Sparse mixture-of-experts blocks (Mixtral, Qwen3-MoE), as transformers 5 holds them
(`transformers/models/mixtral/modeling_mixtral.py`): a softmax router picking the top k
experts of each token, and the experts as fused 3-D weights, `gate_up_proj`
`(experts, 2·intermediate, hidden)` and `down_proj` `(experts, hidden, intermediate)`.

The experts run as grouped products: the (token, expert) pairs are sorted by expert and
each expert multiplies only its own rows (`grouped_matmul`), never every expert on every
token."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..implicit import gate_rows
from ._common import linear, normal_linear

# the grouped product's dimension numbers: rows of `x` (dim 0) ragged by expert, `x`'s
# features (dim 1) against the weight's input axis (dim 2), the weight's experts (dim 0)
GROUPED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def grouped_matmul(
    x: Float[Array, "rows dim_in"],
    w: Float[Array, "experts dim_out dim_in"],
    group_sizes: Int[Array, " experts"],
) -> Float[Array, "rows dim_out"]:
    """`x[rows of expert e] @ w[e].T` for each expert, the rows of `x` sorted by expert,
    `group_sizes[e]` of them for expert `e`.

    On GPU and TPU this is `lax.ragged_dot_general`, which XLA runs as one grouped GEMM.
    XLA:CPU has no grouped GEMM (JAX's CPU lowering of `ragged_dot` multiplies every row by
    every expert and masks), so on CPU the rows are padded by expert into blocks of equal
    length, each block multiplied by its own expert's weight in one batched product.
    """
    if jax.default_backend() != "cpu":
        return lax.ragged_dot_general(x, w, group_sizes, GROUPED)
    return _blocked(x, w, group_sizes)


def _blocked(x: Array, w: Array, group_sizes: Array) -> Array:
    rows, experts = x.shape[0], w.shape[0]
    # blocks about as long as an even share, so padding at most doubles the rows
    block = max(8, -(-rows // experts))
    n_blocks = -(-(rows + experts * (block - 1)) // block)
    padded = -(-group_sizes // block) * block
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    expert = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=rows)
    slot = jnp.arange(rows, dtype=jnp.int32) - start[expert] + padded_start[expert]
    xb = jnp.zeros((n_blocks * block, x.shape[1]), x.dtype).at[slot].set(x)
    xb = xb.reshape(n_blocks, block, x.shape[1])
    first_row = jnp.arange(n_blocks, dtype=jnp.int32) * block
    # blocks past the last expert's rows hold zeros; any weight serves them
    owner = jnp.minimum(jnp.searchsorted(padded_end, first_row, side="right"), experts - 1)
    # the row of `x` in each block's slot (padding: any row), for mixed-adapter gates
    source = jnp.zeros(n_blocks * block, jnp.int32).at[slot].set(jnp.arange(rows, dtype=jnp.int32))
    wb = gate_rows(jnp.take(w, owner, axis=0), source.reshape(n_blocks, block))
    yb = lax.dot_general(xb, wb, (((2,), (2,)), ((0,), (0,))))
    return yb.reshape(n_blocks * block, -1)[slot]


class MoeExperts(eqx.Module):
    """Every expert's SwiGLU MLP, fused: `gate_up_proj` `(experts, 2·intermediate,
    hidden)` (gate rows, then up rows) and `down_proj` `(experts, hidden, intermediate)`,
    each expert's matrix laid out as a `Linear` weight `(out, in)`."""

    gate_up_proj: Float[Array, "experts two_inter hidden"]
    down_proj: Float[Array, "experts hidden inter"]

    def __init__(
        self, experts: int, hidden: int, inter: int, std: float, *, key: PRNGKeyArray, dtype: Any
    ):
        kg, kd = jax.random.split(key)
        self.gate_up_proj = std * jax.random.normal(kg, (experts, 2 * inter, hidden), dtype)
        self.down_proj = std * jax.random.normal(kd, (experts, hidden, inter), dtype)


class SparseMoeBlock(eqx.Module):
    """The router `gate` (a `Linear` from hidden features to one logit per expert) and
    the `experts`."""

    gate: eqx.nn.Linear
    experts: MoeExperts

    def __init__(self, config: Any, *, key: PRNGKeyArray, dtype: Any):
        c = config
        kg, ke = jax.random.split(key)
        std = c.initializer_range
        self.gate = normal_linear(c.hidden_size, c.num_experts, False, kg, std, dtype)
        self.experts = MoeExperts(
            c.num_experts, c.hidden_size, c.moe_intermediate_size, std, key=ke, dtype=dtype
        )


def route(
    router_logits: Float[Array, "tokens experts"], top_k: int, normalize: bool
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Each token's `top_k` experts and their weights: the softmax of the router's logits
    (in float32), at the top `k`, renormalized to sum to one if `normalize`. Ties go to
    the lower expert index, as `torch.topk` breaks them."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def sparse_moe(
    block: SparseMoeBlock,
    x: Float[Array, "*batch hidden"],
    top_k: int,
    normalize: bool,
    act: Any,
) -> tuple[Float[Array, "*batch hidden"], Float[Array, "tokens experts"]]:
    """The block's output for `x`, and the router's logits (one row per token)."""
    shape = x.shape
    # the router on the batch's shape, so that a mixed-adapter batch routes its rows
    router_logits = linear(block.gate, x).reshape(-1, block.gate.out_features)
    x = x.reshape(-1, shape[-1])
    tokens = x.shape[0]
    weights, chosen = route(router_logits, top_k, normalize)
    experts = block.experts.gate_up_proj.shape[0]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    # each row's example (along `x`'s leading axis), which a mixed-adapter batch routes by
    example = token // (tokens // shape[0] if len(shape) > 1 else tokens)
    gate_up_proj, down_proj = (
        gate_rows(w, example) for w in (block.experts.gate_up_proj, block.experts.down_proj)
    )
    gate_up = grouped_matmul(x[token], gate_up_proj, group_sizes)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    y = grouped_matmul(act(gate) * up, down_proj, group_sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    out = jnp.zeros((tokens, shape[-1]), y.dtype).at[token].add(y)
    return out.reshape(shape).astype(x.dtype), router_logits


def load_balancing_loss(
    router_logits: Float[Array, "layers tokens experts"],
    top_k: int,
    attention_mask: Int[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """The Switch Transformer's auxiliary loss over all layers, as transformers'
    `load_balancing_loss_func` computes it: `experts · Σ_e f_e · P_e`, `f_e` the share of
    top-k assignments to expert `e` and `P_e` its mean router probability, over the real
    tokens of every layer (padding left out by `attention_mask`)."""
    layers, tokens, experts = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, chosen = lax.top_k(probs, top_k)
    counts = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(axis=-2)
    if attention_mask is None:
        real = jnp.ones((tokens,), jnp.float32)
    else:
        real = attention_mask.reshape(-1).astype(jnp.float32)
    rows = layers * jnp.sum(real)
    share = jnp.einsum("lte,t->e", counts, real) / rows
    prob = jnp.einsum("lte,t->e", probs, real) / rows
    return experts * jnp.sum(share * prob)
