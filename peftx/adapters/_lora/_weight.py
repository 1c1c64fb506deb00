"""The base weight as the LoRA inits computed from it (PiSSA, OLoRA, MiCA, LoftQ) read it."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from ...implicit import ImplicitArray


def dense_2d(weight: Any, r: int, what: str) -> Array:
    """`weight` as a float32 array, if it is a dense 2-D floating-point one with at least
    `r` singular vectors."""
    if isinstance(weight, ImplicitArray) or weight.ndim != 2:
        raise TypeError(
            f"{what} initialization needs a dense 2-D floating-point weight (load the model "
            "unquantized: a residual can be quantized afterwards, and LoftQ quantizes it "
            f"itself). Got {type(weight).__name__} of shape {tuple(weight.shape)}."
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"{what} needs a floating-point weight, got dtype {weight.dtype}.")
    if r > min(weight.shape):
        raise ValueError(
            f"{what} takes r={r} singular vectors of a weight of shape {tuple(weight.shape)}, "
            f"which has only {min(weight.shape)}; use r <= {min(weight.shape)}."
        )
    return weight.astype(jnp.float32)
