"""AdaLoRA: an SVD-shaped update `ΔW = B·(A ⊙ E)` whose rank is pruned while training by
zeroing singular values, with PEFT's names and shapes."""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._kind import AbstractAdapter
from ._layout import WeightProduct, weight_dot_handlers
from ._products import LayerKeys, add_update, cast_base_on_astype, dropout, low_rank, rescale

# PEFT divides by `ranknum + 1e-5`
_RANKNUM_EPS = 1e-5


class AdaLoraArray(AbstractAdapter):
    """`weight + scaling/(ranknum + 1e-5) · B·(A ⊙ E)` for a `Linear` weight `(out, in)`,
    never formed when multiplied, with HF PEFT's shapes: `lora_A` `(r, in)` (right
    singular vectors), `lora_E` `(r, 1)` (singular values) and `lora_B` `(out, r)` (left
    singular vectors).

    A triplet the rank allocator prunes has its singular value set to zero, as PEFT
    masks it: `lora_A` and `lora_B` keep their size, so layers of one stack keep one
    shape. `ranknum` `(1,)`, frozen, is the rank the layer was created with (`init_r`),
    which PEFT keeps when it resizes a loaded layer, so the scale never changes with the
    pruning.

    A product computes `B·(E ⊙ A·x)` on the factors, in their dtype, and adds it to the
    base product in the wider dtype, rounded to the base's. Dropout (`lora_dropout`)
    applies to the input of `A` when `dropout_key` is set (see `with_dropout`).
    """

    weight: Any
    lora_A: Array
    lora_E: Array
    lora_B: Array
    ranknum: Array
    dropout_key: LayerKeys | None = None
    lora_alpha: float = eqx.field(static=True, default=1.0)
    lora_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "lora_A": "lora_A",
        "lora_B": "lora_B",
        "lora_E": "lora_E",
    }
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lora_A": (None, 1),
        "lora_E": (None,),
        "lora_B": (0, None),
        "ranknum": (None,),
    }
    rank_axes: ClassVar[Mapping[str, int]] = {"lora_A": 0, "lora_E": 0, "lora_B": 1}

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"AdaLoRA needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        r = self.lora_A.shape[-2] if self.lora_A.ndim >= 2 else -1
        want = {
            "lora_A": (*stack, r, in_),
            "lora_E": (*stack, r, 1),
            "lora_B": (*stack, out, r),
        }
        got = {name: tuple(getattr(self, name).shape) for name in want}
        if got != want:
            raise ValueError(
                f"AdaLoRA factors do not fit weight {shape}: expected lora_A (r, {in_}), "
                f"lora_E (r, 1) and lora_B ({out}, r) with one r, got {got}."
            )
        dtypes = {jnp.dtype(getattr(self, name).dtype) for name in want}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "AdaLoRA factors must share one floating-point dtype, got "
                f"{ {name: str(getattr(self, name).dtype) for name in want} }."
            )
        if tuple(self.ranknum.shape) != (*stack, 1):
            raise ValueError(
                f"ranknum must have shape {(*stack, 1)} for weight {shape}, got "
                f"{tuple(self.ranknum.shape)}."
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def r(self) -> int:
        return self.lora_A.shape[-2]

    @property
    def scaling(self) -> Array:
        """PEFT's factor on `B·(A ⊙ E)`, `(*stack,)` float32: `lora_alpha` (or the rank,
        for `lora_alpha <= 0`) over `ranknum + 1e-5`."""
        alpha = self.lora_alpha if self.lora_alpha > 0 else float(self.r)
        return alpha / (self.ranknum[..., 0].astype(jnp.float32) + _RANKNUM_EPS)

    def num_parameters(self) -> int:
        """PEFT's count: the factors and the base weight, and `ranknum`, which PEFT keeps
        as a one-element frozen parameter per layer."""
        frozen = 0 if self.ranknum is None else self.ranknum.size
        return super().num_parameters() + frozen

    def delta(self) -> Array:
        """`scaling · B·(A ⊙ E)`, in the adapter's dtype."""
        product = jnp.matmul(self.lora_B, self.lora_A * self.lora_E)
        return product * self.scaling.astype(product.dtype)[..., None, None]

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""
        return merged - self.delta().astype(merged.dtype)


def _adalora_terms(w: AdaLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    """`(labels, update)`: the product's labels and `scaling · B·(E ⊙ A·x_dropped)` in
    its output order; None when neither axis of the weight meets `x`."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    dtype = w.lora_A.dtype
    a_labels, b_labels = (*stack, "r", in_l), (*stack, out_l, "r")
    x_d = dropout(x, w.lora_dropout, w.dropout_key, p.x, stack).astype(dtype)
    e = w.lora_E[..., 0]
    if in_l in p.x:
        delta = low_rank(p, a_labels, b_labels, (*stack, "r"))(x_d, w.lora_A, w.lora_B, e)
    elif out_l in p.x:  # xᵀ·ΔW: B meets x first
        delta = low_rank(p, b_labels, a_labels, (*stack, "r"))(x_d, w.lora_B, w.lora_A, e)
    else:
        return None
    return p, rescale(delta, p.along(w.scaling, stack, p.out))


def _adalora_dot(w: AdaLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    terms = _adalora_terms(w, x, w_is_lhs, params)
    if terms is None:
        return NotImplemented
    p, delta = terms
    return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), delta)


def _adalora_update(
    w: AdaLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    terms = _adalora_terms(w, x, w_is_lhs, params)
    return NotImplemented if terms is None else terms[1]


weight_dot_handlers(AdaLoraArray, _adalora_dot, _adalora_update)
cast_base_on_astype(AdaLoraArray)


def adalora(
    weight: Any,
    *,
    init_r: int = 12,
    lora_alpha: float | int = 8,
    lora_dropout: float = 0.0,
    init_lora_weights: bool = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> AdaLoraArray:
    """Wrap a `Linear` weight `(out, in)` in an `AdaLoraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `init_r`: the rank before any pruning (also `ranknum`).
    - `lora_alpha`, `lora_dropout`: as in `peft.AdaLoraConfig`.
    - `init_lora_weights`: `True`: `lora_E` zeros (the output is the base's), `lora_A`
      and `lora_B` normal with standard deviation 0.02; `False`: all three standard
      normal (for tests of a non-identity adapter).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    if init_r < 1:
        raise ValueError(f"AdaLoRA's init_r={init_r} must be at least 1.")
    out, in_ = weight.shape[-2:]
    a_key, e_key, b_key = jax.random.split(key, 3)
    std = 0.02 if init_lora_weights else 1.0
    lora_A = std * jax.random.normal(a_key, (init_r, in_), dtype)
    lora_B = std * jax.random.normal(b_key, (out, init_r), dtype)
    if init_lora_weights:
        lora_E = jnp.zeros((init_r, 1), dtype)
    else:
        lora_E = jax.random.normal(e_key, (init_r, 1), dtype)
    return AdaLoraArray(
        weight,
        lora_A,
        lora_E,
        lora_B,
        jnp.full((1,), init_r, jnp.float32),
        lora_alpha=float(lora_alpha),
        lora_dropout=float(lora_dropout),
    )


def orthogonality_penalty(adapters: Any) -> Float[Array, ""]:
    """PEFT's orthogonal regularizer of AdaLoRA (added to the loss times
    `orth_reg_weight`): the mean over every `lora_A` and `lora_B` in `adapters` (any
    pytree: a model, a `PeftModel`) of `‖A·Aᵀ - I‖_F` and `‖Bᵀ·B - I‖_F`, each layer of a
    stack counted once. Zero when there are none."""

    def is_adalora(x: Any) -> bool:
        return isinstance(x, AdaLoraArray)

    found = [x for x in jax.tree.leaves(adapters, is_leaf=is_adalora) if is_adalora(x)]
    terms = []
    for w in found:
        a = w.lora_A.astype(jnp.float32)
        b = w.lora_B.astype(jnp.float32)
        gram_a = jnp.matmul(a, jnp.swapaxes(a, -1, -2))
        gram_b = jnp.matmul(jnp.swapaxes(b, -1, -2), b)
        eye = jnp.broadcast_to(jnp.eye(w.r, dtype=jnp.float32), gram_a.shape)
        for gram in (gram_a, gram_b):
            norms = jnp.sqrt(jnp.sum(jnp.square(gram - eye), axis=(-2, -1)))
            terms.append(norms.reshape(-1))
    if not terms:
        return jnp.zeros((), jnp.float32)
    every = jnp.concatenate(terms)
    return jnp.sum(every) / every.size
