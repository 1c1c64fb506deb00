"""LoKr: a Kronecker product of two small matrices as the update, with PEFT's names and
shapes, applied to `x` without forming it.

The kind whole: `LoKrArray` and `LoKrConfig`."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ._layout import Labels, WeightProduct
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

LoKrInit = Literal["default", "lycoris", "random"]


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """PEFT's split of `dimension` into `(m, n)`, `m <= n`, `m·n = dimension`: `factor`
    and its cofactor when `factor > 0` divides it; else the divisor pair nearest the
    square root whose smaller part is at most `factor` (any, for -1)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    limit = dimension if factor == -1 else factor
    m, n = 1, dimension
    while m < n:
        bigger = m + 1
        while dimension % bigger:
            bigger += 1
        cofactor = dimension // bigger
        if bigger + cofactor > m + n or bigger > limit:
            break
        m, n = bigger, cofactor
    return (n, m) if m > n else (m, n)


class LoKrArray(AbstractLycoris):
    """`W + (alpha/r) · w1 ⊗ w2` for a `Linear` weight `(out, in)`, with PEFT's layout.

    `out = L·K` and `in = M·N` are split by PEFT's `factorization(dim, decompose_factor)`;
    `w1` is `(L, M)`, stored whole as `lokr_w1` or, with `decompose_both` and a small
    rank, as `lokr_w1_a (L, r) @ lokr_w1_b (r, M)`; `w2` is `(K, N)`, stored whole as
    `lokr_w2` unless `r < max(K, N)/2`, then as `lokr_w2_a (K, r) @ lokr_w2_b (r, N)`. The
    fields a layout lacks are None.

    The Kronecker product is never formed: `(w1 ⊗ w2)·x` is `w1·X·w2ᵀ` for `x` reshaped to
    `X (M, N)`, two products with the small factors, `2·tokens·(in·K + out·M)` flops; the
    factors' gradients are small too. `w1` and `w2` themselves (`L·M` and `K·N` entries)
    are built.
    """

    weight: Any
    lokr_w1: Array | None
    lokr_w1_a: Array | None
    lokr_w1_b: Array | None
    lokr_w2: Array | None
    lokr_w2_a: Array | None
    lokr_w2_b: Array | None
    dropout_key: LayerKeys | None
    r: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    rank_dropout: float = eqx.field(static=True)
    module_dropout: float = eqx.field(static=True)
    rank_dropout_scale: bool = eqx.field(static=True)

    peft_keys: ClassVar[Mapping[str, str]] = {
        name: name
        for name in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
    }
    # every factor runs along a factor of the weight's axes, none along a whole axis: the
    # factors are small and stay whole
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {}

    def __init__(
        self,
        weight: Any,
        w1: Array | tuple[Array, Array],
        w2: Array | tuple[Array, Array],
        *,
        r: int,
        alpha: float | int,
        rank_dropout: float | int = 0.0,
        module_dropout: float | int = 0.0,
        rank_dropout_scale: bool = False,
        dropout_key: LayerKeys | None = None,
    ):
        """`w1` and `w2` are each a whole factor or an `(a, b)` pair whose product it is."""
        self.weight = weight
        self.lokr_w1, self.lokr_w1_a, self.lokr_w1_b = _whole_or_pair(w1)
        self.lokr_w2, self.lokr_w2_a, self.lokr_w2_b = _whole_or_pair(w2)
        self.dropout_key = dropout_key
        self.r = int(r)
        self.alpha = float(alpha)
        self.rank_dropout = float(rank_dropout)
        self.module_dropout = float(module_dropout)
        self.rank_dropout_scale = bool(rank_dropout_scale)

    def __check_init__(self) -> None:
        check_common(self.r, self.rank_dropout, self.module_dropout, self.weight)
        *stack, out, in_ = self.weight.shape
        (rows1, cols1), (rows2, cols2) = self._factor_shape(1), self._factor_shape(2)
        if rows1 * rows2 != out or cols1 * cols2 != in_:
            raise ValueError(
                f"LoKr factors w1 {(rows1, cols1)} and w2 {(rows2, cols2)} do not make a "
                f"Kronecker product of weight {tuple(self.weight.shape)}'s shape {(out, in_)}."
            )
        held = {n: getattr(self, n) for n in self.peft_keys if getattr(self, n) is not None}
        dtypes = {jnp.dtype(f.dtype) for f in held.values()}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "LoKr factors must share one floating-point dtype, got "
                f"{ {n: str(f.dtype) for n, f in held.items()} }."
            )
        for name, f in held.items():
            if tuple(f.shape[:-2]) != tuple(stack):
                raise ValueError(
                    f"{name} {tuple(f.shape)} lacks the layer axes {tuple(stack)} of the weight."
                )

    def _factor_shape(self, which: int) -> tuple[int, int]:
        whole, a, b = (getattr(self, f"lokr_w{which}{s}") for s in ("", "_a", "_b"))
        if (whole is None) == (a is None or b is None) or (a is None) != (b is None):
            raise ValueError(
                f"LoKr needs lokr_w{which}, or lokr_w{which}_a and lokr_w{which}_b, not both."
            )
        if whole is not None:
            return tuple(whole.shape[-2:])
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(
                f"lokr_w{which}_a {tuple(a.shape)} and lokr_w{which}_b {tuple(b.shape)} do not "
                "share a rank axis."
            )
        return a.shape[-2], b.shape[-1]

    @property
    def rescales_rank_dropout(self) -> bool:
        return self.rank_dropout_scale

    def factors(self) -> tuple[Array, Array]:
        """`(w1, w2)`, the small factors of the Kronecker product, `alpha/r` in `w1`."""
        w1 = self.lokr_w1 if self.lokr_w1 is not None else self.lokr_w1_a @ self.lokr_w1_b
        w2 = self.lokr_w2 if self.lokr_w2 is not None else self.lokr_w2_a @ self.lokr_w2_b
        return jnp.asarray(self.scaling, w1.dtype) * w1, w2

    def delta(self) -> Array:
        w1, w2 = self.factors()
        *stack, rows1, cols1 = w1.shape
        rows2, cols2 = w2.shape[-2:]
        kron = w1[..., :, None, :, None] * w2[..., None, :, None, :]
        return kron.reshape(*stack, rows1 * rows2, cols1 * cols2)

    def update(self, p: WeightProduct, x: Array, keep: Array | None) -> Array | None:
        s = self.stack_ndim
        stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
        if (in_l in p.x) == (out_l in p.x) or any(lab in p.x and lab not in p.out for lab in stack):
            return None  # neither or both of W's axes meet x, or a layer axis is summed
        w1, w2 = self.factors()
        x = x.astype(w1.dtype)
        # w1 (L, M) and w2 (K, N) labelled by the axis halves they run along
        w1_labels, w2_labels = (*stack, "L", "M"), (*stack, "K", "N")
        meets_in = in_l in p.x
        met, free = (in_l, out_l) if meets_in else (out_l, in_l)
        halves = ("M", "N") if meets_in else ("L", "K")
        sizes = (w1.shape[-1], w2.shape[-1]) if meets_in else (w1.shape[-2], w2.shape[-2])
        axis = p.x.index(met)
        x = x.reshape(*x.shape[:axis], *sizes, *x.shape[axis + 1 :])
        x_labels = (*p.x[:axis], *halves, *p.x[axis + 1 :])
        if keep is not None and not meets_in:
            if any(lab not in p.x for lab in stack):
                raise ValueError(
                    "rank or module dropout on a stack of LoKr adapters meeting x along the "
                    "output axis needs x batched along the layers; run the layers with "
                    "`jax.lax.scan`, or drop the keys with `without_dropout`."
                )
            rows = keep.reshape(*keep.shape[:-1], *sizes).astype(x.dtype)
            x = x * p.along(rows, (*stack, "L", "K"), x_labels)
        out_halves = ("L", "K") if meets_in else ("M", "N")
        target = tuple(h for lab in p.out for h in (out_halves if lab == free else (lab,)))
        y = _einsum(p, x, x_labels, w2, w2_labels, w1, w1_labels, target)
        at = target.index(out_halves[0])
        y = y.reshape(*y.shape[:at], -1, *y.shape[at + 2 :])
        if keep is not None and meets_in:
            y = y * p.along(keep.astype(y.dtype), (*stack, free), p.out)
        return y


def _einsum(
    p: WeightProduct,
    x: Array,
    x_labels: Labels,
    second: Array,
    second_labels: Labels,
    first: Array,
    first_labels: Labels,
    target: Labels,
) -> Array:
    """`x` contracted with `second`, then with `first` (never the two factors with each
    other, which would form the Kronecker product), into `target`'s labels."""
    ids = {lab: i for i, lab in enumerate(dict.fromkeys((*x_labels, *first_labels, *target)))}
    after_second = tuple(
        dict.fromkeys(lab for lab in (*x_labels, *second_labels) if lab in (*first_labels, *target))
    )

    def spec(labels: Labels) -> list[int]:
        return [ids[lab] for lab in labels]

    t = jnp.einsum(
        x, spec(x_labels), second, spec(second_labels), spec(after_second), precision=p.precision
    )
    return jnp.einsum(
        t, spec(after_second), first, spec(first_labels), spec(target), precision=p.precision
    )


def _whole_or_pair(w: Array | tuple[Array, Array]) -> tuple[Any, Any, Any]:
    if isinstance(w, tuple):
        return None, *w
    return w, None, None


register(LoKrArray)


def lokr(
    weight: Any,
    *,
    r: int = 8,
    alpha: float | int = 8.0,
    decompose_both: bool = False,
    decompose_factor: int = -1,
    init: LoKrInit = "default",
    rank_dropout: float | int = 0.0,
    module_dropout: float | int = 0.0,
    rank_dropout_scale: bool = False,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LoKrArray:
    """Wrap a `Linear` weight `(out, in)` in a `LoKrArray` shaped and initialized as PEFT
    does.

    **Arguments:**

    - `weight`: the weight, dense or implicit.
    - `r`, `alpha`, `decompose_both`, `decompose_factor`, `rank_dropout`, `module_dropout`,
      `rank_dropout_scale`: as in `peft.LoKrConfig`.
    - `init`: PEFT's `init_weights`. `"default"` (`True`): `w1` (or `lokr_w1_a`) zeros, the
      rest Kaiming-uniform, so the output is the base's; `"lycoris"`: `w2` (or
      `lokr_w2_b`) zeros instead; `"random"` (`False`): all Kaiming-uniform (for tests).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    check_common(r, rank_dropout, module_dropout, weight)
    if init not in ("default", "lycoris", "random"):
        raise ValueError(f"unknown LoKr init {init!r}; expected 'default', 'lycoris' or 'random'.")
    out, in_ = weight.shape[-2:]
    (rows1, rows2), (cols1, cols2) = (
        factorization(out, decompose_factor),
        factorization(in_, decompose_factor),
    )
    key1, key2 = jax.random.split(key)

    def factor(key: PRNGKeyArray, shape: tuple[int, int], split: bool, zero: str) -> Any:
        """A whole factor, or its `(a, b)` pair of rank `r`; `zero` names the part that
        starts at zero (`"whole"`, `"a"`, `"b"`, or `""` for none)."""
        if not split:
            if zero == "whole":
                return jnp.zeros(shape, dtype)
            return kaiming_uniform(key, shape, dtype)
        ka, kb = jax.random.split(key)
        a_shape, b_shape = (shape[0], r), (r, shape[1])
        a = jnp.zeros(a_shape, dtype) if zero == "a" else kaiming_uniform(ka, a_shape, dtype)
        b = jnp.zeros(b_shape, dtype) if zero == "b" else kaiming_uniform(kb, b_shape, dtype)
        return a, b

    split1 = decompose_both and r < max(rows1, cols1) / 2
    split2 = r < max(rows2, cols2) / 2
    zero1 = {"default": "a" if split1 else "whole"}.get(init, "")
    zero2 = {"lycoris": "b" if split2 else "whole"}.get(init, "")
    return LoKrArray(
        weight,
        factor(key1, (rows1, cols1), split1, zero1),
        factor(key2, (rows2, cols2), split2, zero2),
        r=r,
        alpha=alpha,
        rank_dropout=rank_dropout,
        module_dropout=module_dropout,
        rank_dropout_scale=rank_dropout_scale,
    )


# -- the config ------------------------------------------------------------------------------

_LOKR_KEYS = (
    *LYCORIS_KEYS,
    "decompose_both",
    "decompose_factor",
    "rank_dropout_scale",
    *LYCORIS_TAIL,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoKrConfig(LycorisConfig):
    """HF PEFT's `LoKrConfig`: the same field names, meanings and defaults.

    `ΔW = (alpha / r) · w1 ⊗ w2` on each targeted Linear layer (`LoKrArray`), applied to
    the activations factor by factor, never formed.

    **Arguments:**

    - `r`, `alpha`: the rank of the factored factors and `scaling = alpha / r`.
    - `decompose_both`: factor `w1` too (`lokr_w1_a @ lokr_w1_b`) when `r` is below half its
      larger side; `w2` is factored whenever `r` is below half its larger side.
    - `decompose_factor`: PEFT's `factorization` of `out` and `in` into the factors' sides:
      -1 splits near the square root, a divisor `f` gives `(f, dim / f)`.
    - `rank_dropout`: in training, each row of `ΔW` is dropped with this probability;
      `rank_dropout_scale` divides the kept rows by the fraction kept.
    - `module_dropout`: in training, a layer's whole update is skipped with this probability.
    - `init_weights`: `True` (`w1` zeros: a no-op at start), `"lycoris"` (`w2` zeros),
      `False` (all random).
    - `use_effective_conv2d`: Conv only, so it must stay `False`.
    - `rank_pattern`, `alpha_pattern` and the rest: as for `LoHaConfig`.
    Mixed-adapter batches are refused, as PEFT has none for LoKr.
    """

    peft_type: Literal["LOKR"] = "LOKR"
    decompose_both: bool = False
    decompose_factor: int = field(
        default=-1,
        range=Range(
            lambda v: v == -1 or v >= 1,
            "`decompose_factor` must be -1 (split near the square root) or a positive integer",
        ),
    )
    rank_dropout_scale: bool = False
    init_weights: bool | Literal["lycoris"] = True

    toml_table: ClassVar[str | None] = "lokr"
    _KEYS: ClassVar[tuple[str, ...] | None] = _LOKR_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        self.checked_layer(layer)
        init = {True: "default", False: "random"}.get(self.init_weights, self.init_weights)
        return lokr(
            base,
            r=layer.rank,
            alpha=layer.alpha,
            decompose_both=self.decompose_both,
            decompose_factor=self.decompose_factor,
            init=init,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            rank_dropout_scale=self.rank_dropout_scale,
            key=key,
        )
