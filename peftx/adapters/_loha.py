"""LoHa: a Hadamard product of two low-rank matrices as the update, with PEFT's names.

The kind whole: `LoHaArray` and `LoHaConfig`."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    AdaptedLayer,
)
from .._kind import AbstractAdapter
from ._layout import WeightProduct
from ._lycoris import (
    LYCORIS_KEYS,
    LYCORIS_TAIL,
    AbstractLycoris,
    LycorisConfig,
    check_common,
    kaiming_uniform,
    register,
)
from ._products import LayerKeys


class LoHaArray(AbstractLycoris):
    """`W + (alpha/r) · (hada_w1_a @ hada_w1_b) ⊙ (hada_w2_a @ hada_w2_b)` for a `Linear`
    weight `(out, in)`, with PEFT's shapes: `hada_w1_a`, `hada_w2_a` `(out, r)` and
    `hada_w1_b`, `hada_w2_b` `(r, in)`.

    The Hadamard product has no factor-wise way to meet `x`, so `ΔW` is built once per
    layer per call (as PEFT builds it): two rank-`r` products and their elementwise product,
    `O(out·in·r)` flops and a few weight-sized float arrays (kept for the backward pass),
    against LoRA's `O(tokens·r·(out + in))`. It is cheap next to the base product only
    when the tokens per step outnumber `r` several times.
    """

    weight: Any
    hada_w1_a: Array
    hada_w1_b: Array
    hada_w2_a: Array
    hada_w2_b: Array
    dropout_key: LayerKeys | None
    r: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    rank_dropout: float = eqx.field(static=True)
    module_dropout: float = eqx.field(static=True)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "hada_w1_a": "hada_w1_a",
        "hada_w1_b": "hada_w1_b",
        "hada_w2_a": "hada_w2_a",
        "hada_w2_b": "hada_w2_b",
    }
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "hada_w1_a": (0, None),
        "hada_w1_b": (None, 1),
        "hada_w2_a": (0, None),
        "hada_w2_b": (None, 1),
    }

    def __init__(
        self,
        weight: Any,
        hada_w1_a: Array,
        hada_w1_b: Array,
        hada_w2_a: Array,
        hada_w2_b: Array,
        *,
        alpha: float | int,
        rank_dropout: float | int = 0.0,
        module_dropout: float | int = 0.0,
        dropout_key: LayerKeys | None = None,
    ):
        self.weight = weight
        self.hada_w1_a = hada_w1_a
        self.hada_w1_b = hada_w1_b
        self.hada_w2_a = hada_w2_a
        self.hada_w2_b = hada_w2_b
        self.dropout_key = dropout_key
        self.r = int(hada_w1_a.shape[-1])
        self.alpha = float(alpha)
        self.rank_dropout = float(rank_dropout)
        self.module_dropout = float(module_dropout)

    def __check_init__(self) -> None:
        check_common(self.r, self.rank_dropout, self.module_dropout, self.weight)
        *stack, out, in_ = self.weight.shape
        a, b = (*stack, out, self.r), (*stack, self.r, in_)
        factors = {n: getattr(self, n) for n in self.peft_keys}
        want = {"hada_w1_a": a, "hada_w1_b": b, "hada_w2_a": a, "hada_w2_b": b}
        got = {n: tuple(f.shape) for n, f in factors.items()}
        if got != want:
            raise ValueError(
                f"LoHa factors do not fit weight {tuple(self.weight.shape)} at rank "
                f"r={self.r}: expected {want}, got {got}."
            )
        dtypes = {jnp.dtype(f.dtype) for f in factors.values()}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "LoHa factors must share one floating-point dtype, got "
                f"{ {n: str(f.dtype) for n, f in factors.items()} }."
            )

    @property
    def rescales_rank_dropout(self) -> bool:
        return True

    def delta(self) -> Array:
        first = jnp.matmul(self.hada_w1_a, self.hada_w1_b)
        second = jnp.matmul(self.hada_w2_a, self.hada_w2_b)
        return jnp.asarray(self.scaling, first.dtype) * first * second

    def update(self, p: WeightProduct, x: Array, keep: Array | None) -> Array | None:
        delta = self.delta()
        if keep is not None:
            delta = delta * keep.astype(delta.dtype)[..., None]
        q = dataclasses.replace(p, preferred_element_type=None)
        return q.arrange(*q.contract(x.astype(delta.dtype), q.x, delta, q.w))


register(LoHaArray)


def loha(
    weight: Any,
    *,
    r: int = 8,
    alpha: float | int = 8.0,
    init_weights: bool = True,
    rank_dropout: float | int = 0.0,
    module_dropout: float | int = 0.0,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LoHaArray:
    """Wrap a `Linear` weight `(out, in)` in a `LoHaArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the weight, dense or implicit.
    - `r`, `alpha`, `rank_dropout`, `module_dropout`: as in `peft.LoHaConfig`.
    - `init_weights`: `True`: every factor Kaiming-uniform but `hada_w2_b`, zeros, so the
      output is the base's; `False`: all four Kaiming-uniform (for tests).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    check_common(r, rank_dropout, module_dropout, weight)
    out, in_ = weight.shape[-2:]
    keys = jax.random.split(key, 4)
    shapes = ((out, r), (r, in_), (out, r), (r, in_))
    factors = [kaiming_uniform(k, s, dtype) for k, s in zip(keys, shapes)]
    if init_weights:
        factors[3] = jnp.zeros(shapes[3], dtype)
    return LoHaArray(
        weight, *factors, alpha=alpha, rank_dropout=rank_dropout, module_dropout=module_dropout
    )


# -- the config ------------------------------------------------------------------------------

_LOHA_KEYS = (*LYCORIS_KEYS, *LYCORIS_TAIL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoHaConfig(LycorisConfig):
    """HF PEFT's `LoHaConfig`: the same field names, meanings and defaults.

    `ΔW = (alpha / r) · (hada_w1_a @ hada_w1_b) ⊙ (hada_w2_a @ hada_w2_b)` on each targeted
    Linear layer (`LoHaArray`); it costs a weight-sized update per layer and step.

    **Arguments:**

    - `r`, `alpha`: the rank of each of the two factors and `scaling = alpha / r`.
    - `rank_dropout`: in training, each row of `ΔW` (an output feature) is dropped with
      this probability and the kept ones divided by the fraction kept.
    - `module_dropout`: in training, the whole update of a layer is skipped with this
      probability.
    - `init_weights`: `True` (`hada_w2_b` zeros: a no-op at start) or `False` (all random).
    - `use_effective_conv2d`: Conv only, so it must stay `False`.
    - `rank_pattern`, `alpha_pattern`: per-module `r`/`alpha`, keyed by regex.
    - `target_modules`, `exclude_modules`, `layers_to_transform`, `layers_pattern`,
      `modules_to_save`, `fan_in_fan_out` and PEFT's bookkeeping: as for `LoraConfig`.
    Mixed-adapter batches are refused, as PEFT has none for LoHa.
    """

    peft_type: Literal["LOHA"] = "LOHA"
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "loha"
    _KEYS: ClassVar[tuple[str, ...] | None] = _LOHA_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        self.checked_layer(layer)
        return loha(
            base,
            r=layer.rank,
            alpha=layer.alpha,
            init_weights=self.init_weights,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            key=key,
        )
