"""`QuantizationConfig` and `quantize_model`: a model's linear weights in 4 or 8 bits, as
transformers' `BitsAndBytesConfig` describes them, ready for QLoRA with `get_peft_model`."""

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ._files import read_toml
from ._select import Predicate, of_type, peft_targets, select
from ._targets import expert_fields, output_head
from .adapters import quantize_int8, quantize_nf4

_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# BitsAndBytesConfig keys that peftx reads; the others only matter to bitsandbytes' CUDA
# kernels and are accepted at their defaults.
_DEFAULTS_ELSEWHERE = {
    "llm_int8_threshold": 6.0,
    "llm_int8_enable_fp32_cpu_offload": False,
    "llm_int8_has_fp16_weight": False,
    "bnb_4bit_quant_storage": "uint8",
}

_FIELD_TYPES = {
    "load_in_4bit": (lambda v: isinstance(v, bool), "a bool"),
    "load_in_8bit": (lambda v: isinstance(v, bool), "a bool"),
    "bnb_4bit_quant_type": (lambda v: isinstance(v, str), "a string"),
    "bnb_4bit_use_double_quant": (lambda v: isinstance(v, bool), "a bool"),
    "bnb_4bit_compute_dtype": (
        lambda v: v is None or isinstance(v, str),
        f"None or one of {_COMPUTE_DTYPES}",
    ),
    "llm_int8_skip_modules": (
        lambda v: v is None or isinstance(v, list | tuple) and all(isinstance(x, str) for x in v),
        "None or a list of module names",
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """Which linear weights to quantize and how, with `BitsAndBytesConfig`'s field names.

    - `load_in_4bit`: NF4 (`bnb_4bit_quant_type="nf4"`, bitsandbytes' codes and blocks of
      64), with `bnb_4bit_use_double_quant` quantizing the block scales again.
    - `load_in_8bit`: int8 with one absmax scale per output row (LLM.int8's row codes;
      the outlier decomposition of `llm_int8_threshold` is not implemented).
    - `bnb_4bit_compute_dtype`: the dtype the quantized weights stand for (and compute
      in); default the weights' own. As in bitsandbytes, the weights are quantized as
      stored, not cast to it first.
    - `llm_int8_skip_modules`: modules kept dense, by PEFT's name rule; default: the output
      head (as transformers skips `lm_head`).
    """

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_4bit_quant_type: Literal["nf4"] = "nf4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: str | None = None
    llm_int8_skip_modules: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check, expected = _FIELD_TYPES[field.name]
            value = getattr(self, field.name)
            if not check(value):
                raise TypeError(
                    f"QuantizationConfig: `{field.name}` must be {expected}; got {value!r} of "
                    f"type {type(value).__name__}."
                )
        if self.load_in_4bit == self.load_in_8bit:
            raise ValueError(
                "set exactly one of load_in_4bit and load_in_8bit; got "
                f"load_in_4bit={self.load_in_4bit}, load_in_8bit={self.load_in_8bit}."
            )
        if self.bnb_4bit_quant_type != "nf4":
            raise ValueError(
                f"bnb_4bit_quant_type {self.bnb_4bit_quant_type!r} is not supported; peftx "
                "quantizes to 'nf4' (QLoRA's data type)."
            )
        dtype = self.bnb_4bit_compute_dtype
        if dtype is not None and dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"bnb_4bit_compute_dtype must be one of {_COMPUTE_DTYPES}, got {dtype!r}."
            )
        if self.llm_int8_skip_modules is not None:
            object.__setattr__(self, "llm_int8_skip_modules", tuple(self.llm_int8_skip_modules))

    def to_dict(self) -> dict[str, Any]:
        """The config as transformers writes `quantization_config` into `config.json`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if d["llm_int8_skip_modules"] is not None:
            d["llm_int8_skip_modules"] = list(d["llm_int8_skip_modules"])
        return {"quant_method": "bitsandbytes", **_DEFAULTS_ELSEWHERE, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantizationConfig":
        """From a `quantization_config` dict. Keys peftx does not use are accepted at
        bitsandbytes' defaults and ignored with a warning otherwise."""
        d = dict(d)
        method = d.pop("quant_method", "bitsandbytes")
        if method != "bitsandbytes":
            raise ValueError(f"quant_method {method!r} is not supported; expected 'bitsandbytes'.")
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in d.items():
            # no field takes a float; an ignored setting is still no place for NaN or inf
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"quantization setting `{key}` must be finite; got {value}.")
        ignored = sorted(
            k
            for k in d
            if k not in known and not (k in _DEFAULTS_ELSEWHERE and d[k] == _DEFAULTS_ELSEWHERE[k])
        )
        if ignored:
            warnings.warn(
                f"quantization settings {ignored} have no effect in peftx and are ignored.",
                UserWarning,
                stacklevel=2,
            )
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> "QuantizationConfig | None":
        """The `[quantization]` table of a TOML file (e.g. next to `[lora]`), or None."""
        table = read_toml(path).get("quantization")
        if table is not None and not isinstance(table, dict):
            raise TypeError(f"`quantization` in {path} must be a table, got {table!r}.")
        return None if table is None else cls.from_dict(table)


def quantize_model(model: Any, config: QuantizationConfig) -> Any:
    """`model` with every `eqx.nn.Linear` weight and every stack of expert weights (a
    mixture of experts' `gate_up_proj`, `down_proj`; each expert on its own) quantized as
    `config` says (biases, norms, embeddings and the skipped modules stay dense; a
    quantized layer's bias is cast to `bnb_4bit_compute_dtype`, as bitsandbytes does). The
    result runs under `use_implicit_args`; `get_peft_model` puts adapters on top of it (QLoRA)."""
    skip = config.llm_int8_skip_modules
    if skip is None:
        head = output_head(model)
        kept = Predicate(lambda p, n: p == head, f"output head {head}")
    else:
        kept = peft_targets(list(skip)) if skip else Predicate(lambda p, n: False, "nothing")
    layers = select(model).at(of_type(eqx.nn.Linear) & ~kept)
    dtype = config.bnb_4bit_compute_dtype

    def quantized(weight: Any) -> Any:
        if weight.ndim > 2:
            # a stacked layer (`peftx.models.LayerStack`): each layer quantized on its own
            return eqx.filter_vmap(quantized)(weight)
        if config.load_in_8bit:
            return quantize_int8(weight, dtype=dtype)
        return quantize_nf4(weight, double_quant=config.bnb_4bit_use_double_quant, dtype=dtype)

    def quantize(layer: eqx.nn.Linear) -> Any:
        q = quantized(layer.weight)
        layer = eqx.tree_at(lambda m: m.weight, layer, q)
        if dtype is not None and layer.bias is not None:
            # bitsandbytes' Linear4bit casts its bias to the dtype it computes in
            layer = eqx.tree_at(lambda m: m.bias, layer, layer.bias.astype(jnp.dtype(dtype)))
        return layer

    def quantize_experts(module: Any) -> Any:
        fields = expert_fields(module)
        return eqx.tree_at(
            lambda m: [getattr(m, f) for f in fields],
            module,
            [quantized(getattr(module, f)) for f in fields],
        )

    model = layers.apply(quantize) if len(layers) else model
    # stacks of experts (`MoeExperts`), each expert quantized on its own
    stacks = select(model).at(
        Predicate(
            lambda p, n: any(isinstance(getattr(n, f), jax.Array) for f in expert_fields(n)),
            "expert stacks",
        )
        & ~kept
    )
    return stacks.apply(quantize_experts) if len(stacks) else model
