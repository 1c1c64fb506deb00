"""A model's repeated blocks, stored stacked (run by `lax.scan`) or unrolled (a tuple).

A `LayerStack` keeps identical blocks with every array stacked on a leading layer axis,
so a forward pass traces one block whatever the depth. Its segments are named by the
layers they hold (`"0-11"`), so a stacked Llama's query projection is found at
`model.layers.0-11.self_attn.q_proj` and the unrolled layout's at
`model.layers.3.self_attn.q_proj`, transformers' own name. A stack splits into several
segments when its layers stop being alike, e.g. when `layers_to_transform` adapts some
of them only: each segment is scanned in turn.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import PRNGKeyArray

from .._spans import parse_span, span_name
from ..implicit import Slot
from ..sharding import BATCH_AXES

Layout = Literal["stacked", "unrolled"]


@jtu.register_pytree_with_keys_class
class LayerStack:
    """Blocks whose arrays are stacked on a leading layer axis, in named segments.

    `segments["a-b"]` is one block (the class of each layer) whose arrays have a leading
    axis of length `b - a + 1`. A pytree whose children are keyed by segment name, so
    paths read `layers.0-11.self_attn.q_proj`. Made by `stack_layers`; undone by `unstack`.
    """

    __slots__ = ("segments",)

    def __init__(self, segments: dict[str, Any]):
        spans = sorted(parse_span(name) or (-1, -1) for name in segments)
        if not spans or spans[0][0] != 0 or any(s[0] < 0 or s[1] < s[0] for s in spans):
            raise ValueError(
                f"LayerStack segments must be named 'first-last' from 0, got {sorted(segments)}."
            )
        for (_, last), (first, _) in zip(spans, spans[1:]):
            if first != last + 1:
                raise ValueError(f"LayerStack segments {sorted(segments)} leave a gap.")
        self.segments = dict(segments)

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        names = tuple(span_name(*span) for span in self.spans)
        return [(jtu.DictKey(n), self.segments[n]) for n in names], names

    def tree_flatten(self) -> tuple[list[Any], tuple[str, ...]]:
        names = tuple(span_name(*span) for span in self.spans)
        return [self.segments[n] for n in names], names

    @classmethod
    def tree_unflatten(cls, names: tuple[str, ...], children: Any) -> "LayerStack":
        stack = object.__new__(cls)
        stack.segments = dict(zip(names, children))
        return stack

    def __getitem__(self, name: str) -> Any:
        return self.segments[name]

    def __repr__(self) -> str:
        return f"LayerStack({', '.join(self.segments)})"

    @property
    def spans(self) -> list[tuple[int, int]]:
        """`(first, last)` of each segment, in layer order."""
        return sorted(parse_span(name) for name in self.segments)  # type: ignore[type-var]

    def __len__(self) -> int:
        return self.spans[-1][1] + 1

    def ordered(self) -> list[tuple[tuple[int, int], Any]]:
        """`((first, last), block)` for each segment, in layer order."""
        return [(span, self.segments[span_name(*span)]) for span in self.spans]


def stack_layers(blocks: Sequence[Any]) -> LayerStack:
    """One `LayerStack` segment from identical blocks (same structure, same shapes)."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("stack_layers needs at least one block.")
    arrays = [eqx.filter(b, eqx.is_array) for b in blocks]
    static = eqx.filter(blocks[0], eqx.is_array, inverse=True)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *arrays)
    return LayerStack({span_name(0, len(blocks) - 1): eqx.combine(stacked, static)})


def make_layers(
    block: Any, config: Any, layout: Layout, key: PRNGKeyArray, dtype: Any
) -> "LayerStack | tuple[Any, ...]":
    """`config.num_hidden_layers` freshly initialized blocks (`block(config, key=...,
    dtype=...)`), stacked or unrolled. Built under one `jit`, so initializing a deep model
    compiles once instead of once per distinct array shape."""
    n = config.num_hidden_layers
    keys = jax.random.split(key, n)
    if layout == "stacked":
        build = eqx.filter_jit(eqx.filter_vmap(lambda k: block(config, key=k, dtype=dtype)))
        return LayerStack({span_name(0, n - 1): build(keys)})
    if layout == "unrolled":
        build = eqx.filter_jit(lambda k: block(config, key=k, dtype=dtype))
        return tuple(build(k) for k in keys)
    raise ValueError(f"layout must be 'stacked' or 'unrolled', got {layout!r}.")


def _slice_layers(block: Any, index: int | slice) -> Any:
    """`block` with every layer-stacked array indexed by `index` along its layer axis,
    and the `Slot`s of adapter templates (whose shape is static) reshaped to match."""

    def one(x: Any) -> Any:
        if isinstance(x, Slot):
            return Slot(
                jax.eval_shape(lambda a: a[index], jax.ShapeDtypeStruct(x.shape, x.dtype)).shape,
                x.dtype,
            )
        return x[index] if eqx.is_array(x) else x

    return jax.tree.map(one, block, is_leaf=lambda x: isinstance(x, Slot))


def unstack(layers: "LayerStack | Sequence[Any]") -> tuple[Any, ...]:
    """The blocks of a stack, one per layer (the unrolled layout)."""
    if not isinstance(layers, LayerStack):
        return tuple(layers)
    out = []
    for (first, last), block in layers.ordered():
        out.extend(_slice_layers(block, i) for i in range(last - first + 1))
    return tuple(out)


def split_stack(stack: LayerStack, boundaries: Sequence[int]) -> LayerStack:
    """`stack` with segments also starting at each of `boundaries` (layer indices)."""
    cuts = set(boundaries)
    segments = {}
    for (first, last), block in stack.ordered():
        starts = sorted({first} | {c for c in cuts if first < c <= last})
        for a, b in zip(starts, [*starts[1:], last + 1]):
            segments[span_name(a, b - 1)] = _slice_layers(block, slice(a - first, b - first))
    return LayerStack(segments)


RematPolicy = str | None

# The policies in `jax.checkpoint_policies` that are policies themselves; the rest
# (`save_only_these_names`, ...) are factories that need arguments a name cannot carry.
REMAT_POLICIES = tuple(
    name
    for name in (
        "everything_saveable",
        "nothing_saveable",
        "dots_saveable",
        "checkpoint_dots",
        "dots_with_no_batch_dims_saveable",
        "checkpoint_dots_with_no_batch_dims",
    )
    if hasattr(jax.checkpoint_policies, name)
)


def checkpoint_policy(name: RematPolicy) -> Any:
    if name is None:
        return None
    if name not in REMAT_POLICIES:
        raise ValueError(
            f"remat_policy {name!r} is not a policy of jax.checkpoint_policies; choose one of "
            f"{list(REMAT_POLICIES)}, or None to save nothing."
        )
    return getattr(jax.checkpoint_policies, name)


def _dots_but_low_rank_expansions(primitive: Any, *avals: Any, **params: Any) -> bool:
    """`dots_saveable`, except for products whose contracted size is at most a sixteenth
    of each operand's free size: an adapter's rank-`r` expansion `(x·Aᵀ)·Bᵀ`, as large as
    the layer's output, is recomputed from the small `x·Aᵀ` (saved) rather than stored
    next to the base product."""
    if primitive.name != "dot_general":
        return False
    lhs, rhs = avals[0].shape, avals[1].shape
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    k = math.prod(lhs[d] for d in lc)
    lhs_free = math.prod(n for d, n in enumerate(lhs) if d not in lc and d not in lb)
    rhs_free = math.prod(n for d, n in enumerate(rhs) if d not in rc and d not in rb)
    return 16 * k > min(lhs_free, rhs_free)


def _batch_split(step: Callable) -> Callable:
    """`step` with its carry (the hidden states) kept split over the batch axes of the
    mesh in context (`jax.set_mesh`, as a sharded train step sets it): XLA then gathers
    each layer's weights (FSDP) rather than every device's activations."""

    def split(block: Any, carry: Any, x: Any) -> tuple[Any, Any]:
        carry, y = step(block, carry, x)
        mesh = jax.sharding.get_abstract_mesh()
        rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
        if rows:
            spec = PartitionSpec(rows)
            carry = jax.tree.map(lambda h: lax.with_sharding_constraint(h, spec), carry)
        return carry, y

    return split


def run_layers(
    layers: "LayerStack | Sequence[Any]",
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    carry: Any,
    xs: Any = None,
    *,
    gradient_checkpointing: bool = False,
    remat_policy: RematPolicy = None,
) -> tuple[Any, Any]:
    """Run `carry, y = step(block, carry, x)` over the layers in order.

    `xs` (a pytree with a leading axis of one entry per layer, or None) is sliced per
    layer; the `y`s come back stacked the same way. A `LayerStack` runs each segment under
    `lax.scan`; a tuple of blocks runs unrolled. With `gradient_checkpointing`, each
    block's activations are recomputed in the backward pass, keeping what `remat_policy`
    (a name in `jax.checkpoint_policies`; None saves nothing) allows.

    Without it, a scanned block still saves only its matmul outputs (`dots_saveable`,
    less adapters' rank-`r` expansions, which are cheap to recompute) and recomputes the
    elementwise work in the backward pass. An unrolled graph gets this
    from XLA, which fuses elementwise residuals into their consumers; a scan must store
    every residual its backward reads, stacked over the layers, which cost 1.4x the
    unrolled step's temporaries and 1.2x its time (`benchmarks/scan_layers.py`).
    `remat_policy="everything_saveable"` with `gradient_checkpointing=True` stores them all.
    """
    step = _batch_split(step)
    if gradient_checkpointing:
        step = eqx.filter_checkpoint(step, policy=checkpoint_policy(remat_policy))
    elif isinstance(layers, LayerStack):
        step = eqx.filter_checkpoint(step, policy=_dots_but_low_rank_expansions)

    def sliced(a: int, b: int) -> Any:
        return jax.tree.map(lambda x: x[a:b], xs)

    ys = []
    if isinstance(layers, LayerStack):
        for (first, last), block in layers.ordered():
            arrays, static = eqx.partition(block, eqx.is_array)

            def body(c: Any, inputs: Any, static: Any = static) -> tuple[Any, Any]:
                layer_arrays, x = inputs
                return step(eqx.combine(layer_arrays, static), c, x)

            carry, y = lax.scan(body, carry, (arrays, sliced(first, last + 1)))
            ys.append(y)
    else:
        for i, block in enumerate(layers):
            carry, y = step(block, carry, jax.tree.map(lambda x: x[i], xs))
            ys.append(jax.tree.map(lambda t: t[None], y))
    if len(ys) == 1:
        return carry, ys[0]
    return carry, jax.tree.map(lambda *t: jnp.concatenate(t), *ys)


def _has_checkpointing(x: Any) -> bool:
    return isinstance(x, eqx.Module) and {"gradient_checkpointing", "remat_policy"} <= {
        f.name for f in dataclasses.fields(x)
    }


def _with_static(module: eqx.Module, **changes: Any) -> Any:
    """A copy of `module` with static fields changed, without calling its `__init__`
    (`eqx.tree_at` reaches only leaves)."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(module, field.name)))
    return new


def gradient_checkpointing(model: Any, enable: bool = True, policy: RematPolicy = None) -> Any:
    """`model` with gradient checkpointing switched on (or off) in every backbone it holds.

    **Arguments:**

    - `model`: any pytree holding peftx backbones (`LlamaModel`, ...), e.g. a
      `LlamaForCausalLM` or a `PeftModel` around one.
    - `enable`: recompute each block's activations in the backward pass (True) or keep them
      (False).
    - `policy`: what a checkpointed block may still save: the name of an argument-free
      policy in `jax.checkpoint_policies` (`"dots_saveable"`,
      `"dots_with_no_batch_dims_saveable"`, `"everything_saveable"`, ...), or None to
      save nothing. Another name raises `ValueError` listing the valid ones.

    **Returns:**

    A new model; `model` is unchanged. The outputs and gradients are the same either way;
    only memory and compute change.
    """
    checkpoint_policy(policy)
    return jax.tree.map(
        lambda x: (
            _with_static(x, gradient_checkpointing=bool(enable), remat_policy=policy)
            if _has_checkpointing(x)
            else x
        ),
        model,
        is_leaf=_has_checkpointing,
    )
