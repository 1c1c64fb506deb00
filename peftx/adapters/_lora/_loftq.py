"""LoftQ (Li et al. 2023, arXiv 2310.08659): the base quantized to NF4 and the LoRA
factors chosen together, alternating quantization of `W` less the low-rank part with an
SVD of what quantization lost."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from .._quantized import NF4Array, quantize_nf4
from ._weight import dense_2d

LOFTQ_BITS = (4,)


def loftq(
    weight: Any, r: int, *, bits: int, iters: int, dtype: Any
) -> tuple[NF4Array, Array, Array]:
    """PEFT's `loftq_init`: `(base, lora_A, lora_B)` with `base` the NF4 (bitsandbytes'
    blocks of 64, no double quantization, the weight's dtype) of `W − B₀A₀` and
    `B @ A` the top-`r` SVD of `W − dequantized(base)`, its singular values split evenly
    between the factors, after `iters` rounds (the first from `B₀A₀ = 0`). As in PEFT the
    factors ignore `scaling`: `base + B @ A ≈ W`, so the start is the base model's output
    to quantization error when `scaling` is 1 (`lora_alpha = r`)."""
    if bits not in LOFTQ_BITS:
        raise ValueError(
            f"loftq_bits={bits}: peftx's LoftQ quantizes to NF4, loftq_bits=4 (PEFT's 8-bit "
            "LoftQ uses bitsandbytes' int8 on CUDA)."
        )
    if iters < 1:
        raise ValueError(f"loftq_iter must be a positive integer, got {iters}.")
    w = dense_2d(weight, r, "LoftQ")
    target = w
    for _ in range(iters):
        base = quantize_nf4(target, dtype=weight.dtype)
        u, s, vh = jnp.linalg.svd(w - base.materialize(jnp.float32), full_matrices=False)
        root = jnp.sqrt(s[:r])
        lora_A, lora_B = root[:, None] * vh[:r], u[:, :r] * root[None, :]
        target = w - lora_B @ lora_A
    return base, lora_A.astype(dtype), lora_B.astype(dtype)
