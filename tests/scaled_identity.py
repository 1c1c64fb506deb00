"""A test-only adapter kind written as a library kind is, in one module: a scaled identity,
`(s·I)·W = s·W`, one learned number per layer. Its array class (with its handlers) and its
config class (with its checks, default targets and TOML table) are all it takes; no shared
module of peftx names it. `test_adapter_kind.py` registers it for its own tests only."""

import dataclasses
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from peftx import FINITE, AbstractAdapterConfig, AdaptedLayer, field
from peftx.adapters import AbstractAdapter
from peftx.implicit import primitive_handler, use_implicit_args


class ScaledIdentity(AbstractAdapter):
    """`(s·I)·W = s·W`: the layer's output scaled by one learned number."""

    weight: Any
    scale: jax.Array  # (1,)

    peft_keys: ClassVar[dict[str, str]] = {"scale": "scale_s"}
    weight_axes: ClassVar[dict[str, tuple[int | None, ...]]] = {"scale": (None,)}

    def merged(self, weight: jax.Array) -> jax.Array:
        return weight * self.scale[0].astype(weight.dtype)


def _scaled_product(w: ScaledIdentity, x: jax.Array, w_is_lhs: bool, params: dict) -> jax.Array:
    operands = (w.weight, x) if w_is_lhs else (x, w.weight)
    out = use_implicit_args(lambda a, b: jax.lax.dot_general_p.bind(a, b, **params))(*operands)
    return out * w.scale[0].astype(out.dtype)


@primitive_handler("dot_general")
def _scaled_lhs(primitive, w: ScaledIdentity, x: jax.Array, **params):
    return _scaled_product(w, x, True, params)


@primitive_handler("dot_general")
def _scaled_rhs(primitive, x: jax.Array, w: ScaledIdentity, **params):
    return _scaled_product(w, x, False, params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaledIdentityConfig(AbstractAdapterConfig):
    """The kind's config: each adapted layer starts at `init_scale` (`init="constant"`) or
    at `init_scale` plus a standard normal draw (`init="random"`, for tests)."""

    peft_type: Literal["SCALED_IDENTITY"] = "SCALED_IDENTITY"
    init_scale: float = field(default=1.0, range=FINITE)
    init: Literal["constant", "random"] = "constant"

    toml_table: ClassVar[str | None] = "scaled_identity"
    default_targets: ClassVar[dict[str, tuple[str, ...]]] = {"tiny": ("q", "v")}

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> ScaledIdentity:
        scale = jnp.full((1,), self.init_scale, jnp.float32)
        if self.init == "random":
            scale = scale + jax.random.normal(key, (1,), jnp.float32)
        return ScaledIdentity(base, scale)
