"""OFT: a block-diagonal orthogonal rotation of a weight's input features (HF PEFT's `OFT`),
applied to the activations block by block, never to a rebuilt weight.

The kind whole: `OFTArray`, its handlers, and `OFTConfig`."""

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._config import (
    FLOAT32_MAX,
    MAX_RANK,
    PEFT_BASE_KEYS,
    PROBABILITY,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ._layout import Labels, WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES
from ._products import cast_base_on_astype


class OFTArray(AbstractAdapter):
    """`W @ BD(R)ᵀ` for a `Linear` weight `W (out, in)`, never formed when multiplied.

    The input features are split into blocks of `block_size`; block `d` is rotated by
    `R_d`, the Cayley transform of the skew-symmetric matrix whose upper triangle (row by
    row) is `oft_R[d]` (PEFT's `oft_R.weight`, `(blocks, block_size·(block_size-1)/2)`;
    one row shared by every block with `block_share`). A product `W·x` is computed as
    `W·(x rotated block by block)`, in `oft_R`'s dtype for the rotation (as PEFT casts the
    input), then rounded to `x`'s dtype for the base product.

    - `use_cayley_neumann`: `R = I + 2Q + 2Q² + … + 2Q^(m-1) + Q^m` with
      `m = max(num_cayley_neumann_terms - 2, 2) + 1` (PEFT's truncated series; `I + 2Q` for
      2 terms, `I` for fewer), else the exact `(I - Q)(I + Q)⁻¹`.
    - `coft`: each block's `Q` is first projected into the Frobenius ball of radius
      `eps / sqrt(blocks)` around zero; PEFT does it in place without a gradient, so the
      gradient passes straight through the projection here.
    """

    weight: Any
    oft_R: Array
    coft: bool = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    block_share: bool = eqx.field(static=True)
    use_cayley_neumann: bool = eqx.field(static=True)
    num_cayley_neumann_terms: int = eqx.field(static=True)

    peft_keys: ClassVar[Mapping[str, str]] = {"oft_R": "oft_R.weight"}
    # blocks and triangle entries are the adapter's own axes
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {"oft_R": ()}

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"OFT needs a weight of 2 or more dimensions, got shape {shape}.")
        in_ = shape[-1]
        stack = shape[:-2]
        r = tuple(self.oft_R.shape)
        if len(r) != len(stack) + 2 or r[:-2] != stack:
            raise ValueError(
                f"oft_R must have shape {(*stack, 'blocks', 'block_size*(block_size-1)/2')} for "
                f"a weight of shape {shape}, got {r}."
            )
        b = self.block_size
        blocks = 1 if self.block_share else r[-2]
        if b * (b - 1) // 2 != r[-1] or in_ % b or (not self.block_share and blocks * b != in_):
            raise ValueError(
                f"oft_R of shape {r} does not fit a weight with {in_} input features: its last "
                "axis must be block_size*(block_size-1)/2 for a block_size dividing the input "
                "features, and its blocks (1 with block_share) times block_size must be "
                f"{in_}."
            )
        if self.block_share and r[-2] != 1:
            raise ValueError(f"with block_share, oft_R holds one row, got shape {r}.")
        if not jnp.issubdtype(self.oft_R.dtype, jnp.floating):
            raise TypeError(f"oft_R must be floating-point, got dtype {self.oft_R.dtype}.")

    @property
    def block_size(self) -> int:
        """`b` with `b·(b-1)/2 == oft_R.shape[-1]`."""
        return (1 + math.isqrt(1 + 8 * self.oft_R.shape[-1])) // 2

    @property
    def blocks(self) -> int:
        """How many blocks the input features are split into (PEFT's per-layer `r`)."""
        return self.weight.shape[-1] // self.block_size

    def rotations(self) -> Float[Array, "*stack blocks b b"]:
        """Each block's rotation `R_d` (one, shared, with `block_share`)."""
        b = self.block_size
        vec = self.oft_R
        if self.coft:
            vec = vec + jax.lax.stop_gradient(_projected(vec, b, self.eps) - vec)
        q = _skew(vec, b)
        eye = jnp.broadcast_to(jnp.eye(b, dtype=q.dtype), q.shape)
        if not self.use_cayley_neumann:
            # R (I + Q) = I - Q
            return jnp.swapaxes(jnp.linalg.solve(jnp.swapaxes(eye + q, -1, -2), eye - q.mT), -1, -2)
        terms = self.num_cayley_neumann_terms
        if terms <= 1:
            return eye
        rotation, power = eye + 2 * q, q
        if terms == 2:
            return rotation
        last = max(terms - 2, 2)
        for _ in range(2, last + 1):
            power = power @ q
            rotation = rotation + 2 * power
        return rotation + power @ q

    def merged(self, weight: Array) -> Array:
        rot = self.rotations()
        out = weight.shape[-2]
        blocks = weight.astype(rot.dtype).reshape(*weight.shape[:-1], -1, self.block_size)
        shared = "" if self.block_share else "d"
        rows = jnp.einsum(f"...odc,...{shared or 'z'}kc->...odk", blocks, rot)
        return rows.reshape(*weight.shape[:-2], out, -1).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight `W` recovered from `merged = W @ BD(R)ᵀ` (PEFT's `unmerge`)."""
        rot = self.rotations()
        rot = jnp.broadcast_to(rot, (*rot.shape[:-3], self.blocks, *rot.shape[-2:]))
        blocks = merged.astype(rot.dtype).reshape(*merged.shape[:-1], -1, self.block_size)
        # W_d R_dᵀ = M_d, so R_d W_dᵀ = M_dᵀ, one block at a time
        m_t = jnp.moveaxis(blocks, -3, -1)  # (..., blocks, b, out)
        w_t = jnp.linalg.solve(rot, m_t)
        return jnp.moveaxis(w_t, -1, -3).reshape(merged.shape).astype(merged.dtype)


def _skew(vec: Array, b: int) -> Array:
    """The skew-symmetric `(b, b)` matrices with upper triangles `vec` (row by row)."""
    rows, cols = np.triu_indices(b, 1)
    upper = jnp.zeros((*vec.shape[:-1], b, b), vec.dtype).at[..., rows, cols].set(vec)
    return upper - upper.mT


def _projected(vec: Array, b: int, eps: float) -> Array:
    """COFT's projection of each block's skew matrix into the ball of radius
    `eps / sqrt(blocks)`, back as upper triangles."""
    q = _skew(vec, b)
    radius = eps / math.sqrt(vec.shape[-2])
    norm = jnp.linalg.norm(q, axis=(-2, -1), keepdims=True)
    inside = norm <= radius
    q = jnp.where(inside, q, radius * q / jnp.where(inside, 1, norm))
    rows, cols = np.triu_indices(b, 1)
    return q[..., rows, cols]


def oft(
    weight: Any,
    *,
    block_size: int,
    coft: bool = False,
    eps: float = 6e-5,
    block_share: bool = False,
    use_cayley_neumann: bool = True,
    num_cayley_neumann_terms: int = 5,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> OFTArray:
    """Wrap `weight` in an `OFTArray` with `oft_R` at zero (the identity rotation); with a
    `key`, drawn from `N(0, 0.1²)` instead (PEFT's `init_weights=False`).

    **Arguments:**

    - `weight`: a `Linear` weight `(out, in)`, dense or implicit; `block_size` must divide
      `in`.
    - `block_size`, `coft`, `eps`, `block_share`, `use_cayley_neumann`,
      `num_cayley_neumann_terms`: as in `peft.OFTConfig` (see `OFTArray`).
    - `dtype`: dtype of `oft_R`.
    - `key`: draws a random `oft_R`.
    """
    in_ = weight.shape[-1]
    if block_size < 1 or in_ % block_size:
        raise ValueError(
            f"OFT's block_size {block_size} must divide the weight's {in_} input features."
        )
    rows = 1 if block_share else in_ // block_size
    shape = (rows, block_size * (block_size - 1) // 2)
    oft_R = jnp.zeros(shape, dtype) if key is None else 0.1 * jax.random.normal(key, shape, dtype)
    return OFTArray(
        weight, oft_R, coft, float(eps), block_share, use_cayley_neumann, num_cayley_neumann_terms
    )


def _rotated(w: OFTArray, a: Array, labels: Labels, axis: str, p: WeightProduct, inverse: bool):
    """`a` (labelled `labels`) with the features along `axis` rotated block by block by
    `R_d` (by `R_dᵀ` with `inverse`), in `oft_R`'s dtype and back; the weight's stacking
    axes join `a`'s labels first where `a` lacks them."""
    rot = w.rotations()
    stack = p.w[: len(w.shape) - 2]
    letters = dict(zip(dict.fromkeys((*stack, *labels)), "abcdefghijlmnopqrstuvwxyz"))
    d, k, c = "D", "K", "C"
    a_in = "".join(letters[lab] for lab in labels)
    split = a_in.replace(letters[axis], d + k)
    rot_in = "".join(letters[s] for s in stack) + ("Z" if w.block_share else d)
    rot_in += (c + k) if inverse else (k + c)
    new = tuple(s for s in stack if s not in labels)
    out_labels = (*new, *labels)
    out = "".join(letters[s] for s in new) + a_in.replace(letters[axis], d + c)
    blocks = a.astype(rot.dtype).reshape(
        *a.shape[: labels.index(axis)], w.blocks, w.block_size, *a.shape[labels.index(axis) + 1 :]
    )
    y = jnp.einsum(f"{split},{rot_in}->{out}", blocks, rot)
    y = y.reshape(*y.shape[: out_labels.index(axis)], -1, *y.shape[out_labels.index(axis) + 2 :])
    return y.astype(a.dtype), out_labels


def _oft_dot(w: OFTArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    in_axis = p.w[-1]
    if in_axis in p.x:
        # (W BDᵀ)·x == W·(BDᵀ x): rotate the activations
        x_rot, labels = _rotated(w, x, p.x, in_axis, p, inverse=False)
        return p.arrange(*p.contract(x_rot, labels, w.weight, p.w))
    # the input axis is kept: rotate the product's output along it
    y, labels = p.contract(x, p.x, w.weight, p.w)
    y, labels = _rotated(w, y, labels, in_axis, p, inverse=True)
    return p.arrange(y, labels)


def _oft_update(w: OFTArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array) -> Any:
    raise ValueError(
        "OFT adapters apply one at a time: PEFT composes several active OFT rotations one "
        "after the other and has no mixed-adapter batches for OFT, so an AdapterSet cannot "
        "add an OFT adapter's update to others or weigh it per example. Activate a single "
        "adapter (set_adapter) and call without adapter_names."
    )


weight_dot_handlers(OFTArray, _oft_dot, _oft_update)
cast_base_on_astype(OFTArray)


# -- the config ------------------------------------------------------------------------------

_OFT_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "oft_block_size",
    "module_dropout",
    "target_modules",
    "fan_in_fan_out",
    "bias",
    "exclude_modules",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
    "coft",
    "eps",
    "block_share",
    "use_cayley_neumann",
    "num_cayley_neumann_terms",
)

# The PEFT version whose Cayley-Neumann series `OFTArray` computes, written to a saved
# OFT config that names none (PEFT refuses such a file).
_OFT_SERIES_VERSION = "0.21.2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OFTConfig(AbstractAdapterConfig):
    """HF PEFT's `OFTConfig` (orthogonal fine-tuning): the same field names, meanings and
    defaults. Each adapted `Linear` gets an `OFTArray`: its input features split into
    blocks, each rotated by the Cayley transform of a learned skew-symmetric matrix.

    **Arguments:**

    - `oft_block_size`: the size of each block (default 32); or
    - `r`: the number of blocks per layer. Exactly one of the two is non-zero (PEFT's rule;
      the default is `r=0`). A value that does not divide a layer's input features is
      moved to the nearest one that does, with PEFT's warning.
    - `module_dropout`: PEFT's multiplicative dropout of whole blocks. PEFT 0.21.2 builds
      its dropout layer but never calls it, so the value has no effect there; peftx matches
      that and says so with a warning.
    - `bias`: which biases train: `"none"`, `"all"` or `"oft_only"` (of adapted layers).
    - `init_weights`: `True` starts every rotation at the identity (`oft_R = 0`); `False`
      draws `oft_R` from `N(0, 0.1²)`, as PEFT does (for tests).
    - `coft`, `eps`: constrained OFT: each block's skew matrix is kept within Frobenius
      norm `eps / sqrt(blocks)` of zero.
    - `block_share`: one rotation shared by all blocks of a layer.
    - `use_cayley_neumann`, `num_cayley_neumann_terms`: the Cayley transform by PEFT's
      truncated Neumann series (default, 5 terms) instead of a matrix inverse.
    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`,
      `layers_to_transform`, `layers_pattern`, and PEFT's bookkeeping fields: as for
      `LoraConfig`.
    """

    peft_type: Literal["OFT"] = "OFT"
    r: int = field(
        default=0,
        range=Range(
            lambda v: 0 <= v <= MAX_RANK,
            "`r` (OFT's number of blocks per layer, 0 to use oft_block_size) must be an "
            f"integer in [0, {MAX_RANK}]",
        ),
    )
    oft_block_size: int = field(
        default=32,
        range=Range(
            lambda v: 0 <= v <= MAX_RANK,
            f"`oft_block_size` (0 to use r) must be an integer in [0, {MAX_RANK}]",
        ),
    )
    module_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    bias: Literal["none", "all", "oft_only"] = "none"
    init_weights: bool = True
    coft: bool = False
    eps: int | float = field(
        default=6e-5,
        range=Range(
            lambda v: 0 < v <= FLOAT32_MAX, "`eps` (COFT's radius) must be a positive finite number"
        ),
        converter=float,
    )
    block_share: bool = False
    use_cayley_neumann: bool = True
    num_cayley_neumann_terms: int = field(
        default=5,
        range=Range(
            lambda v: 2 <= v <= 64,
            "`num_cayley_neumann_terms` must be an integer in [2, 64] (fewer than 2 terms "
            "leave every rotation the identity, whatever oft_R holds)",
        ),
    )

    toml_table: ClassVar[str | None] = "oft"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _OFT_KEYS

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.r == 0) == (self.oft_block_size == 0):
            raise ValueError(
                f"Set exactly one of `r` ({self.r}) and `oft_block_size` "
                f"({self.oft_block_size}) to a non-zero value (the other to 0): r x "
                "oft_block_size is each layer's number of input features, so one gives the "
                "other. For example OFTConfig(r=0, oft_block_size=32)."
            )

    def block_size(self, in_features: int, path: str) -> int:
        """The block size for a layer with `in_features` inputs, adjusted as PEFT does
        (with its warning) when `oft_block_size` or `r` does not divide them."""
        asked = self.oft_block_size or self.r
        fits = in_features % asked == 0 and asked <= in_features
        value = asked if fits else _nearest_divisor(in_features, asked)
        if not fits:
            name = "oft_block_size" if self.oft_block_size else "r"
            warnings.warn(
                f"Invalid `{name}` ({asked}) for {path} with {in_features} input features! "
                f"Adjusted `{name}` to ({value}).",
                UserWarning,
                stacklevel=3,
            )
        return value if self.oft_block_size else in_features // value

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if self.module_dropout:
            warnings.warn(
                f"module_dropout={self.module_dropout} has no effect: PEFT 0.21.2 never "
                "applies OFT's multiplicative dropout, and peftx computes what PEFT does.",
                UserWarning,
                stacklevel=2,
            )
        return oft(
            base,
            block_size=self.block_size(base.shape[-1], layer.path),
            coft=self.coft,
            eps=self.eps,
            block_share=self.block_share,
            use_cayley_neumann=self.use_cayley_neumann,
            num_cayley_neumann_terms=self.num_cayley_neumann_terms,
            key=None if self.init_weights else key,
        )

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        changes = super().as_saved(placed)
        if self.use_cayley_neumann and self.peft_version is None:
            # PEFT refuses a Cayley-Neumann adapter without a version (its series changed
            # in 0.18); this one computes PEFT 0.21.2's
            changes["peft_version"] = _OFT_SERIES_VERSION
        return changes

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"OFT in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}. Exclude it (exclude_modules)."
            )
        return None


def _nearest_divisor(n: int, asked: int) -> int:
    """PEFT's `adjust_oft_parameters`: the divisor of `n` nearest `asked` (the lower one
    on a tie), or `n` when `asked` exceeds it."""
    if asked >= n:
        return n
    higher = asked
    while higher <= n and n % higher:
        higher += 1
    lower = asked
    while lower > 1 and n % lower:
        lower -= 1
    return lower if asked - lower <= higher - asked else higher
