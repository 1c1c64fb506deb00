"""`initialize_lora`: the LoRA inits that read data (PEFT's `"eva"`, `"corda"` and
`"lora_ga"`), run on a `PeftModel` and a few batches. Each layer's inputs are collected in
the model's own forward pass: its weight is wrapped in a `Recorded` array whose product
hands the activations to the host; LoRA-GA's gradients come from `jax.grad`."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ._peft_model import PeftModel, get_peft_model
from ._select import Predicate, select
from ._targets import layer_paths
from .adapters import (
    AdapterSet,
    CordaConfig,
    EvaConfig,
    LoraConfig,
    LoraGAConfig,
    corda_factors,
    eva_components,
    lora_ga_factors,
    sample_covariance,
)
from .implicit import ImplicitArray, materialize, primitive_handler, use_implicit_args
from .train import causal_lm_loss

DATA_INITS = ("eva", "corda", "lora_ga")


class Recorded(ImplicitArray):
    """A layer's `weight` whose products report their activations to the host: `(layer,
    tokens × in)` for each layer of a stack (`layer`, one index per layer)."""

    weight: Any
    layer: Array

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def materialize(self) -> Array:
        return materialize(self.weight)


_SINK: dict[int, list[np.ndarray]] = {}


def _received(layer: Any, x: Any) -> None:
    _SINK.setdefault(int(layer), []).append(np.asarray(x))


def _recorded_product(w: Recorded, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    (wc, xc), wb = ((lc, rc), lb) if w_is_lhs else ((rc, lc), rb)
    if tuple(wc) != (1,) or wb:  # not a Linear layer's `x @ W.T`
        return NotImplemented
    jax.debug.callback(_received, w.layer, jnp.moveaxis(x, xc[0], -1).reshape(-1, x.shape[xc[0]]))
    operands = (w.weight, x) if w_is_lhs else (x, w.weight)
    return use_implicit_args(lambda a, b: lax.dot_general_p.bind(a, b, **params))(*operands)


@primitive_handler("dot_general")
def _recorded_lhs(primitive: Any, w: Recorded, x: Array, **params: Any) -> Any:
    return _recorded_product(w, x, True, params)


@primitive_handler("dot_general")
def _recorded_rhs(primitive: Any, x: Array, w: Recorded, **params: Any) -> Any:
    return _recorded_product(w, x, False, params)


@eqx.filter_jit
def _forward(model: Any, ids: Array, mask: Array | None, extra: dict[str, Array]) -> Any:
    return use_implicit_args(model)(ids, mask, **extra)


def _adapted(tree: Any, name: str) -> Any:
    return select(tree).at(
        Predicate(
            lambda p, n: (
                isinstance(getattr(n, "weight", None), AdapterSet) and name in n.weight.adapters
            ),
            f"layers with adapter {name!r}",
        )
    )


def _token_mask(batch: Mapping[str, Any], config: EvaConfig) -> np.ndarray:
    """PEFT's tokens for EVA: those of `attention_mask` (all without one), less those whose
    label is `label_mask_value` when `use_label_mask` (and a batch has a label per token)."""
    ids = np.asarray(batch["input_ids"])
    mask = np.asarray(batch.get("attention_mask", np.ones_like(ids))).astype(bool)
    labels = np.asarray(batch.get("labels", ()))
    if config.use_label_mask and labels.shape == ids.shape:  # a label per token
        mask &= labels != config.label_mask_value
    return mask.reshape(-1)


def initialize_lora(
    model: PeftModel,
    batches: Sequence[Mapping[str, Any]],
    *,
    key: PRNGKeyArray,
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]] = causal_lm_loss,
    max_batches: int = 1000,
) -> PeftModel:
    """The model with its LoRA initialized from data, as PEFT's `initialize_lora_eva_weights`
    does for `init_lora_weights="eva"`, and `preprocess_corda` (`preprocess_loraga`) then
    `get_peft_model` for `"corda"` (`"lora_ga"`).

    **Arguments:**

    - `model`: a `PeftModel` with one LoRA adapter whose config says `"eva"`, `"corda"` or
      `"lora_ga"` (its `eva_config`, `corda_config` or `lora_ga_config`, or their defaults).
    - `batches`: a few batches as `peftx.train` takes them (`input_ids`,
      `attention_mask`, optionally `labels` and packing's `position_ids`; preference pairs
      as their two sequences), run through the base model (cycled until EVA's components
      converge). EVA reads the tokens of
      `attention_mask`, less those labelled `eva_config.label_mask_value`; CorDA takes
      each row's tokens of `attention_mask` as one sample (PEFT's hook reads one sample per
      forward pass).
    - `key`: draws the init of layers EVA cannot reach (not a Linear's `x @ W.T`), which
      keep PEFT's default init, as in PEFT; and LoRA-GA's `direction="random"`.
    - `loss_fn`: LoRA-GA's loss, `loss_fn(model, batch) -> (sum, {"count": n, ...})` as
      `peftx.train` takes it (default: next-token cross-entropy); the gradient is that of
      `sum / count`, the batch's mean, as transformers' `loss`.
    - `max_batches`: EVA stops with an error after this many batches without converging.

    **Returns:**

    A new `PeftModel`. EVA: each layer's `lora_A` holds the top right-singular vectors of
    its inputs (`lora_B` zero, so the output is the base model's), at the rank EVA gives it
    (`eva_config.rho`); its config records the ranks and alphas in `rank_pattern` and
    `alpha_pattern`, and drops from `target_modules` the layers given rank 0, as PEFT's.
    CorDA: each layer's factors are `r` singular triplets of its weight times its inputs'
    covariance, and its base weight the residual (the output is the base model's); save
    with `path_initial_model_for_weight_conversion` for a LoRA of the original base.
    LoRA-GA: each layer's factors are singular vectors of the mean gradient of the loss
    with respect to its weight (`lora_ga_config`), and its base weight the residual.
    """
    if not isinstance(model, PeftModel):
        raise TypeError(f"initialize_lora takes a PeftModel; got {type(model).__name__}.")
    if len(model.adapter_names) != 1:
        raise ValueError(
            f"initialize_lora initializes a model of one adapter; this one has "
            f"{list(model.adapter_names)}. Initialize before adding others."
        )
    name = model.active_adapter
    config = model.peft_config[name]
    init = getattr(config, "init_lora_weights", None)
    if not isinstance(config, LoraConfig) or init not in DATA_INITS:
        raise ValueError(
            f"initialize_lora needs a LoraConfig with init_lora_weights in {list(DATA_INITS)}; "
            f"adapter {name!r} has a {type(config).__name__} with init_lora_weights={init!r}."
        )
    batches = list(batches)
    if not batches:
        raise ValueError("initialize_lora needs at least one batch; got none.")
    names, probe_model = _probe(model.base_model, name)
    if init == "lora_ga":
        return _lora_ga(model, name, config, names, batches, key, loss_fn)
    batches = [_sequences(b) for b in batches]
    if init == "corda":
        return _corda(model, name, config, names, probe_model, batches)
    return _eva(model, name, config, names, probe_model, batches, key, max_batches)


def _sequences(batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """A batch of sequences: preference pairs (`encode_preference`, `(rows, 2, length)`)
    as their chosen and rejected sequences, each a row, which is what the model sees of
    them in training."""
    if "prompt_input_ids" in batch:
        raise ValueError(
            "initialize_lora reads the layers' inputs on whole sequences; pass the preference "
            "pairs as encode_preference makes them, before share_prompts."
        )
    if np.ndim(batch["input_ids"]) != 3:
        return batch
    keys = ("input_ids", "attention_mask", "labels")
    return {k: np.reshape(batch[k], (-1, np.shape(batch[k])[-1])) for k in keys if k in batch}


def _probe(base_model: Any, name: str) -> tuple[list[str], Any]:
    """The names of the Linear layers carrying adapter `name` (a stack's one by one), and
    the base model with their weights `Recorded` (numbered in that order)."""
    chosen = _adapted(base_model, name)
    names: list[str] = []
    probed = []
    for path, layer in zip(chosen.paths(), chosen.get()):
        if isinstance(layer, eqx.nn.Linear):  # PEFT's EVA leaves embeddings at their init
            base = layer.weight.weight
            index = jnp.arange(len(names), len(names) + len(layer_paths(path)))
            names += layer_paths(path)
            layer = eqx.tree_at(
                lambda m: m.weight, layer, Recorded(base, index.reshape(base.shape[:-2]))
            )
        probed.append(layer)
    if not names:
        raise ValueError(f"adapter {name!r} has no Linear layer to initialize from data.")
    return names, chosen.set(probed)


def _activations(
    probe_model: Any, names: list[str], batch: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Each layer's inputs `(rows, tokens, in)` on `batch`, run as `peftx.train` runs it
    (packed rows on their `position_ids`)."""
    _SINK.clear()
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch.get("attention_mask", jnp.ones_like(ids)))
    extra = {"position_ids": jnp.asarray(batch["position_ids"])} if "position_ids" in batch else {}
    jax.block_until_ready(_forward(probe_model, ids, None if extra else mask, extra))
    jax.effects_barrier()
    out = {}
    for i, layer in enumerate(names):
        calls = _SINK.get(i, [])
        if len(calls) != 1:
            raise ValueError(
                f"{layer} ran {len(calls)} times in one forward pass; a data-driven init reads "
                "the inputs of layers that run once."
            )
        x = calls[0].reshape(*ids.shape, -1)
        if not np.isfinite(x).all():
            raise ValueError(
                f"the inputs of {layer} hold NaN or infinite values on a batch; a data-driven "
                "init needs finite activations (check the base model and the batches)."
            )
        out[layer] = x
    return out


def _eva(
    model: PeftModel,
    name: str,
    config: LoraConfig,
    names: list[str],
    probe_model: Any,
    batches: list[Mapping[str, Any]],
    key: PRNGKeyArray,
    max_batches: int,
) -> PeftModel:
    eva = config.eva_config or EvaConfig()

    def layer_inputs(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        keep = _token_mask(batch, eva)
        found = _activations(probe_model, names, batch)
        return {n: x.reshape(-1, x.shape[-1])[keep] for n, x in found.items()}

    ranks = {n: config.rank_and_alpha(n)[0] for n in names}
    components = eva_components(layer_inputs, batches, ranks, eva, max_batches=max_batches)

    rank_pattern, alpha_pattern = {}, {}
    for n in names:
        r, alpha = config.rank_and_alpha(n)
        new = components[n].shape[0]
        if new and new != r and eva.adjust_scaling_factors:
            alpha = alpha * new / r
        if new and new != config.r:
            rank_pattern[n] = new
        if new and alpha != config.lora_alpha:
            alpha_pattern[n] = alpha
    kept = [n for n in names if components[n].shape[0]]
    others = [q for p in _adapted(model.base_model, name).paths() for q in layer_paths(p)]
    targets = kept + [q for q in others if q not in names]
    new_config = dataclasses.replace(
        config,
        target_modules=targets,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        eva_config=eva,
    )
    rebuilt = get_peft_model(model.unload(), new_config, key=key, adapter_name=name)

    def with_components(path: str, layer: Any) -> Any:
        per_layer = [components.get(q) for q in layer_paths(path)]
        if any(a is None for a in per_layer):
            return layer
        lora_A = layer.weight.adapters[name].lora_A
        a = jnp.asarray(np.stack(per_layer).reshape(lora_A.shape), lora_A.dtype)
        return eqx.tree_at(lambda m: m.weight.adapters[name].lora_A, layer, a)

    placed = _adapted(rebuilt.base_model, name)
    fresh = placed.set([with_components(p, m) for p, m in zip(placed.paths(), placed.get())])
    return dataclasses.replace(rebuilt, base_model=fresh)


def _corda(
    model: PeftModel,
    name: str,
    config: LoraConfig,
    names: list[str],
    probe_model: Any,
    batches: list[Mapping[str, Any]],
) -> PeftModel:
    corda = config.corda_config or CordaConfig()
    if corda.cache_file is not None or corda.covariance_file is not None:
        raise ValueError(
            "corda_config's cache_file and covariance_file are PEFT's torch files, which peftx "
            "neither reads nor writes; set them to None."
        )
    samples: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for batch in batches:
        ids = np.asarray(batch["input_ids"])
        mask = np.asarray(batch.get("attention_mask", np.ones_like(ids))).astype(bool)
        for n, x in _activations(probe_model, names, batch).items():
            samples[n] += [row[keep] for row, keep in zip(x, mask) if keep.any()]
    covariance = {n: sample_covariance(samples[n], corda.use_float16_for_covariance) for n in names}

    def factors(layer: str, weight: np.ndarray, r: int, scaling: float) -> tuple:
        return corda_factors(weight, covariance[layer], r, scaling, corda.corda_method)

    with_corda = dataclasses.replace(config, corda_config=corda)
    return _with_factors(model.with_config(name, with_corda), name, factors)


def _lora_ga(
    model: PeftModel,
    name: str,
    config: LoraConfig,
    names: list[str],
    batches: list[Mapping[str, Any]],
    key: PRNGKeyArray,
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
) -> PeftModel:
    """PEFT's `preprocess_loraga` (the mean over batches of the gradient of the batch's
    mean loss, with respect to each adapted Linear weight) then its `lora_ga_init`."""
    ga = config.lora_ga_config or LoraGAConfig()
    base = model.disable_adapters()
    paths = set(_adapted(model.base_model, name).paths())
    adapted = Predicate(lambda p, n: p in paths and isinstance(n, eqx.nn.Linear), "adapted")
    weights = select(jax.tree.map(lambda _: False, base)).at(adapted)
    spec = weights.set([eqx.tree_at(lambda m: m.weight, m, True) for m in weights.get()])
    diff, static = eqx.partition(base, spec)
    total = None
    for batch in batches:
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        grad = _mean_loss_grad(diff, static, batch, loss_fn)
        total = grad if total is None else jax.tree.map(jnp.add, total, grad)
    grads = {}
    for path, layer in zip(weights.paths(), weights.where_fn()(total)):
        g = np.asarray(layer.weight, np.float32) / len(batches)
        grads.update(zip(layer_paths(path), g.reshape(-1, *g.shape[-2:])))
    for layer, g in grads.items():
        if not np.isfinite(g).all():
            raise ValueError(
                f"the gradient of {layer} holds NaN or infinite values; LoRA-GA needs finite "
                "gradients (check the base model and the batches)."
            )
    draws = iter(jax.random.split(key, len(grads)))

    def factors(layer: str, weight: np.ndarray, r: int, scaling: float) -> tuple:
        drawn = np.asarray(jax.random.permutation(next(draws), 2 * r)[:r])
        return lora_ga_factors(weight, grads[layer], r, scaling, ga, drawn)

    with_ga = dataclasses.replace(config, lora_ga_config=ga)
    return _with_factors(model.with_config(name, with_ga), name, factors)


@eqx.filter_jit
def _mean_loss_grad(diff: Any, static: Any, batch: dict[str, Array], loss_fn: Callable) -> Any:
    def mean_loss(diff: Any) -> Array:
        total, aux = loss_fn(eqx.combine(diff, static), batch)
        return total / aux["count"]

    return jax.grad(mean_loss)(diff)


def _with_factors(
    model: PeftModel,
    name: str,
    factors: Callable[[str, np.ndarray, int, float], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> PeftModel:
    """`model` with each adapted Linear layer's base weight, `lora_A` and `lora_B` from
    `factors(layer name, weight, r, scaling)` (per layer of a stack), in their dtypes."""

    def initialized(path: str, layer: Any) -> Any:
        s = layer.weight
        adapter = s.adapters[name]
        stack = s.weight.shape[:-2]
        weights = np.asarray(s.weight).reshape(-1, *s.weight.shape[-2:])
        per_layer = [
            factors(q, w, adapter.r, adapter.scaling) for w, q in zip(weights, layer_paths(path))
        ]
        residual, lora_A, lora_B = (
            jnp.asarray(np.stack(part).reshape(*stack, *part[0].shape), dtype)
            for part, dtype in zip(
                zip(*per_layer), (s.weight.dtype, adapter.lora_A.dtype, adapter.lora_B.dtype)
            )
        )
        return eqx.tree_at(
            lambda m: (
                m.weight.weight,
                m.weight.adapters[name].lora_A,
                m.weight.adapters[name].lora_B,
            ),
            layer,
            (residual, lora_A, lora_B),
        )

    chosen = _adapted(model.base_model, name)
    fresh = chosen.set(
        [
            initialized(p, m) if isinstance(m, eqx.nn.Linear) else m
            for p, m in zip(chosen.paths(), chosen.get())
        ]
    )
    return dataclasses.replace(model, base_model=fresh)
