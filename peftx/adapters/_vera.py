"""VeRA: one pair of frozen random projections shared by every adapted layer, and two
trained vectors per layer, `ΔW = λ_b ⊙ B·(λ_d ⊙ A)`.

The kind whole: `VeraArray`, its handlers, and `VeraConfig`."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._config import (
    FINITE,
    PEFT_BASE_KEYS,
    PROBABILITY,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ._layout import WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES
from ._products import LayerKeys, add_update, cast_base_on_astype, dropout, low_rank, rescale

# torch's `mt19937` seeding (Knuth's multiplier), as `torch.Generator.manual_seed` runs it
_MT_MULTIPLIER = 1812433253
_MT_STATE = 624


def torch_cpu_words(seed: int, n: int) -> np.ndarray:
    """The first `n` 32-bit words of `torch.Generator().manual_seed(seed)` on the CPU: a
    Mersenne Twister seeded with the seed's low 32 bits (NumPy's MT19937, state set)."""
    state = [seed % 2**64 & 0xFFFFFFFF]
    for j in range(1, _MT_STATE):
        prev = state[-1]
        state.append((_MT_MULTIPLIER * (prev ^ (prev >> 30)) + j) & 0xFFFFFFFF)
    generator = np.random.MT19937()
    key = np.asarray(state, np.uint32)
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": _MT_STATE}}
    return generator.random_raw(n).astype(np.uint32)


def _kaiming_uniform(words: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """torch's `uniform_(-bound, bound)` in float32 from one word per element (row-major),
    with PEFT's Kaiming bound `sqrt(3)·sqrt(2)/sqrt(fan_in)`: the low 24 bits give
    `u = k/2^24`, and `u·(2·bound) - bound` is rounded once to float32, as torch's AVX2 and
    AVX-512 kernels compute it (a fused multiply-add; in float64 the product and the sum
    are exact, so rounding that once is the same). torch's plain-C kernel
    (`ATEN_CPU_CAPABILITY=default`) rounds twice and can differ by one ulp."""
    bound = np.float32(math.sqrt(3.0) * (math.sqrt(2) / math.sqrt(shape[1])))
    u = (words & np.uint32(0xFFFFFF)).astype(np.float64) / 2**24
    width = np.float64(bound) - np.float64(-bound)
    return (u * width - np.float64(bound)).astype(np.float32).reshape(shape)


def vera_projections(
    projection_prng_key: int, r: int, in_features: int, out_features: int
) -> tuple[Float[np.ndarray, "r in"], Float[np.ndarray, "out r"]]:
    """PEFT's shared `vera_A` `(r, in_features)` and `vera_B` `(out_features, r)`, bit for
    bit: Kaiming-uniform draws from a torch CPU generator seeded with
    `projection_prng_key`, `vera_A` first. Reproduced with NumPy (no torch at run time)."""
    n_a, n_b = r * in_features, out_features * r
    words = torch_cpu_words(projection_prng_key, n_a + n_b)
    vera_A = _kaiming_uniform(words[:n_a], (r, in_features))
    vera_B = _kaiming_uniform(words[n_a:], (out_features, r))
    return vera_A, vera_B


class VeraArray(AbstractAdapter):
    """`weight + λ_b ⊙ B·(λ_d ⊙ A)` for a `Linear` weight `(out, in)`, never formed when
    multiplied, with HF PEFT's names and shapes.

    `vera_A` `(r, in_max)` and `vera_B` `(out_max, r)` are the adapter's frozen random
    projections, shared by all its layers and sized for the largest; this layer uses
    `A = vera_A[:, :in]` and `B = vera_B[:out, :]`. Unstacked layers hold the very same
    arrays (one buffer); layers stacked with `eqx.filter_vmap` hold a copy each. They do
    not train and are not counted as parameters (PEFT keeps them as buffers).
    `vera_lambda_b` `(out,)` and `vera_lambda_d` `(r,)` train.

    A product computes `λ_b ⊙ B·(λ_d ⊙ A·x)` on the factors, in their dtype, and adds it
    to the base product in the wider dtype, rounded to the base's (as PEFT does for a
    bfloat16 base and float32 adapter). Dropout (`vera_dropout`) applies to the input of
    `A` when `dropout_key` is set (see `with_dropout`).
    """

    weight: Any
    vera_lambda_b: Array
    vera_lambda_d: Array
    vera_A: Array
    vera_B: Array
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True
    vera_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "vera_lambda_b": "vera_lambda_b",
        "vera_lambda_d": "vera_lambda_d",
    }
    shared_keys: ClassVar[Mapping[str, str]] = {"vera_A": "vera_A", "vera_B": "vera_B"}
    # the projections are longer than this layer's axes: they follow none
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "vera_lambda_b": (0,),
        "vera_lambda_d": (None,),
        "vera_A": (),
        "vera_B": (),
    }

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"VeRA needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        a, b = tuple(self.vera_A.shape), tuple(self.vera_B.shape)
        r = a[-2] if len(a) >= 2 else 0
        fits = (
            len(a) == len(b) == len(shape)
            and a[:-2] == b[:-2] == stack
            and b[-1] == r
            and a[-1] >= in_
            and b[-2] >= out
        )
        if not fits:
            raise ValueError(
                f"VeRA projections do not fit weight {shape}: expected vera_A (r, in_max) "
                f"with in_max >= {in_} and vera_B (out_max, r) with out_max >= {out}, got "
                f"vera_A {a} and vera_B {b}."
            )
        want = {"vera_lambda_b": (*stack, out), "vera_lambda_d": (*stack, r)}
        for name, expected in want.items():
            got = tuple(getattr(self, name).shape)
            if got != expected:
                raise ValueError(
                    f"{name} must have shape {expected} for weight {shape} and rank r={r}, "
                    f"got {got}."
                )
        for name in ("vera_lambda_b", "vera_lambda_d", "vera_A", "vera_B"):
            if not jnp.issubdtype(getattr(self, name).dtype, jnp.floating):
                raise TypeError(
                    f"{name} must be floating-point, got dtype {getattr(self, name).dtype}."
                )
        if not 0.0 <= self.vera_dropout < 1.0:
            raise ValueError(f"vera_dropout must be in [0, 1), got {self.vera_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def r(self) -> int:
        return self.vera_A.shape[-2]

    def factors(self) -> tuple[Array, Array]:
        """This layer's slices `(A (r, in), B (out, r))` of the shared projections."""
        out, in_ = self.weight.shape[-2:]
        return self.vera_A[..., :in_], self.vera_B[..., :out, :]

    def delta(self) -> Array:
        """`λ_b ⊙ B·(λ_d ⊙ A)`, in the adapter's dtype."""
        a, b = self.factors()
        scaled_a = self.vera_lambda_d[..., :, None] * a
        return self.vera_lambda_b[..., :, None] * jnp.matmul(b, scaled_a)

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""
        return merged - self.delta().astype(merged.dtype)


def _vera_terms(w: VeraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    """`(labels, update)`: the product's labels and `λ_b ⊙ B·(λ_d ⊙ A·x_dropped)` in its
    output order; None when neither axis of the weight meets `x`."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    a, b = w.factors()
    dtype = a.dtype
    a_labels, b_labels = (*stack, "r", in_l), (*stack, out_l, "r")
    x_d = dropout(x, w.vera_dropout, w.dropout_key, p.x, stack).astype(dtype)
    lambda_b = w.vera_lambda_b.astype(dtype)
    if in_l in p.x:
        delta = low_rank(p, a_labels, b_labels, (*stack, "r"))(x_d, a, b, w.vera_lambda_d)
        return p, rescale(delta, p.along(lambda_b, (*stack, out_l), p.out))
    if out_l in p.x:  # xᵀ·ΔW: λ_b meets x first
        x_b = rescale(x_d, p.along(lambda_b, (*stack, out_l), p.x))
        return p, low_rank(p, b_labels, a_labels, (*stack, "r"))(x_b, b, a, w.vera_lambda_d)
    return None


def _vera_dot(w: VeraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    terms = _vera_terms(w, x, w_is_lhs, params)
    if terms is None:
        return NotImplemented
    p, delta = terms
    return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), delta)


def _vera_update(
    w: VeraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    terms = _vera_terms(w, x, w_is_lhs, params)
    return NotImplemented if terms is None else terms[1]


weight_dot_handlers(VeraArray, _vera_dot, _vera_update)
cast_base_on_astype(VeraArray)


def vera(
    weight: Any,
    vera_A: Array,
    vera_B: Array,
    *,
    d_initial: float = 0.1,
    vera_dropout: float = 0.0,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> VeraArray:
    """Wrap a `Linear` weight `(out, in)` in a `VeraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `vera_A`, `vera_B`: the adapter's shared projections (`vera_projections`), sized for
      the largest layer it adapts.
    - `d_initial`: `vera_lambda_d`'s value; `vera_lambda_b` starts at zeros, so the
      output is the base's.
    - `vera_dropout`: as in `peft.VeraConfig`.
    - `dtype`: the trained vectors' dtype.
    - `key`: instead, `vera_lambda_b` ones and `vera_lambda_d` standard normal (PEFT's
      `init_weights=False`, for tests of a non-identity adapter).
    """
    out = weight.shape[-2]
    r = vera_A.shape[-2]
    if key is None:
        lambda_b, lambda_d = jnp.zeros((out,), dtype), jnp.full((r,), d_initial, dtype)
    else:
        lambda_b, lambda_d = jnp.ones((out,), dtype), jax.random.normal(key, (r,), dtype)
    return VeraArray(
        weight,
        lambda_b,
        lambda_d,
        vera_A,
        vera_B,
        vera_dropout=float(vera_dropout),
    )


# -- the config ------------------------------------------------------------------------------

_VERA_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "target_modules",
    "projection_prng_key",
    "save_projection",
    "vera_dropout",
    "d_initial",
    "fan_in_fan_out",
    "bias",
    "modules_to_save",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VeraConfig(AbstractAdapterConfig):
    """HF PEFT's `VeraConfig`: the same field names, meanings and defaults.

    **Arguments:**

    - `r`: the projections' rank (VeRA's `r` is larger than LoRA's: it trains only `r`
      values per layer besides one per output feature).
    - `projection_prng_key`: the seed of the shared frozen projections `vera_A`
      `(r, in_max)` and `vera_B` `(out_max, r)`, drawn as PEFT draws them (a torch CPU
      generator, Kaiming-uniform), so a file without them loads to the same weights.
    - `save_projection`: write the projections into the adapter file
      (`base_model.vera_A`, `base_model.vera_B`); otherwise they are drawn again from
      `projection_prng_key` on loading.
    - `vera_dropout`: dropout probability on the VeRA input, in `[0, 1)`.
    - `d_initial`: the initial value of every `vera_lambda_d` (`vera_lambda_b` starts at
      zeros: a no-op at start).
    - `init_weights`: `False` starts `vera_lambda_b` at ones and `vera_lambda_d` standard
      normal, as PEFT does (for tests of a non-identity adapter).
    - `bias`: which biases train: `"none"`, `"all"` or `"vera_only"` (of adapted layers).
    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`,
      `layers_to_transform`, `layers_pattern`: as for `LoraConfig`; Linear layers only.
      PEFT's `VeraConfig` has no `exclude_modules`: it is written to JSON only when set.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.
    """

    peft_type: Literal["VERA"] = "VERA"
    r: int = field(default=256, range=RANK)
    projection_prng_key: int = field(
        default=0,
        range=Range(
            lambda v: 0 <= v < 2**64,
            "`projection_prng_key` seeds torch's generator: an integer in [0, 2**64)",
        ),
    )
    save_projection: bool = True
    vera_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    d_initial: int | float = field(default=0.1, range=FINITE, converter=float)
    bias: Literal["none", "all", "vera_only"] = "none"
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "vera"
    # PEFT's VeRA defaults are LoRA's, but Phi's attention only
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **LORA_TARGET_MODULES,
        "phi": ("q_proj", "v_proj"),
    }
    _KEYS: ClassVar[tuple[str, ...] | None] = _VERA_KEYS

    def planned(self, layers: tuple[AdaptedLayer, ...]) -> tuple[AdaptedLayer, ...]:
        """Every layer with the adapter's projections, sized for the largest (PEFT's
        `_find_dim`): one pair of arrays, shared."""
        out_max = max(t.layer.weight.shape[-2] for t in layers)
        in_max = max(t.layer.weight.shape[-1] for t in layers)
        vera_A, vera_B = vera_projections(self.projection_prng_key, self.r, in_max, out_max)
        shared = (jnp.asarray(vera_A), jnp.asarray(vera_B))
        return tuple(dataclasses.replace(t, shared=shared) for t in layers)

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        vera_A, vera_B = layer.shared
        return vera(
            base,
            vera_A,
            vera_B,
            d_initial=self.d_initial,
            vera_dropout=self.vera_dropout,
            key=None if self.init_weights else key,
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"VeRA adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None

    @property
    def saves_shared(self) -> bool:
        return self.save_projection
