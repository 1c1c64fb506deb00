"""Merging adapters into dense (or re-quantized) weights."""

import warnings
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .._kind import AbstractAdapter
from ..implicit import ImplicitArray, materialize
from ._quantized import Int8Array, NF4Array, quantize_int8, quantize_nf4
from ._set import AdapterSet


def merge(
    array: ImplicitArray, *, dtype: Any = None, requantize: bool = False, safe: bool = False
) -> Array | ImplicitArray:
    """The dense weight an adapted weight stands for, e.g. `W + s·B·A` for LoRA.

    **Arguments:**

    - `array`: a `LoraArray`, `DoraArray`, `IA3Array`, `AdapterSet` (its active adapters;
      over a dense or quantized base), or any implicit array.
    - `dtype`: the merged weight's dtype (default: the represented dtype).
    - `requantize`: for an adapter over an `NF4Array`/`Int8Array` base, quantize the merged
      weight again in the same format (this rounds, as in HF PEFT, with a warning).
    - `safe`: raise if the merged weight holds NaN or infinity (PEFT's `safe_merge`; reads
      the values, so call it outside `jax.jit`).

    **Returns:**

    A dense array, or a quantized array with `requantize`.
    """
    dense = materialize(array)
    if dtype is not None:
        dense = dense.astype(dtype)
    if safe and not bool(jnp.all(jnp.isfinite(dense))):
        raise ValueError(
            f"merging this {type(array).__name__} gives NaN or infinite values; the adapter "
            "is broken, so the weight was not merged."
        )
    if not requantize:
        return dense
    base = array.weight if isinstance(array, AbstractAdapter | AdapterSet) else None
    if isinstance(base, NF4Array):
        requantized = quantize_nf4(dense, blocksize=base.blocksize, double_quant=base.double_quant)
    elif isinstance(base, Int8Array):
        requantized = quantize_int8(dense)
    else:
        raise ValueError(
            "requantize=True needs an adapter whose base weight is an NF4Array or Int8Array; "
            f"this {type(array).__name__} has a base of type {type(base).__name__}."
        )
    warnings.warn(
        f"merged weight re-quantized to {type(base).__name__}: the result is rounded and differs "
        "slightly from the unmerged adapter.",
        UserWarning,
        stacklevel=2,
    )
    return requantized


def unmerge(merged: Array, adapter: AbstractAdapter) -> AbstractAdapter:
    """The adapter on the base weight recovered from `merged`, the dense weight it stood
    for (`W + s·B·A` for LoRA), by its class's `unmerged`."""
    return eqx.tree_at(lambda m: m.weight, adapter, adapter.unmerged(merged))
