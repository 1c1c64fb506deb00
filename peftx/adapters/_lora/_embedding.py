"""LoRA for embedding tables, with HF PEFT's names, shapes and inits (`lora.Embedding`)."""

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ..._kind import AbstractAdapter
from ...implicit import primitive_handler
from .._layout import weight_dot_handlers
from .._products import cast_base_on_astype, check_rank
from ._lora import LoraArray, LoraInit, lora_dot, lora_update, weighted_factors
from ._mica import mica


class LoraEmbeddingArray(AbstractAdapter):
    """`weight + scaling · (lora_embedding_B @ lora_embedding_A)ᵀ` for an embedding table,
    never formed when looked up or multiplied.

    `weight` is an `eqx.nn.Embedding` table `(num_embeddings, embedding_dim)`, dense or
    implicit. As in HF PEFT, `lora_embedding_A` is `(r, num_embeddings)` (a low-rank
    embedding of the token ids) and `lora_embedding_B` is `(embedding_dim, r)`; `scaling`
    is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.

    Lookups (`table[ids]`, `jax.vmap(embedding)(ids)`, `embedding(token)`) gather rows of
    `lora_embedding_A` only; products (a tied output head, `x @ table.T`) run as the
    equivalent `LoraArray`, see `as_lora`. There is no dropout: PEFT builds a dropout
    layer for embeddings but never applies it.
    """

    weight: Any
    lora_embedding_A: Array
    lora_embedding_B: Array
    lora_alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)
    frozen: frozenset[str] = eqx.field(static=True)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "lora_embedding_A": "lora_embedding_A",
        "lora_embedding_B": "lora_embedding_B",
    }
    # A is (r, num_embeddings), B is (embedding_dim, r): the table is (num, dim)
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lora_embedding_A": (None, 0),
        "lora_embedding_B": (1, None),
    }

    def __init__(
        self,
        weight: Any,
        lora_embedding_A: Array,
        lora_embedding_B: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool = False,
        frozen: Collection[str] = (),
    ):
        if not set(frozen) <= set(self.peft_keys):
            raise ValueError(
                f"frozen names factors of an embedding LoRA ({sorted(self.peft_keys)}); got "
                f"{sorted(frozen)}."
            )
        self.frozen = frozenset(frozen)
        self.weight = weight
        self.lora_embedding_A = lora_embedding_A
        self.lora_embedding_B = lora_embedding_B
        self.lora_alpha = float(lora_alpha)
        self.use_rslora = bool(use_rslora)

    def __check_init__(self):
        shape = tuple(self.weight.shape)
        if len(shape) != 2:
            raise ValueError(
                "LoRA for embeddings needs a table of shape (num_embeddings, embedding_dim), "
                f"got shape {shape}."
            )
        if not jnp.issubdtype(self.weight.dtype, jnp.floating):
            raise TypeError(
                f"the embedding table must be floating-point, got dtype {self.weight.dtype}."
            )
        a, b = self.lora_embedding_A, self.lora_embedding_B
        num, dim = shape
        r = a.shape[0] if a.ndim else 0
        want_a, want_b = (r, num), (dim, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"LoRA factors do not fit embedding table {shape}: expected lora_embedding_A "
                f"{want_a} and lora_embedding_B {want_b} for rank r={r}, got lora_embedding_A "
                f"{tuple(a.shape)} and lora_embedding_B {tuple(b.shape)}."
            )
        check_rank(r, shape, "an embedding table")
        for name, factor in (("lora_embedding_A", a), ("lora_embedding_B", b)):
            if not jnp.issubdtype(factor.dtype, jnp.floating):
                raise TypeError(f"{name} must be a floating-point array, got dtype {factor.dtype}.")
        if a.dtype != b.dtype:
            raise TypeError(
                "lora_embedding_A and lora_embedding_B must share a dtype, got "
                f"{a.dtype} and {b.dtype}."
            )

    @property
    def r(self) -> int:
        return self.lora_embedding_A.shape[0]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def delta(self) -> Array:
        """`scaling · (lora_embedding_B @ lora_embedding_A)ᵀ`, table-shaped, in the adapters'
        dtype."""
        return self.scaling * (self.lora_embedding_B @ self.lora_embedding_A).T

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    @classmethod
    def weighted(
        cls, present: Sequence[tuple[AbstractAdapter, float]], combination_type: str, config: Any
    ) -> "LoraEmbeddingArray":
        """LoRA's combinations (`weighted_factors`), in PEFT's roles for embeddings."""
        factors = [(a.lora_embedding_A, a.lora_embedding_B, a.scaling, w) for a, w in present]
        lora_A, lora_B = weighted_factors(factors, combination_type, config.r)
        return LoraEmbeddingArray(
            present[0][0].weight, lora_A, lora_B, lora_alpha=config.r, use_rslora=config.use_rslora
        )

    def frozen_keys(self) -> frozenset[str]:
        return self.frozen

    def as_lora(self) -> LoraArray:
        """The same table as a `LoraArray` on the `(num_embeddings, embedding_dim)` weight:
        `lora_A = lora_embedding_Bᵀ`, `lora_B = lora_embedding_Aᵀ` (as PEFT ties an output
        head to an adapted input embedding)."""
        return LoraArray(
            self.weight,
            self.lora_embedding_B.T,
            self.lora_embedding_A.T,
            lora_alpha=self.lora_alpha,
            use_rslora=self.use_rslora,
        )


# --------------------------------------------------------------------------------------
# Lookups and products


def _low_rank_rows(w: LoraEmbeddingArray, rows: Array, axis: int, dtype: Any) -> Array:
    """`scaling · rows @ lora_embedding_Bᵀ` along `axis` of `rows` (rows of
    `lora_embedding_Aᵀ`, `r` wide there), in `dtype`."""
    out = lax.dot_general(rows, w.lora_embedding_B, (((axis,), (1,)), ((), ())))
    return (w.scaling * jnp.moveaxis(out, -1, axis)).astype(dtype)


@primitive_handler("gather")
def _embedding_gather(
    primitive: Any, w: LoraEmbeddingArray, indices: jax.Array, **params: Any
) -> Any:
    dn = params["dimension_numbers"]
    if params["slice_sizes"][1] != w.shape[1]:
        return NotImplemented  # a slice of the embedding axis: not a row lookup
    if 1 in dn.collapsed_slice_dims or 1 in dn.operand_batching_dims:
        return NotImplemented
    offset_axes = [a for a in (0, 1) if a not in dn.collapsed_slice_dims]
    offset_axes = [a for a in offset_axes if a not in dn.operand_batching_dims]
    axis = int(dn.offset_dims[offset_axes.index(1)])  # vmap gives NumPy integers here
    base = primitive.bind(w.weight, indices, **params)
    # The same gather on `lora_embedding_Aᵀ` (num_embeddings, r): whole rows, so any start
    # index on axis 1 is clamped (or masked, for FILL_OR_DROP) exactly as on the table.
    # Out-of-bounds rows are filled in `base` already; the adapter adds zero there.
    rows = primitive.bind(
        w.lora_embedding_A.T,
        indices,
        **{**params, "slice_sizes": (params["slice_sizes"][0], w.r), "fill_value": 0},
    )
    return base + _low_rank_rows(w, rows, axis, base.dtype)


@primitive_handler("dynamic_slice")
def _embedding_dynamic_slice(
    primitive: Any, w: LoraEmbeddingArray, *starts: jax.Array, slice_sizes: tuple[int, ...]
) -> Any:
    if len(starts) != 2 or slice_sizes[1] != w.shape[1]:
        return NotImplemented
    base = primitive.bind(w.weight, *starts, slice_sizes=slice_sizes)
    # Whole rows, so the start on axis 1 is clamped to 0 here as on the table.
    rows = primitive.bind(w.lora_embedding_A.T, *starts, slice_sizes=(slice_sizes[0], w.r))
    return base + _low_rank_rows(w, rows, 1, base.dtype)


def _embedding_dot(w: LoraEmbeddingArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    return lora_dot(w.as_lora(), x, w_is_lhs, params)


def _embedding_update(
    w: LoraEmbeddingArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    return lora_update(w.as_lora(), x, w_is_lhs, params, base)


weight_dot_handlers(LoraEmbeddingArray, _embedding_dot, _embedding_update)


cast_base_on_astype(LoraEmbeddingArray)


# --------------------------------------------------------------------------------------
# Construction


def lora_embedding(
    weight: Any,
    *,
    r: int = 8,
    lora_alpha: float | int = 8.0,
    init: LoraInit = "default",
    use_rslora: bool = False,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LoraEmbeddingArray:
    """Wrap an embedding table in a `LoraEmbeddingArray` with fresh factors, initialized
    as HF PEFT does for `nn.Embedding`.

    **Arguments:**

    - `weight`: an `eqx.nn.Embedding` table `(num_embeddings, embedding_dim)`, dense or
      implicit.
    - `r`, `lora_alpha`, `use_rslora`: as in `peft.LoraConfig`.
    - `init`: PEFT's `init_lora_weights`. `"default"` (`True`) and `"gaussian"` (which PEFT
      treats the same way for embeddings): `lora_embedding_A` zeros and `lora_embedding_B`
      standard normal, so the output equals the base table's. `"random"` (`False`): both
      standard normal, for tests. `"mica"`: `lora_embedding_B` the left singular vectors
      of the `r` smallest singular values of the table's transpose, frozen, and
      `lora_embedding_A` zeros (PEFT's MiCA for embeddings). `"pissa"` is refused: PEFT
      silently falls back to the default init for embeddings.
    - `dtype`: the factors' dtype (PEFT keeps adapters in float32).
    - `key`: a JAX PRNG key.

    **Returns:**

    A `LoraEmbeddingArray`.
    """
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise ValueError(
            "LoRA for embeddings needs a table of shape (num_embeddings, embedding_dim), "
            f"got shape {shape}."
        )
    check_rank(r, shape, "an embedding table")
    num, dim = shape
    a_key, b_key = jax.random.split(key)
    if init == "mica":
        lora_embedding_A, lora_embedding_B = mica(weight, r, dtype, table=True)
        return LoraEmbeddingArray(
            weight,
            lora_embedding_A,
            lora_embedding_B,
            lora_alpha=lora_alpha,
            use_rslora=use_rslora,
            frozen=("lora_embedding_B",),
        )
    if init in ("default", "gaussian"):
        lora_embedding_A = jnp.zeros((r, num), dtype)
    elif init == "random":
        lora_embedding_A = jax.random.normal(a_key, (r, num), dtype)
    else:
        raise ValueError(
            f"LoRA init {init!r} is not supported for embedding tables (HF PEFT silently "
            "uses its default init there); expected one of 'default', 'gaussian', 'random', "
            "'mica'."
        )
    lora_embedding_B = jax.random.normal(b_key, (dim, r), dtype)
    return LoraEmbeddingArray(
        weight, lora_embedding_A, lora_embedding_B, lora_alpha=lora_alpha, use_rslora=use_rslora
    )
