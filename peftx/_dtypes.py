"""Dtype arguments: one check, whose error lists the valid names."""

from typing import Any

import jax.numpy as jnp
import numpy as np

FLOAT_NAMES = ("float32", "bfloat16", "float16", "float64")
# other libraries' spellings (torch, accelerate, config files) of the names above that numpy
# does not read (it reads "half" and "double" itself)
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "fp64": "float64",
    "f64": "float64",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float32": "float32",
}


def float_dtype(value: Any, name: str = "dtype") -> np.dtype:
    """`value` (a name such as `"bfloat16"`, or a dtype such as `jnp.bfloat16`) as a
    floating dtype; else a `TypeError` naming the argument `name`, listing the valid
    names and the one meant by a known other spelling (`"bf16"`: `"bfloat16"`)."""
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return dtype
    alias = _ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    hint = f" Did you mean {alias!r}?" if alias else ""
    shown = dtype.name if dtype is not None else repr(value)
    raise TypeError(
        f"`{name}` must be a floating dtype, got {shown}; valid names: "
        f"{', '.join(map(repr, FLOAT_NAMES))} (or jnp.float32 and the like).{hint}"
    )
