"""LoRA: `W + s·B·A` as an implicit array, with HF PEFT's names, shapes and inits."""

import abc
import dataclasses
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ..._dtypes import float_dtype
from ..._kind import AbstractAdapter
from ...implicit import (
    Transposed,
    dense_base,
    outer_vmap_size,
    primitive_handler,
)
from .._layout import Labels, WeightProduct, weight_dot_handlers
from .._products import (
    LayerKeys,
    add_update,
    branch_dtype,
    cast_base_on_astype,
    check_rank,
    dropout,
    fused_low_rank,
    low_rank,
)
from ._loftq import loftq
from ._mica import mica
from ._weight import dense_2d

# and "pissa_niter_K" (K a non-negative int): PiSSA by randomized SVD
LoraInit = Literal["default", "gaussian", "pissa", "olora", "orthogonal", "mica", "loftq", "random"]


class AbstractLowRank(AbstractAdapter):
    """The fields and arithmetic shared by `LoraArray` and `DoraArray`."""

    weight: Any
    lora_A: Array
    lora_B: Array
    dropout_key: LayerKeys | None
    draws_dropout: ClassVar[bool] = True
    lora_alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)
    lora_dropout: float = eqx.field(static=True)
    kernel_ndim: int = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    @property
    def r(self) -> int:
        return self.lora_A.shape[self.stack_ndim]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def stack_ndim(self) -> int:
        """Leading axes added by stacking layers (with `eqx.filter_vmap`)."""
        return len(self.weight.shape) - 2 - self.kernel_ndim

    def delta(self) -> Array:
        """`scaling · lora_B @ lora_A` in the weight's shape, in the adapters' dtype."""
        return self.scaling * _product(self.lora_B, self.lora_A, self.stack_ndim)

    @abc.abstractmethod
    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""


def init_low_rank(
    self: AbstractLowRank,
    weight: Any,
    lora_A: Array,
    lora_B: Array,
    lora_alpha: float | int,
    use_rslora: bool,
    lora_dropout: float | int,
    dropout_key: LayerKeys | None,
    compute_dtype: Any,
) -> None:
    _check_factors(weight, lora_A, lora_B, lora_dropout)
    self.weight = weight
    self.lora_A = lora_A
    self.lora_B = lora_B
    self.dropout_key = dropout_key
    self.lora_alpha = float(lora_alpha)
    self.use_rslora = bool(use_rslora)
    self.lora_dropout = float(lora_dropout)
    self.kernel_ndim = len(weight.shape) - 2
    self.compute_dtype = _checked_compute_dtype(compute_dtype)


class LoraArray(AbstractLowRank):
    """`weight + scaling · lora_B @ lora_A`, never formed when multiplied.

    The layout is Equinox's (and PyTorch's): a `Linear` weight is `(out, in)`, with
    `lora_A` `(r, in)` and `lora_B` `(out, r)`; a `Conv` weight is `(out, in, *kernel)`, with
    `lora_A` `(r, in, *kernel)` (a convolution like the layer's) and `lora_B`
    `(out, r, 1, ...)` (a 1x1 convolution), as in HF PEFT. `scaling` is
    `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.

    `weight` may itself be implicit (an `NF4Array` for QLoRA). Arrays stacked by
    `eqx.filter_vmap` (one per layer) work under `jax.lax.scan` and `jax.vmap`.

    Dropout (`lora_dropout > 0`) applies to the input of `lora_A` and only when
    `dropout_key` is set, see `with_dropout`.

    `frozen` names factors saved but not trained (`"lora_B"` for MiCA, as PEFT freezes it).

    Mixed precision follows PEFT: the base product keeps its own dtype and precision; the
    adapter branch casts the input to `compute_dtype` (default: the factors' dtype), and
    its output is added to the base output in the wider dtype and rounded once to the
    base's. Gradients have the dtype of the parameter they belong to. E.g. a bfloat16
    base with float32 factors trains float32 factors (and float32 optimizer state);
    `with_compute_dtype(model, jnp.bfloat16)` runs their branch in bfloat16.
    """

    peft_keys: ClassVar[Mapping[str, str]] = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}
    # lora_A's second axis runs along the weight's input axis, lora_B's first along its
    # output axis; the rank axis is their own
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lora_A": (None, 1),
        "lora_B": (0, None),
    }
    frozen: frozenset[str] = eqx.field(static=True)

    def __init__(
        self,
        weight: Any,
        lora_A: Array,
        lora_B: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool = False,
        lora_dropout: float | int = 0.0,
        dropout_key: LayerKeys | None = None,
        compute_dtype: Any = None,
        frozen: Collection[str] = (),
    ):
        if not set(frozen) <= set(self.peft_keys):
            raise ValueError(
                f"frozen names factors of a LoRA ({sorted(self.peft_keys)}); got {sorted(frozen)}."
            )
        self.frozen = frozenset(frozen)
        init_low_rank(
            self,
            weight,
            lora_A,
            lora_B,
            lora_alpha,
            use_rslora,
            lora_dropout,
            dropout_key,
            compute_dtype,
        )

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        base = merged - self.delta().astype(merged.dtype)
        return base.astype(merged.dtype)

    def frozen_keys(self) -> frozenset[str]:
        return self.frozen

    @classmethod
    def weighted(
        cls, present: Sequence[tuple[AbstractAdapter, float]], combination_type: str, config: Any
    ) -> "LoraArray":
        """PEFT's combinations of rank `config.r`, see `weighted_factors`."""
        factors = [(a.lora_A, a.lora_B, a.scaling, w) for a, w in present]
        lora_A, lora_B = weighted_factors(factors, combination_type, config.r)
        return LoraArray(
            present[0][0].weight,
            lora_A,
            lora_B,
            lora_alpha=config.r,
            use_rslora=config.use_rslora,
            lora_dropout=config.lora_dropout,
        )


def weighted_factors(
    factors: Sequence[tuple[Array, Array, float, float]], combination_type: str, rank: int
) -> tuple[Array, Array]:
    """`add_weighted_adapter`'s new `(A, B)` of rank `rank` (with scaling 1 when alpha is
    the rank) from each adapter's `(A, B, scaling, weight)`, `ΔW = s·B·A` (PEFT's roles):
    `"linear"`, the weighted sums of the factors; `"cat"`, the factors stacked (exactly
    `Σ w·s·B·A`, adapters missing here leaving zero rows); `"svd"`, the top `rank`
    singular triplets of `Σ w·s·B·A`."""
    dtype = factors[0][0].dtype
    if combination_type == "linear":
        a_new = sum(math.copysign(math.sqrt(abs(w * s)), w * s) * a for a, _, s, w in factors)
        b_new = sum(math.sqrt(abs(w * s)) * b for _, b, s, w in factors)
    elif combination_type == "cat":
        a_new = jnp.concatenate([w * s * a for a, _, s, w in factors], axis=0)
        b_new = jnp.concatenate([b for _, b, _, _ in factors], axis=1)
        pad = rank - a_new.shape[0]
        a_new = jnp.pad(a_new, [(0, pad)] + [(0, 0)] * (a_new.ndim - 1))
        b_new = jnp.pad(b_new, [(0, 0), (0, pad)] + [(0, 0)] * (b_new.ndim - 2))
    else:
        a_shape, b_shape = factors[0][0].shape[1:], factors[0][1].shape
        delta = sum(
            w * s * b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1) for a, b, s, w in factors
        )
        u, sv, vh = jnp.linalg.svd(delta.astype(jnp.float32), full_matrices=False)
        a_new = vh[:rank].reshape(rank, *a_shape)
        b_new = (u[:, :rank] * sv[None, :rank]).reshape(b_shape[0], rank, *b_shape[2:])
    return a_new.astype(dtype), b_new.astype(dtype)


def _checked_compute_dtype(dtype: Any) -> Any:
    return None if dtype is None else float_dtype(dtype, "compute_dtype")


def _check_factors(weight: Any, lora_A: Any, lora_B: Any, lora_dropout: float) -> None:
    shape = tuple(weight.shape)
    if len(shape) < 2:
        raise ValueError(f"LoRA needs a weight of 2 or more dimensions, got shape {shape}.")
    out, in_, kernel = shape[0], shape[1], shape[2:]
    r = lora_A.shape[0]
    want_a, want_b = (r, in_, *kernel), (out, r, *(1,) * len(kernel))
    if tuple(lora_A.shape) != want_a or tuple(lora_B.shape) != want_b:
        raise ValueError(
            f"LoRA factors do not fit weight {shape}: expected lora_A {want_a} and lora_B "
            f"{want_b} for rank r={r}, got lora_A {tuple(lora_A.shape)} and lora_B "
            f"{tuple(lora_B.shape)}."
        )
    check_rank(r, shape)
    for name, factor in (("lora_A", lora_A), ("lora_B", lora_B)):
        if not jnp.issubdtype(factor.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got dtype {factor.dtype}.")
    if lora_A.dtype != lora_B.dtype:
        raise TypeError(
            f"lora_A and lora_B must share a dtype, got {lora_A.dtype} and {lora_B.dtype}."
        )
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}.")


def _product(b: Array, a: Array, stack_ndim: int) -> Array:
    """`b @ a` for factors shaped like a weight (conv kernels flattened and restored)."""
    s = stack_ndim
    r = a.shape[s]
    flat_b = b.reshape(*b.shape[: s + 1], r)
    flat_a = a.reshape(*a.shape[: s + 1], -1)
    out = jnp.matmul(flat_b, flat_a)
    return out.reshape(*b.shape[: s + 1], *a.shape[s + 1 :])


# --------------------------------------------------------------------------------------
# Products


def lora_terms(
    w: AbstractLowRank,
    x: Array,
    w_is_lhs: bool,
    params: dict[str, Any],
    base: Array | None = None,
) -> tuple[Array, Array, Array] | None:
    """`(W·x, W·x_dropped, scaling·(B·A)·x_dropped)`. The first two are the original
    product (its dtype and precision); the third is the adapter branch, in its compute
    dtype (see `with_compute_dtype`), computed token-major (`x` on the left) and without
    forming `B·A`. None when the layout is not one a low-rank product can follow. `base`
    is `W·x` when the caller has it already."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w, p)
    if order is None:
        return None
    if base is None:
        base = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    x_d = dropout(x, w.lora_dropout, w.dropout_key, p.x, p.w[: w.stack_ndim])
    base_d = base if x_d is x else p.arrange(*p.contract(x_d, p.x, w.weight, p.w))
    dtype = branch_dtype(w)
    first, second = order(w.lora_A.astype(dtype), w.lora_B.astype(dtype))
    scale = jnp.asarray(w.scaling, dtype)
    delta = low_rank(p, *order(*_factor_labels(w, p)), ())(x_d.astype(dtype), first, second, scale)
    return base, base_d, delta


def _factor_labels(w: AbstractLowRank, p: WeightProduct) -> tuple[Labels, Labels]:
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    return (*stack, "r", in_l), (*stack, out_l, "r")


def _factor_order(w: AbstractLowRank, p: WeightProduct) -> Any:
    """Orders `(A, B)`-like pairs as `(first, second)`: the factor that meets `x` first.
    None when neither axis of W meets `x` (an outer product)."""
    s = w.stack_ndim
    out_l, in_l = p.w[s], p.w[s + 1]
    if in_l in p.x:
        return lambda a, b: (a, b)
    if out_l in p.x:
        return lambda a, b: (b, a)
    return None


def _mixed_lora_update(
    ws: list[Any],
    gate: Array,
    x: Array,
    w_is_lhs: bool,
    params: dict[str, Any],
    base: Array,
) -> Any:
    """`Σ_k gate_k · scaling_k · B_k·A_k·x` as one low-rank product of rank `Σ r_k`: the
    factors concatenated along `r`, the gate and scalings applied to the small `(tokens,
    Σ r)` intermediate. `gate` is `(n,)` (one row) or `(*lead, n)` (rows along `x`'s
    leading axes). The result is in the adapters' compute dtype. Plain LoRA without active dropout
    only; otherwise `NotImplemented`."""
    if (
        any(w.kernel_ndim or (w.lora_dropout and w.dropout_key is not None) for w in ws)
        or len({(w.stack_ndim, branch_dtype(w)) for w in ws}) != 1
    ):
        return NotImplemented
    w0 = ws[0]
    p = WeightProduct.parse(len(w0.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w0, p)
    if order is None:
        return NotImplemented
    s, dtype = w0.stack_ndim, branch_dtype(w0)
    a = jnp.concatenate([w.lora_A.astype(dtype) for w in ws], axis=s)
    b = jnp.concatenate([w.lora_B.astype(dtype) for w in ws], axis=s + 1)
    # one column of the gate per adapter, repeated over its rank, times its scaling
    repeat = jnp.asarray([k for k, w in enumerate(ws) for _ in range(w.r)])
    scalings = jnp.asarray([w.scaling for w in ws for _ in range(w.r)], dtype)
    scale = jnp.take(gate.astype(dtype), repeat, axis=-1) * scalings.reshape(
        (1,) * (gate.ndim - 1) + (-1,)
    )
    scale_labels = (*p.x[: gate.ndim - 1], "r")
    first, second = order(a, b)
    return low_rank(p, *order(*_factor_labels(w0, p)), scale_labels)(
        x.astype(dtype), first, second, scale
    )


def lora_dot(w: AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    if w.kernel_ndim:
        return NotImplemented
    fused = _fused_lora_dot(w, x, w_is_lhs, params)
    if fused is not None:
        return fused
    terms = lora_terms(w, x, w_is_lhs, params)
    if terms is None:
        return NotImplemented
    base, _, delta = terms
    return add_update(base, delta)


def _fused_lora_dot(
    w: AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any]
) -> Array | None:
    """`W·x + scaling·B·A·x_dropped` as one product: `[x, t]·[W, second]` concatenated
    along the axis that `x` meets, where `t = scaling·first·x_dropped` and `first`,
    `second` are `A`, `B` in the order they meet `x`. For an unstacked LoRA matrix whose
    base is dense (or a lazy transpose of a dense one), with one dtype throughout, and at
    least as many tokens as the met axis is long, counting the examples of an outer
    `jax.vmap` that does not map `W` (one copy of `W` then serves them all); else None.

    One GEMM instead of the base GEMM plus a rank-`r` product as large as the output and
    their sum; reverse mode gets `g·second` from the same GEMM as `g·W`; and a remat policy
    that saves matmul outputs (`dots_saveable`) saves the layer's output once, not its two
    terms. The price is a copy of `W` per call, which only pays off when the activations
    are at least as large as the weight: with few tokens (decoding) the separate branch is
    used. The `r` extra columns may change the GEMM's summation order: the base's part
    equals `W·x` to rounding, not bit for bit."""
    base = dense_base(w.weight)
    if type(w) is not LoraArray or w.stack_ndim or base is None:
        return None
    weight, perm = base
    dtype = branch_dtype(w)
    if len({x.dtype, weight.dtype, w.lora_A.dtype, w.lora_B.dtype, dtype}) != 1:
        return None
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w, p)
    if order is None or p.preferred_element_type not in (None, x.dtype):
        return None
    meet = 1 if p.w[1] in p.x else 0
    if p.w[meet] in p.out or p.w[1 - meet] in p.x:  # a batch axis, not a contracted one
        return None
    tokens = x.size // x.shape[p.x.index(p.w[meet])]
    if tokens * outer_vmap_size(x) // outer_vmap_size(weight) < w.shape[meet]:
        return None
    x = jnp.asarray(x)
    x_d = dropout(x, w.lora_dropout, w.dropout_key, p.x, ())
    first, second = order(w.lora_A, w.lora_B)
    if perm == (1, 0):  # W's own frame: its labels, met axis and factors transposed back
        p, meet, first, second = dataclasses.replace(p, w=p.w[::-1]), 1 - meet, first.T, second.T
    scale = jnp.asarray(w.scaling, dtype)
    return fused_low_rank(p, meet)(x, x_d, weight, first, second, scale)


def lora_update(
    w: AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    if w.kernel_ndim:
        return NotImplemented
    terms = lora_terms(w, x, w_is_lhs, params, base)
    return NotImplemented if terms is None else terms[2]


weight_dot_handlers(LoraArray, lora_dot, lora_update, _mixed_lora_update)


@primitive_handler("conv_general_dilated")
def _lora_conv(primitive: Any, x: jax.Array, w: LoraArray, **params: Any) -> Any:
    if not w.kernel_ndim or w.stack_ndim or params["feature_group_count"] != 1:
        return NotImplemented
    if params["batch_group_count"] != 1:
        return NotImplemented
    base = primitive.bind(x, w.weight, **params)
    adapter_params = {**params, "preferred_element_type": None}
    dtype = branch_dtype(w)
    x_d = dropout(x, w.lora_dropout, w.dropout_key).astype(dtype)
    t = primitive.bind(x_d, w.lora_A.astype(dtype), **adapter_params)
    _, rhs_spec, out_spec = params["dimension_numbers"]
    n = w.kernel_ndim
    pointwise = {
        **adapter_params,
        "window_strides": (1,) * n,
        "padding": ((0, 0),) * n,
        "lhs_dilation": (1,) * n,
        "rhs_dilation": (1,) * n,
        "dimension_numbers": lax.ConvDimensionNumbers(out_spec, rhs_spec, out_spec),
    }
    delta = primitive.bind(t, w.lora_B.astype(dtype), **pointwise)
    return add_update(base, jnp.asarray(w.scaling, dtype) * delta)


@primitive_handler("transpose")
def _lora_transpose(primitive: Any, w: LoraArray, *, permutation: tuple[int, ...]) -> Any:
    s = w.stack_ndim
    if w.kernel_ndim or tuple(permutation) != (*range(s), s + 1, s):
        return NotImplemented
    # (W + s·B·A)ᵀ = Wᵀ + s·Aᵀ·Bᵀ: again a LoRA, with the factors' roles exchanged; the
    # base is transposed lazily, so no weight-sized copy of it is made.
    return eqx.tree_at(
        lambda m: (m.weight, m.lora_A, m.lora_B),
        w,
        (
            Transposed(w.weight, tuple(permutation)),
            jnp.swapaxes(w.lora_B, -1, -2),
            jnp.swapaxes(w.lora_A, -1, -2),
        ),
    )


cast_base_on_astype(AbstractLowRank)


# --------------------------------------------------------------------------------------
# Construction


def lora(
    weight: Any,
    *,
    r: int = 8,
    lora_alpha: float | int = 8.0,
    init: LoraInit | str = "default",
    use_rslora: bool = False,
    lora_dropout: float | int = 0.0,
    loftq_bits: int = 4,
    loftq_iter: int = 1,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LoraArray:
    """Wrap `weight` in a `LoraArray` with fresh factors, initialized as HF PEFT does.

    **Arguments:**

    - `weight`: a `Linear` weight `(out, in)` or `Conv` weight `(out, in, *kernel)`; dense
      or implicit (e.g. `NF4Array` for QLoRA).
    - `r`, `lora_alpha`, `use_rslora`, `lora_dropout`: as in `peft.LoraConfig`.
    - `init`: PEFT's `init_lora_weights`. `"default"` (`True`): `lora_A` Kaiming-uniform,
      `lora_B` zeros, so the output equals the base model's. `"gaussian"`: `lora_A` normal
      with std `1/r`, `lora_B` zeros. `"pissa"`: the top-`r` singular triplets of `W` go
      into the factors and `W` is replaced by the residual (same output as the base).
      `"pissa_niter_K"`: the same from a randomized SVD (Halko et al., as
      `torch.svd_lowrank(W, r, niter=K)`), drawn with `key`. `"olora"`: the QR
      decomposition `W = QR` gives `lora_B = Q[:, :r]`, `lora_A = R[:r]`, and `W` is
      replaced by the residual. `"orthogonal"`: `lora_A` and `lora_B` random, built from the
      odd and even rows of a random orthogonal `r × r` matrix, so that `B @ A = 0` (`r` must
      be even); `W` is left as it is. `"mica"`: `lora_B` the left singular vectors of the
      `r` smallest singular values of `W`, held fixed (`frozen`), `lora_A` zeros and
      trained; `W` is left as it is. `"loftq"`: `W` is replaced by its NF4 quantization
      less the factors (an `NF4Array`), the factors by the SVD of what quantization lost,
      over `loftq_iter` rounds (PEFT's `loftq_init`, 4 bits). `"random"` (`False`): both
      factors random, for tests.
    - `loftq_bits`, `loftq_iter`: PEFT's `LoftQConfig`, for `init="loftq"`.
    - `dtype`: the factors' dtype (PEFT keeps adapters in float32).
    - `key`: a JAX PRNG key.

    **Returns:**

    A `LoraArray`.
    """
    shape = tuple(weight.shape)
    if len(shape) < 2:
        raise ValueError(f"LoRA needs a weight of 2 or more dimensions, got shape {shape}.")
    check_rank(r, shape)
    out, in_, kernel = shape[0], shape[1], shape[2:]
    a_shape, b_shape = (r, in_, *kernel), (out, r, *(1,) * len(kernel))
    a_key, b_key = jax.random.split(key)
    # Kaiming-uniform with a=sqrt(5), PyTorch's default for Linear/Conv weights.
    a_bound = 1.0 / math.sqrt(in_ * math.prod(kernel))
    scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
    niter = pissa_niter(init)
    frozen = ()
    if init == "pissa" or niter is not None:
        weight, lora_A, lora_B = _pissa(weight, r, scaling, dtype, niter, a_key)
    elif init == "olora":
        weight, lora_A, lora_B = _olora(weight, r, scaling, dtype)
    elif init == "orthogonal":
        lora_A, lora_B = _orthogonal(weight, r, dtype, key)
    elif init == "mica":
        lora_A, lora_B = mica(weight, r, dtype)
        frozen = ("lora_B",)
    elif init == "loftq":
        weight, lora_A, lora_B = loftq(weight, r, bits=loftq_bits, iters=loftq_iter, dtype=dtype)
    elif init in ("default", "gaussian", "random"):
        if init == "gaussian":
            lora_A = jax.random.normal(a_key, a_shape, dtype) / r
        else:
            lora_A = jax.random.uniform(a_key, a_shape, dtype, -a_bound, a_bound)
        if init == "random":
            b_bound = 1.0 / math.sqrt(r)
            lora_B = jax.random.uniform(b_key, b_shape, dtype, -b_bound, b_bound)
        else:
            lora_B = jnp.zeros(b_shape, dtype)
    else:
        raise ValueError(
            f"unknown LoRA init {init!r}; expected one of 'default', 'gaussian', 'pissa', "
            "'pissa_niter_K' (K an int), 'olora', 'orthogonal', 'mica', 'loftq', 'random'."
        )
    return LoraArray(
        weight,
        lora_A,
        lora_B,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        lora_dropout=lora_dropout,
        frozen=frozen,
    )


def pissa_niter(init: Any) -> int | None:
    """K of PEFT's `init_lora_weights="pissa_niter_K"`, else None."""
    found = re.fullmatch(r"pissa_niter_(\d+)", init) if isinstance(init, str) else None
    return None if found is None else int(found.group(1))


def _pissa(
    weight: Any, r: int, scaling: float, dtype: Any, niter: int | None, key: PRNGKeyArray
) -> tuple[Array, Array, Array]:
    """PEFT's `pissa_init`: the top-`r` singular triplets (exact, or by `svd_lowrank` with
    `niter` subspace iterations) split evenly between the factors; `W` less their product."""
    w = dense_2d(weight, r, "PiSSA")
    if niter is None:
        u, s, vh = jnp.linalg.svd(w, full_matrices=False)
        u, s, vh = u[:, :r], s[:r], vh[:r]
    else:
        u, s, vh = svd_lowrank(w, r, niter=niter, key=key)
    root = jnp.sqrt(s / scaling)
    lora_A = root[:, None] * vh
    lora_B = u * root[None, :]
    residual = w - scaling * lora_B @ lora_A
    return residual.astype(weight.dtype), lora_A.astype(dtype), lora_B.astype(dtype)


def svd_lowrank(
    a: Array, q: int, *, niter: int = 2, key: PRNGKeyArray
) -> tuple[Array, Array, Array]:
    """`(u (m, q), s (q,), vh (q, n))` with `u @ diag(s) @ vh ≈ a`: torch's `svd_lowrank`
    (Halko et al. 2009, algorithms 4.4 and 5.1: a Gaussian sketch of `q` columns and `niter`
    subspace iterations, on the transpose when `a` is wide), with the sketch drawn from
    `key`."""
    m, n = a.shape
    wide = m < n
    if wide:
        a = a.T
    sketch = jax.random.normal(key, (a.shape[1], q), a.dtype)
    basis = jnp.linalg.qr(a @ sketch)[0]
    for _ in range(niter):
        basis = jnp.linalg.qr(a.T @ basis)[0]
        basis = jnp.linalg.qr(a @ basis)[0]
    u, s, vh = jnp.linalg.svd(basis.T @ a, full_matrices=False)
    u = basis @ u
    if wide:
        u, vh = vh.T, u.T
    return u, s, vh


def _olora(weight: Any, r: int, scaling: float, dtype: Any) -> tuple[Array, Array, Array]:
    """PEFT's `olora_init`: `W = QR`, `lora_B = Q[:, :r]`, `lora_A = R[:r]`, and `W` less
    `scaling · B @ A`."""
    w = dense_2d(weight, r, "OLoRA")
    q, rr = jnp.linalg.qr(w)
    lora_B, lora_A = q[:, :r], rr[:r]
    residual = w - scaling * lora_B @ lora_A
    return residual.astype(weight.dtype), lora_A.astype(dtype), lora_B.astype(dtype)


def _orthogonal(weight: Any, r: int, dtype: Any, key: PRNGKeyArray) -> tuple[Array, Array]:
    """PEFT's `orthogonal_init`: `A = (G_A @ Q[0::2]).T / 10`, `B = G_B @ Q[1::2] / 10` with
    `Q` a random orthogonal `r × r` matrix and `G_A (in, r/2)`, `G_B (out, r/2)` standard
    normal, so that `B @ A = 0`; rounded to the base weight's dtype, as PEFT stores them."""
    if r % 2:
        raise ValueError(f"Orthogonal initialization requires the LoRA rank to be even, got {r}.")
    if len(weight.shape) != 2:
        raise TypeError(
            "orthogonal initialization is for Linear weights (as in PEFT); got a weight of "
            f"shape {tuple(weight.shape)}."
        )
    out, in_ = weight.shape
    q_key, a_key, b_key = jax.random.split(key, 3)
    q = jnp.linalg.qr(jax.random.normal(q_key, (r, r), jnp.float32))[0]
    lora_A = (jax.random.normal(a_key, (in_, r // 2), jnp.float32) @ q[0::2]).T / 10.0
    lora_B = jax.random.normal(b_key, (out, r // 2), jnp.float32) @ q[1::2] / 10.0
    base = weight.dtype if jnp.issubdtype(weight.dtype, jnp.floating) else jnp.float32
    return lora_A.astype(base).astype(dtype), lora_B.astype(base).astype(dtype)


def with_compute_dtype(tree: Any, dtype: Any) -> Any:
    """Run the branch of every LoRA/DoRA adapter in `tree` in `dtype` (None: in the
    factors' own dtype, the default).

    The common mixed-precision recipe: a bfloat16 base, float32 factors (and so float32
    gradients and optimizer state), and `with_compute_dtype(model, jnp.bfloat16)` for
    bfloat16 matrix products in the adapter branch; the gradients are still float32.
    """
    dtype = _checked_compute_dtype(dtype)
    return jax.tree.map(
        lambda x: _with_static(x, compute_dtype=dtype) if _is_low_rank(x) else x,
        tree,
        is_leaf=_is_low_rank,
    )


def _with_static(module: eqx.Module, **changes: Any) -> Any:
    """A copy of `module` with static fields changed (`eqx.tree_at` reaches only leaves)."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(module, field.name)))
    return new


def _is_low_rank(x: Any) -> bool:
    return isinstance(x, AbstractLowRank)
