"""SHiRA (HF PEFT's `SHIRA`): a sparse high-rank update, trained values on a fixed set
of a weight's entries.

The kind whole: `ShiraArray`, its handlers, PEFT's random mask, and `ShiraConfig`."""

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from .._config import (
    PEFT_BASE_KEYS,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ..implicit import materialize
from ._layout import Labels, WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES
from ._products import add_update, cast_base_on_astype, wider_dtype
from ._vera import torch_cpu_words

# the seed of a fresh `torch.Generator()` (c10's `default_rng_seed_val`): PEFT's random
# mask without `random_seed` draws from it, so that mask is fixed too
TORCH_DEFAULT_SEED = 67280421310721
# torch's `randperm` on the CPU swaps with 32-bit draws below this size (and switches to
# another algorithm, with 64-bit draws, from it)
_RANDPERM_32 = (2**32 - 1) // 20


@functools.cache
def _random_indices(out: int, in_: int, r: int, seed: int) -> np.ndarray:
    flat = out * in_
    k = r * (out + in_)
    if flat >= _RANDPERM_32:
        raise ValueError(
            f"a weight of {out}x{in_} = {flat} entries is beyond the size (< {_RANDPERM_32}) "
            "for which peftx reproduces torch's randperm; load the index set from a PEFT "
            "adapter file instead."
        )
    words = torch_cpu_words(seed, k).astype(np.int64)
    # the first k steps of torch's Fisher-Yates shuffle of range(flat): position i is
    # final after step i, so only the swapped positions need keeping
    swapped: dict[int, int] = {}
    chosen = np.empty(k, np.int64)
    for i in range(k):
        z = i + int(words[i]) % (flat - i)
        chosen[i] = swapped.get(z, z)
        swapped[z] = swapped.get(i, i)
    chosen.sort()  # PEFT reads the mask back with torch.where: row-major order
    indices = np.stack([chosen // in_, chosen % in_]).astype(np.int32)
    indices.flags.writeable = False
    return indices


def random_indices(
    out_features: int, in_features: int, r: int, random_seed: int | None = None
) -> Int[np.ndarray, "2 k"]:
    """PEFT's `random_mask` as SHiRA's index set, bit for bit: the first `r·(out + in)`
    entries of `torch.randperm(out·in)` drawn from a torch CPU generator seeded with
    `random_seed` (a fresh generator's seed when None), as `(rows, cols)` in row-major
    order, int32 (PEFT's `shira_indices`). Reproduced with NumPy (no torch at run time).
    """
    k = r * (out_features + in_features)
    if r < 1 or k > out_features * in_features:
        raise ValueError(
            f"The set rank {r} results in more shira params ({k} = r·({out_features} + "
            f"{in_features})) than the total number of params in the base layer "
            f"{out_features * in_features} and this is not allowed; choose a smaller r."
        )
    seed = TORCH_DEFAULT_SEED if random_seed is None else random_seed
    return _random_indices(out_features, in_features, r, seed).copy()


class ShiraArray(AbstractAdapter):
    """A `Linear` weight `(out, in)` plus PEFT's SHiRA update: `shira_weight (k,)` trained
    values at the fixed entries `shira_indices (2, k)` (rows, then columns, int32; PEFT's
    names and layout), `ΔW[rows[j], cols[j]] += shira_weight[j]`, `k = r·(out + in)`.

    A product takes one of two forms, chosen from the static shapes when it is traced.
    With many tokens, when the tokens meeting the weight (`x`'s axes the weight does not
    share) times `k` exceed `out·in` (every training step at a realistic size), it builds
    the adapted weight `W + ΔW` once, a scatter of the `k` values into a copy of `W`, and
    multiplies `x` by it in place of the base product; its gradient forms the weight's
    cotangent `gᵀ·x` and gathers the `k` entries (as PEFT does). With few tokens
    (decoding), it gathers `x`'s entries at `cols` (where the input features meet `x`),
    multiplies them by the values and sums them into `rows` (a scatter-add), or the
    reverse when the output features meet `x`, beside the base product: a `(tokens, k)`
    array and no weight-sized one. Several adapters active at once (an `AdapterSet`)
    each add their update to the base product, with many tokens as a product with `ΔW`
    scattered into zeros. The adapted weight and its product are in the wider of
    `x`'s, the weight's and the values' dtypes, rounded to the base product's; the
    gathered update is in the wider of `x`'s and the values' dtypes, added to the base
    product in the wider dtype and rounded to the base's. (PEFT adds `ΔW` to a copy of
    the weight in the weight's dtype; on a bfloat16 base that rounds the adapted entries
    to bfloat16 first, within bfloat16's rounding of the output.)
    PEFT's `scaling` is 1 and not saved; SHiRA has no dropout.
    """

    weight: Any
    shira_weight: Array
    shira_indices: Array

    peft_keys: ClassVar[Mapping[str, str]] = {"shira_weight": "shira_weight"}
    index_keys: ClassVar[Mapping[str, str]] = {"shira_indices": "shira_indices"}
    # a list of entries: its axes follow none of the weight's
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "shira_weight": (),
        "shira_indices": (),
    }

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"SHiRA needs a Linear weight (out, in), got shape {shape}.")
        stack = shape[:-2]
        values, indices = tuple(self.shira_weight.shape), tuple(self.shira_indices.shape)
        k = values[-1] if len(values) == len(stack) + 1 else None
        if k is None or values[:-1] != stack or indices != (*stack, 2, k):
            raise ValueError(
                f"shira_weight of shape {values} and shira_indices of shape {indices} do not "
                f"fit weight {shape}: expected {(*stack, 'k')} and {(*stack, 2, 'k')}."
            )
        if not jnp.issubdtype(self.shira_weight.dtype, jnp.floating):
            raise TypeError(
                f"shira_weight must be floating-point, got dtype {self.shira_weight.dtype}."
            )
        if not jnp.issubdtype(self.shira_indices.dtype, jnp.integer):
            raise TypeError(
                f"shira_indices must be integers, got dtype {self.shira_indices.dtype}."
            )

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    def delta(self) -> Array:
        """`ΔW` dense, in the weight's shape and the values' dtype (for merging only)."""
        *stack, out, in_ = self.weight.shape

        def one(values: Array, indices: Array) -> Array:
            return jnp.zeros((out, in_), values.dtype).at[indices[0], indices[1]].add(values)

        for _ in stack:
            one = jax.vmap(one)
        return one(self.shira_weight, self.shira_indices)

    def merged(self, weight: Array) -> Array:
        wide = wider_dtype(weight.dtype, self.shira_weight.dtype)
        return (weight.astype(wide) + self.delta().astype(wide)).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""
        wide = wider_dtype(merged.dtype, self.shira_weight.dtype)
        return (merged.astype(wide) - self.delta().astype(wide)).astype(merged.dtype)


def _builds_weight(w: ShiraArray, x: Array, p: WeightProduct) -> bool:
    """Whether the product is cheaper through a weight-sized array: when the tokens
    meeting each weight (`x`'s axes the weight does not share) times `k` exceed `out·in`,
    the gathered `(tokens, k)` array would outgrow the weight."""
    tokens = math.prod(n for n, lab in zip(x.shape, p.x) if lab not in p.w)
    out, in_ = w.shape[-2:]
    return tokens * w.shira_weight.shape[-1] > out * in_


def _scattered(w: ShiraArray, onto: Array, dtype: Any) -> Array:
    """`onto + ΔW` in `dtype`, for `onto` in the weight's shape: the `k` values added at
    their entries (a scatter of `k` entries into one weight-sized array)."""

    def one(onto: Array, values: Array, indices: Array) -> Array:
        return onto.astype(dtype).at[indices[0], indices[1]].add(values.astype(dtype))

    for _ in range(w.stack_ndim):
        one = jax.vmap(one)
    return one(onto, w.shira_weight, w.shira_indices)


def _times(p: WeightProduct, x: Array, w: Array) -> Array:
    """The product `p` of `x` with the dense `w`, in their dtype."""
    q = dataclasses.replace(p, preferred_element_type=None)
    return q.arrange(*q.contract(x, q.x, w, q.w))


def _shira_dot(w: ShiraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    if _builds_weight(w, x, p):
        # one product with W + ΔW in the wider dtype, in place of the base product
        wide = wider_dtype(x.dtype, w.weight.dtype, w.shira_weight.dtype)
        y = _times(p, x.astype(wide), _scattered(w, materialize(w.weight), wide))
        return y.astype(p.preferred_element_type or wider_dtype(x.dtype, w.weight.dtype))
    added = _update(w, x, p)
    if added is None:
        return NotImplemented
    return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), added)


def _shira_alone(
    w: ShiraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    """`ΔW·x` alone, for an `AdapterSet` adding several adapters' updates: with many
    tokens a product with `ΔW` scattered into zeros (in the wider of `x`'s and the
    values' dtypes), with few the gathered update."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    if _builds_weight(w, x, p):
        dtype = wider_dtype(x.dtype, w.shira_weight.dtype)
        return _times(p, x.astype(dtype), _scattered(w, jnp.zeros(w.shape, dtype), dtype))
    added = _update(w, x, p)
    return NotImplemented if added is None else added


def _update(w: ShiraArray, x: Array, p: WeightProduct) -> Any:
    """`ΔW·x` gathered, in the product's output order (the update's dtype); None when no
    weight axis meets `x` alone."""
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    out, in_ = w.shape[-2:]
    if in_l in p.x and out_l not in p.x:
        y, labels = _gathered(w, x, p.x, stack, in_l, out_l, out, by_cols=True)
    elif out_l in p.x and in_l not in p.x:  # xᵀ·ΔW: the output features meet x
        y, labels = _gathered(w, x, p.x, stack, out_l, in_l, in_, by_cols=False)
    else:
        return None
    return p.arrange(y, labels)


def _gathered(
    w: ShiraArray,
    x: Array,
    x_labels: Labels,
    stack: Labels,
    meet: str,
    to: str,
    n: int,
    *,
    by_cols: bool,
) -> tuple[Array, Labels]:
    """`Σ_j values[j]·x[…, src[j]]` summed into entry `dst[j]` of a new axis of length
    `n` that replaces `x`'s axis `meet` (labelled `to`): `src` the columns and `dst` the
    rows `by_cols`, else the reverse. A gather and a scatter-add of `k` entries per row
    of `x`, never a weight-sized array. The weight's stack axes lead the result; those
    that `x` shares are batch axes."""
    shared = [lab for lab in stack if lab in x_labels]
    order = [x_labels.index(lab) for lab in shared]
    order += [i for i, lab in enumerate(x_labels) if lab not in shared]
    x = jnp.transpose(x, order)
    rest = tuple(lab for lab in x_labels if lab not in shared)
    axis = rest.index(meet)
    dtype = wider_dtype(x.dtype, w.shira_weight.dtype)

    def one(values: Array, indices: Array, x: Array) -> Array:
        src, dst = (indices[1], indices[0]) if by_cols else (indices[0], indices[1])
        g = jnp.moveaxis(jnp.take(x, src, axis=axis), axis, 0).astype(dtype)
        g = g * values.astype(dtype).reshape(-1, *(1,) * (g.ndim - 1))
        y = jax.ops.segment_sum(g, dst, num_segments=n)
        return jnp.moveaxis(y, 0, axis)

    for lab in reversed(stack):
        one = jax.vmap(one, in_axes=(0, 0, 0 if lab in shared else None))
    y = one(w.shira_weight, w.shira_indices, x)
    return y, (*stack, *(to if lab == meet else lab for lab in rest))


weight_dot_handlers(ShiraArray, _shira_dot, _shira_alone)
cast_base_on_astype(ShiraArray)


def shira(
    weight: Any,
    *,
    r: int = 32,
    random_seed: int | None = None,
    indices: Any = None,
    init_weights: bool = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> ShiraArray:
    """Wrap a `Linear` weight `(out, in)` in a `ShiraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit (one layer, not a stack).
    - `r`: sets the number of trained entries, `k = r·(out + in)` (as many as LoRA of rank
      `r` trains; the update's rank is not limited by it). `k` must not exceed `out·in`.
    - `random_seed`: the seed of PEFT's random mask (`random_indices`); None draws from a
      fresh torch generator's seed, as PEFT does.
    - `indices`: instead of the random mask, the index set `(2, k)` (rows, columns),
      e.g. read from a PEFT file made with a mask function of one's own.
    - `init_weights`: `True`: `shira_weight` zeros (the output is the base's); `False`:
      standard normal (PEFT's `randn`, for tests; needs `key`).
    - `dtype`: `shira_weight`'s dtype.
    - `key`: a JAX PRNG key, used by `init_weights=False` only.
    """
    out, in_ = weight.shape[-2:]
    if r <= 0:
        raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
    if indices is None:
        indices = random_indices(out, in_, r, random_seed)
    indices = jnp.asarray(indices, jnp.int32)
    k = indices.shape[-1]
    if init_weights:
        values = jnp.zeros((k,), dtype)
    else:
        if key is None:
            raise ValueError("SHiRA with init_weights=False draws shira_weight: pass a `key`.")
        values = jax.random.normal(key, (k,), dtype)
    return ShiraArray(weight, values, indices)


# -- the config ------------------------------------------------------------------------------

_SHIRA_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "mask_type",
    "random_seed",
    "target_modules",
    "fan_in_fan_out",
    "init_weights",
    "modules_to_save",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShiraConfig(AbstractAdapterConfig):
    """HF PEFT's `ShiraConfig` (SHiRA, sparse high-rank adapters): the same field names,
    meanings and defaults. Each adapted `Linear` gets a `ShiraArray`.

    **Arguments:**

    - `r`: each layer trains `r·(out + in)` entries of its weight (LoRA's count at rank
      `r`; the update is not of rank `r`). Default 32; `r·(out + in)` may not exceed a
      layer's `out·in`.
    - `mask_type`: `"random"`, PEFT's only built-in mask: entries drawn as PEFT draws
      them (torch's `randperm`, reproduced bit for bit), the same for every layer of one
      shape. PEFT's masks of one's own (`config.mask_fn`) are not built here.
    - `random_seed`: the seed of the random mask; None uses a fresh torch generator's
      seed, which is fixed too (PEFT's behaviour).
    - `init_weights`: `True` (zeros: a no-op at start); `False` (standard normal, for
      tests).
    - `target_modules`, `exclude_modules`, `modules_to_save`, `layers_to_transform`,
      `layers_pattern`: as for `LoraConfig`; Linear layers only (not GPT-2's Conv1D, which
      PEFT's SHiRA does not adapt). PEFT's `ShiraConfig` has no `exclude_modules` or
      layer selection: a saved config names the adapted modules instead.
    - `fan_in_fan_out`: PEFT's field, unused (Linear layers only).
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.

    An adapter file holds the index set (`shira_indices`) beside the values; loading
    takes it from the file. Mixed-adapter batches are refused, as PEFT has none for SHiRA.
    """

    peft_type: Literal["SHIRA"] = "SHIRA"
    r: int = field(default=32, range=RANK)
    mask_type: Literal["random"] = "random"
    random_seed: int | None = field(
        default=None,
        range=Range(
            lambda v: 0 <= v < 2**64,
            "`random_seed` seeds torch's generator: an integer in [0, 2**64)",
        ),
    )
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "shira"
    # PEFT's SHiRA defaults are LoRA's, but Phi's attention only
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **LORA_TARGET_MODULES,
        "phi": ("q_proj", "v_proj"),
    }
    peft_selects_layers: ClassVar[bool] = False
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _SHIRA_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which PEFT's SHiRA does not adapt "
                "(torch.nn.Linear only); exclude it (exclude_modules) or use LoRA."
            )
        try:
            return shira(
                base,
                r=self.r,
                random_seed=self.random_seed,
                init_weights=self.init_weights,
                key=key,
            )
        except ValueError as e:
            raise ValueError(f"SHiRA on {layer.path!r}: {e}") from None

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"SHiRA adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        changes = super().as_saved(placed)
        if self.exclude_modules is not None:  # PEFT's ShiraConfig has no exclude_modules
            changes.update(target_modules=tuple(path for path, _ in placed), exclude_modules=None)
        return changes
