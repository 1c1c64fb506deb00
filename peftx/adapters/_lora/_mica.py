"""MiCA (Minor Component Adaptation, arXiv 2604.01694): `lora_B` from the left singular
vectors of the weight's smallest singular values, held fixed; `lora_A` zeros, trained."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from ._weight import dense_2d


def mica(weight: Any, r: int, dtype: Any, *, table: bool = False) -> tuple[Array, Array]:
    """PEFT's `mica_init`: `(lora_A, lora_B)` with `lora_B` the last `r` left singular
    vectors of `weight (out, in)` and `lora_A` zeros (so `B @ A = 0` and the base stays as
    it is), both rounded to the weight's dtype, as PEFT stores them, then cast to
    `dtype`. The weight's smallest singular directions are what training may change.
    `table`: `weight` is an embedding table `(num, dim)`, whose projection is its
    transpose."""
    w = dense_2d(weight, r, "MiCA")
    w = w.T if table else w
    u = jnp.linalg.svd(w, full_matrices=False)[0]
    lora_B = u[:, -r:].astype(weight.dtype).astype(dtype)
    lora_A = jnp.zeros((r, w.shape[1]), dtype)
    return lora_A, lora_B
