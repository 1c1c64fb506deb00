"""LoRA on a stack of experts `W (experts, out, in)` (PEFT's `target_parameters`), one
low-rank update per expert, multiplied only as the experts are: grouped by expert."""

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ..._kind import AbstractAdapter
from ...implicit import primitive_handler
from .._layout import WeightProduct, weight_dot_handlers
from .._products import add_update, cast_base_on_astype, check_rank, low_rank, take_rows, taken_rows

ExpertLoraInit = Literal["default", "gaussian", "random"]

# `lax.ragged_dot_general`'s grouped product with the expert stack on the right: rows of
# `x` ragged by expert, `x`'s features against the experts' input axis
GROUPED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


class ExpertLoraArray(AbstractAdapter):
    """`W[e] + scaling · B_e @ A_e` for every expert `e` of a stack `W (experts, out, in)`,
    never formed when multiplied.

    The factors are stored in PEFT's layouts (`ParamWrapper`): `lora_A` `(r·experts, in)`,
    expert-major (`A_e = lora_A.reshape(experts, r, in)[e]`), and `lora_B`
    `(out, r·experts)`, expert-minor (`B_e = lora_B.reshape(out, r, experts)[:, :, e]`).
    `scaling` is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.

    `weight` may itself be implicit (an `NF4Array` for QLoRA). A grouped product
    (`lax.ragged_dot_general`), whole experts taken along axis 0 (`jnp.take`) and the
    batched product that follows run on the factors. The adapter branch computes in the
    factors' dtype and is added to the base product in the wider dtype, rounded to the
    base's (as `LoraArray`). Leading axes before the experts are stacked layers.
    """

    weight: Any
    lora_A: Array
    lora_B: Array
    lora_alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)

    peft_keys: ClassVar[Mapping[str, str]] = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}
    # lora_A's second axis runs along the weight's input axis, lora_B's first along its
    # output axis; the (rank, expert) axes are their own
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lora_A": (None, 2),
        "lora_B": (1, None),
    }

    def __init__(
        self,
        weight: Any,
        lora_A: Array,
        lora_B: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool,
    ):
        self.weight = weight
        self.lora_A = lora_A
        self.lora_B = lora_B
        self.lora_alpha = float(lora_alpha)
        self.use_rslora = bool(use_rslora)

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 3:
            raise ValueError(
                f"LoRA on experts needs a stack of expert weights (experts, out, in), got a "
                f"weight of shape {shape}."
            )
        stack, (experts, out, in_) = shape[:-3], shape[-3:]
        a, b = tuple(self.lora_A.shape), tuple(self.lora_B.shape)
        rank_experts = a[-2] if len(a) >= 2 else 0
        if (
            rank_experts % experts
            or a != (*stack, rank_experts, in_)
            or b != (*stack, out, rank_experts)
        ):
            raise ValueError(
                f"LoRA factors do not fit the expert stack {shape}: expected lora_A "
                f"{(*stack, 'r*experts', in_)} and lora_B {(*stack, out, 'r*experts')} with "
                f"r*experts a multiple of {experts}, got lora_A {a} and lora_B {b}."
            )
        for name, factor in (("lora_A", self.lora_A), ("lora_B", self.lora_B)):
            if not jnp.issubdtype(factor.dtype, jnp.floating):
                raise TypeError(f"{name} must be a floating-point array, got dtype {factor.dtype}.")
        if self.lora_A.dtype != self.lora_B.dtype:
            raise TypeError(
                f"lora_A and lora_B must share a dtype, got {self.lora_A.dtype} and "
                f"{self.lora_B.dtype}."
            )

    @property
    def experts(self) -> int:
        return self.weight.shape[-3]

    @property
    def r(self) -> int:
        return self.lora_A.shape[-2] // self.experts

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 3

    def factors(self) -> tuple[Array, Array]:
        """`(A, B)` per expert: `A` `(..., experts, r, in)`, `B` `(..., experts, out, r)`."""
        *stack, _, in_ = self.lora_A.shape
        out = self.lora_B.shape[-2]
        a = self.lora_A.reshape(*stack, self.experts, self.r, in_)
        b = jnp.moveaxis(self.lora_B.reshape(*stack, out, self.r, self.experts), -1, -3)
        return a, b

    def grouped_update(
        self, primitive: Any, x: Array, group_sizes: Array, params: Mapping[str, Any]
    ) -> Any:
        """`scaling · B_e A_e x` for each row `x` of expert `e`'s group, in the factors'
        dtype: two grouped products through rank `r`."""
        if self.stack_ndim or params["ragged_dot_dimension_numbers"] != GROUPED:
            return NotImplemented
        a, b = self.factors()
        dtype = a.dtype
        branch = {**params, "preferred_element_type": None}
        t = primitive.bind(x.astype(dtype), a, group_sizes, **branch)
        return primitive.bind(jnp.asarray(self.scaling, dtype) * t, b, group_sizes, **branch)

    def merged(self, weight: Array) -> Array:
        a, b = self.factors()
        delta = self.scaling * jnp.matmul(b, a)
        return weight + delta.astype(weight.dtype)


def expert_lora(
    weight: Any,
    *,
    r: int = 8,
    lora_alpha: float | int = 8.0,
    init: ExpertLoraInit = "default",
    use_rslora: bool = False,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> ExpertLoraArray:
    """Wrap an expert stack `weight (experts, out, in)` in an `ExpertLoraArray` with fresh
    factors, initialized as PEFT's `ParamWrapper` does.

    **Arguments:**

    - `weight`: the experts' weights, dense or implicit (e.g. `NF4Array`).
    - `r`, `lora_alpha`, `use_rslora`: as in `peft.LoraConfig`; each expert gets rank `r`.
    - `init`: `"default"` (`lora_A` Kaiming-uniform, `lora_B` zeros: the output is the
      base's), `"gaussian"` (`lora_A` normal with std `1/r`, `lora_B` zeros), `"random"`
      (both uniform as PyTorch initializes a `Linear`, for tests).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    shape = tuple(weight.shape)
    if len(shape) != 3:
        raise ValueError(
            f"expert_lora wraps one stack of experts (experts, out, in), got shape {shape}."
        )
    check_rank(r, shape, "an expert stack")
    experts, out, in_ = shape
    a_shape, b_shape = (r * experts, in_), (out, r * experts)
    a_key, b_key = jax.random.split(key)
    if init == "gaussian":
        lora_A = jax.random.normal(a_key, a_shape, dtype) / r
    elif init in ("default", "random"):
        bound = 1.0 / math.sqrt(in_)
        lora_A = jax.random.uniform(a_key, a_shape, dtype, -bound, bound)
    else:
        raise ValueError(
            f"unknown LoRA init {init!r} for experts; expected 'default', 'gaussian' or 'random'."
        )
    if init == "random":
        bound = 1.0 / math.sqrt(r * experts)
        lora_B = jax.random.uniform(b_key, b_shape, dtype, -bound, bound)
    else:
        lora_B = jnp.zeros(b_shape, dtype)
    return ExpertLoraArray(weight, lora_A, lora_B, lora_alpha=lora_alpha, use_rslora=use_rslora)


# --------------------------------------------------------------------------------------
# Products


@primitive_handler("ragged_dot_general")
def _grouped(
    primitive: Any,
    x: jax.Array,
    w: ExpertLoraArray,
    group_sizes: jax.Array,
    *,
    ragged_dot_dimension_numbers: Any,
    **params: Any,
) -> Any:
    if w.stack_ndim or ragged_dot_dimension_numbers != GROUPED:
        return NotImplemented
    dims = {"ragged_dot_dimension_numbers": GROUPED, **params}
    base = primitive.bind(x, w.weight, group_sizes, **dims)
    return add_update(base, w.grouped_update(primitive, x, group_sizes, dims))


@primitive_handler("gather")
def _take_experts(primitive: Any, w: ExpertLoraArray, indices: jax.Array, **params: Any) -> Any:
    """Whole experts taken along axis 0 (`jnp.take(w, idx, axis=0)`): the same adapter
    over the taken experts, its factors' expert slices taken alike."""
    if w.stack_ndim or not taken_rows(w.shape, indices, params):
        return NotImplemented

    a, b = w.factors()
    a = take_rows(primitive, a, indices, params)  # (taken, r, in)
    b = take_rows(primitive, b, indices, params)  # (taken, out, r)
    taken, r, in_ = a.shape
    lora_A = a.reshape(taken * r, in_)
    lora_B = jnp.moveaxis(b, 0, -1).reshape(b.shape[1], r * taken)
    return ExpertLoraArray(
        take_rows(primitive, w.weight, indices, params),
        lora_A,
        lora_B,
        lora_alpha=w.lora_alpha,
        use_rslora=w.use_rslora,
    )


def _expert_terms(
    w: ExpertLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]
) -> tuple[WeightProduct, Any] | None:
    """The product's labels and its adapter branch, for a product batched over the
    experts (each expert's weight with its own rows of `x`); None for any other."""
    if w.stack_ndim:
        return None
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    expert_l, out_l, in_l = p.w
    if expert_l not in p.x or expert_l not in p.out:
        return None
    a, b = w.factors()
    a_labels, b_labels = (expert_l, "r", in_l), (expert_l, out_l, "r")
    if in_l in p.x:
        first, second, labels = a, b, (a_labels, b_labels)
    elif out_l in p.x:
        first, second, labels = b, a, (b_labels, a_labels)
    else:
        return None
    dtype = a.dtype
    delta = low_rank(p, *labels, ())(x.astype(dtype), first, second, jnp.asarray(w.scaling, dtype))
    return p, delta


def _expert_dot(w: ExpertLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    terms = _expert_terms(w, x, w_is_lhs, params)
    if terms is None:
        return NotImplemented
    p, delta = terms
    return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), delta)


def _expert_update(
    w: ExpertLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    terms = _expert_terms(w, x, w_is_lhs, params)
    return NotImplemented if terms is None else terms[1]


weight_dot_handlers(ExpertLoraArray, _expert_dot, _expert_update)
cast_base_on_astype(ExpertLoraArray)
