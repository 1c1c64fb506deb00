"""CorDA (context-oriented decomposition adaptation, PEFT's `init_lora_weights="corda"`):
each adapted layer's weight times the covariance of its inputs on a few samples is
decomposed by SVD; the factors take the top (`"ipm"`) or bottom (`"kpm"`) `r` triplets, the
weight less their product becomes the base. This module is the arithmetic on the inputs;
`peftx.initialize_lora` collects them from the model."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class CordaConfig:
    """PEFT's `CordaConfig`, the same fields and defaults.

    **Arguments:**

    - `corda_method`: `"ipm"` (instruction-previewed: the top `r` triplets, for the task)
      or `"kpm"` (knowledge-preserved: the bottom `r`, keeping what the samples use).
    - `use_float16_for_covariance`: accumulate the covariance in float16.
    - `cache_file`, `covariance_file`: PEFT's torch files of its eigens and covariances;
      peftx reads and writes neither (they must be None for `initialize_lora`).
    - `verbose`, `prune_temporary_fields`: PEFT's, with no effect in peftx.
    """

    cache_file: str | None = None
    covariance_file: str | None = None
    corda_method: Literal["ipm", "kpm"] = "ipm"
    verbose: bool = False
    use_float16_for_covariance: bool = False
    prune_temporary_fields: bool = True

    def __post_init__(self) -> None:
        if self.corda_method not in ("ipm", "kpm"):
            raise ValueError(
                f"CordaConfig `corda_method` must be 'ipm' or 'kpm'; got {self.corda_method!r}."
            )

    @classmethod
    def of(cls, value: "CordaConfig | Mapping[str, Any] | None") -> "CordaConfig | None":
        """`value` as a `CordaConfig` (a dict as `adapter_config.json` holds it)."""
        if value is None or isinstance(value, CordaConfig):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"corda_config has unknown keys {unknown}; known: {sorted(known)}.")
        return cls(**value)


def sample_covariance(samples: list[np.ndarray], float16: bool = False) -> np.ndarray:
    """PEFT's covariance of a layer's inputs `(in, in)`: the mean over samples (each
    `(tokens, in)`, scaled by the magnitude of its largest entry) of `xᵀx`."""
    dtype = np.float16 if float16 else np.float32
    total = 0
    for x in samples:
        x = x.astype(dtype)
        x = x / np.abs(x.max())
        total = total + x.T @ x
    return np.asarray(total / len(samples), np.float32)


def corda_factors(
    weight: np.ndarray, covariance: np.ndarray, r: int, scaling: float, method: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PEFT's CorDA init of one Linear weight `(out, in)`: `(residual, lora_A, lora_B)`.

    `W·C` (with `C` the covariance, damped by `d · mean(diag C)` on its diagonal, `d` from
    0.01 doubling until `C` inverts to 5%) is `U S Vᵀ`; with `V' = C⁻¹ V`, the `"ipm"`
    factors take the top `r` triplets (`"kpm"`, the bottom `r`), `lora_A = √(S/s) V'ᵀ`,
    `lora_B = U √(S/s)`, and the residual is `W − s·B·A`."""
    w = weight.astype(np.float32)
    n = covariance.shape[0]
    damp = 0.01
    while True:
        fixed = covariance + np.eye(n, dtype=np.float32) * np.mean(np.diag(covariance)) * damp
        inverse = np.linalg.inv(fixed)
        if np.linalg.norm(fixed @ inverse - np.eye(n)) < 0.05:
            break
        damp *= 2
    u, s, vh = np.linalg.svd(w @ fixed, full_matrices=False)
    v = (vh @ inverse).T
    kept = slice(None, r) if method == "ipm" else slice(-r, None)
    u, s, v = u[:, kept], s[kept] / scaling, v[:, kept]
    lora_A = v.T * np.sqrt(s)[:, None]
    lora_B = u * np.sqrt(s)[None, :]
    residual = w - scaling * lora_B @ lora_A
    return residual, lora_A, lora_B
