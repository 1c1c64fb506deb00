"""LoRA-GA (LoRA with gradient approximation, PEFT's `init_lora_weights="lora_ga"`): each
adapted layer's factors are singular vectors of the loss's gradient with respect to its
weight on a few batches, so that the first step moves as full fine-tuning would; the weight
less their product becomes the base. This module is the arithmetic on the gradients;
`peftx.initialize_lora` computes them with `jax.grad`."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraGAConfig:
    """PEFT's `LoraGAConfig`, the same fields and defaults.

    **Arguments:**

    - `direction`: which of the gradient's top `2r` singular triplets go where: `"ArB2r"`
      (`lora_A` the first `r` right vectors, `lora_B` the next `r` left ones), `"A2rBr"`
      (the other way round), `"ArBr"` (`A` the odd, `B` the even), `"random"` (`r` of
      them, drawn from the key, for both).
    - `scale`: `"stable"` (`lora_B` times `out^¼ / √stable_gamma`), `"weight_svd"`
      (`lora_B` times the weight's top singular value over `B`'s first), `"gd_scale"` (both
      over the scaling), `"unit"` (none).
    - `stable_gamma`: see `scale`.
    """

    direction: Literal["ArBr", "A2rBr", "ArB2r", "random"] = "ArB2r"
    scale: Literal["stable", "weight_svd", "gd_scale", "unit"] = "stable"
    stable_gamma: int = 16

    @classmethod
    def of(cls, value: "LoraGAConfig | Mapping[str, Any] | None") -> "LoraGAConfig | None":
        """`value` as a `LoraGAConfig` (a dict as `adapter_config.json` holds it)."""
        if value is None or isinstance(value, LoraGAConfig):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"lora_ga_config has unknown keys {unknown}; known: {sorted(known)}.")
        return cls(**value)


def lora_ga_factors(
    weight: np.ndarray,
    grad: np.ndarray,
    r: int,
    scaling: float,
    config: LoraGAConfig,
    drawn: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PEFT's `lora_ga_init` of one Linear weight `(out, in)` from the mean gradient of the
    loss with respect to it: `(residual, lora_A, lora_B)`, the factors rounded to the
    weight's dtype (as PEFT stores them), the residual `W − s·B·A`. `drawn`: the `r`
    indices of `direction="random"`, out of `2r`. PEFT takes the top `2r` triplets from a
    randomized SVD (`torch.svd_lowrank`, `q = 4r`); this is an exact one."""
    u, s, vh = np.linalg.svd(grad.astype(np.float32), full_matrices=False)
    u, s, vh = u[:, : 2 * r], s[: 2 * r], vh[: 2 * r]
    a_rows, b_cols = {
        "ArBr": (slice(1, 2 * r, 2), slice(0, 2 * r, 2)),
        "A2rBr": (slice(r, 2 * r), slice(None, r)),
        "ArB2r": (slice(None, r), slice(r, 2 * r)),
        "random": (drawn, drawn),
    }[config.direction]
    lora_A, lora_B, s_b = vh[a_rows], u[:, b_cols] * s[b_cols], s[b_cols]
    w = weight.astype(np.float32)
    if config.scale == "stable":
        lora_B = lora_B * (w.shape[0] ** 0.25 / config.stable_gamma**0.5)
    elif config.scale == "weight_svd" and s_b[0] > 0:
        lora_B = lora_B * (np.linalg.svd(w, compute_uv=False)[0] / s_b[0])
    elif config.scale == "gd_scale":
        lora_A, lora_B = lora_A / scaling, lora_B / scaling
    lora_A, lora_B = (x.astype(weight.dtype).astype(np.float32) for x in (lora_A, lora_B))
    return w - scaling * lora_B @ lora_A, lora_A, lora_B
