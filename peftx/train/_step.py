"""The train and eval steps: plain `eqx.filter_jit` functions over the trainable half."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._bank import PeftBankModel
from .._peft_model import PeftModel, partition
from ..adapters import AbstractLoraBank, AbstractTrainHook, with_dropout
from ..sharding import batch_parts, batch_sharding, process_rows, shard
from ._slots import (
    keep_untrained_slots,
    per_slot_mean,
    put_slots,
    row_counts,
    slot_counts,
    take_slots,
)

Batch = dict[str, Array]
# `loss_fn(model, batch, key) -> (summed loss, sums)`: `sums["count"]` is what the loss is
# summed over (examples, or unmasked tokens), so accumulated micro-batches average exactly.
LossFn = Callable[[Any, Batch, PRNGKeyArray | None], tuple[Float[Array, ""], dict[str, Array]]]


class TrainState(eqx.Module):
    """All a run needs to go on: the trainable half of the model, the optimizer state, the
    step count, the PRNG key (dropout) and the adapters' train hooks (AdaLoRA's rank
    allocator; see `AbstractAdapterConfig.train_hook`), which the step runs."""

    trainable: Any
    opt_state: Any
    step: Int[Array, ""]
    key: PRNGKeyArray
    hooks: tuple[AbstractTrainHook, ...] = ()


def init_state(
    model: PeftModel | PeftBankModel,
    optimizer: optax.GradientTransformation,
    *,
    key: PRNGKeyArray,
    adapters: list[str] | None = None,
    mesh: Mesh | None = None,
    rules: Any = "fsdp",
) -> tuple[TrainState, Any]:
    """`(state, frozen)` for `model`: the adapters train (see `peftx.partition`), the rest
    stays in `frozen`, whatever its dtype (a bf16 or NF4 base with fp32 adapters gets fp32
    gradients and optimizer state).

    With a `mesh`, the model is placed first (`peftx.sharding.shard(model, mesh, rules)`),
    and each optimizer state array takes the sharding of the parameter it belongs to;
    the rest of the state (step counts, the key) is replicated. The train step keeps these
    placements (see `make_train_step`)."""
    if mesh is not None:
        model = shard(model, mesh, rules)
    trainable, frozen = partition(model, adapters)
    trained = (model.active_adapter,) if adapters is None else tuple(adapters)
    made = (model.peft_config[name].train_hook(name, trainable) for name in trained)
    hooks = tuple(h for h in made if h is not None)
    step = jnp.zeros((), jnp.int32)
    if mesh is None:
        opt_state = optimizer.init(trainable)
    else:
        # made in place on the mesh: across processes, no array is ever whole on one
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        placement = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, param: param.sharding,
            jax.eval_shape(optimizer.init, trainable),
            trainable,
            transform_non_params=lambda _: replicated,
        )
        opt_state = jax.jit(optimizer.init, out_shardings=placement)(trainable)
        # through the host: a key on one device cannot move to other processes' devices
        data = jax.device_put(np.asarray(jax.random.key_data(key)), replicated)
        key = jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
        step = jax.device_put(np.zeros((), np.int32), replicated)
        hooks = jax.tree.map(lambda x: jax.device_put(x, replicated), hooks)
    return TrainState(trainable, opt_state, step, key, hooks), frozen


def trained_model(state: TrainState, frozen: Any) -> PeftModel | PeftBankModel:
    """The model `state` has trained: `eqx.combine(state.trainable, frozen)`, with what
    its train hooks learned written into the adapters' configs (AdaLoRA's
    `rank_pattern`, so that `save_pretrained` writes PEFT's pruned file)."""
    model = eqx.combine(state.trainable, frozen)
    for hook in state.hooks:
        name = hook.adapter_name
        changes = hook.config_changes(model.layer_paths(name))
        if changes:
            model = model.with_config(name, dataclasses.replace(model.peft_config[name], **changes))
    return model


def model_output(
    model: Any, batch: Batch, key: PRNGKeyArray | None = None, *, cache: Any = None
) -> Any:
    """`model(input_ids, attention_mask)`, with `key` for the model's own dropout if it
    takes one. Packed rows (`batch["position_ids"]`, from `encode_causal_lm(...,
    pack=True)`) run as `model(input_ids, position_ids=position_ids)`: without a mask, the
    positions' restarts keep each example from seeing the others (transformers' rule);
    their only padding is at the rows' ends (`pad_to`, `eval_batches`), after every real
    token, so no real token sees it. A mixed batch (`batch["adapter_ids"]`, from
    `adapter_ids`) runs each row through its own adapter; when adapters have
    `modules_to_save` copies (a classifier), which replace a whole module, one example
    per call under `jax.vmap`, each with its own dropout keys (each output field then has
    a leading axis of examples). With a `cache` (`KVCache`), the rows continue the cached
    tokens and the output holds the cache with them added."""
    takes_key = "key" in inspect.signature(type(base_model(model)).__call__).parameters
    ids, mask, packed = batch["input_ids"], batch["attention_mask"], {}
    if "position_ids" in batch:
        mask, packed = None, {"position_ids": batch["position_ids"]}

    def run(model: Any, ids: Array, mask: Any, packed: dict, key: Any, **kw: Any) -> Any:
        extra = {"key": key} if takes_key and key is not None else {}
        extra |= {} if cache is None else {"cache": cache}
        return model(ids, mask, **packed, **kw, **extra)

    if "adapter_ids" not in batch:
        return run(model, ids, mask, packed, key)
    if not model.saved_modules:
        return run(model, ids, mask, packed, key, adapter_names=batch["adapter_ids"])
    if cache is not None:
        raise ValueError(
            "a mixed batch of adapters that save whole modules (modules_to_save) runs one "
            "example at a time, which continues no shared cache; leave the prompts unshared"
        )

    def one(row: tuple, adapter: Array, key: PRNGKeyArray | None) -> Any:
        m, k = model, None
        if key is not None:  # training: this example's own dropout masks
            dropout_key, k = jax.random.split(key)
            m = with_dropout(model, dropout_key)
        out = run(m, *jax.tree.map(lambda x: x[None], row), k, adapter_names=adapter)
        return jax.tree.map(lambda x: x[0] if jnp.ndim(x) else x, out)

    keys = None if key is None else jax.random.split(key, ids.shape[0])
    return jax.vmap(one)((ids, mask, packed), batch["adapter_ids"], keys)


def logits(model: Any, batch: Batch, key: PRNGKeyArray | None = None) -> Array:
    """`model_output(model, batch, key).logits`."""
    return model_output(model, batch, key).logits


def base_model(model: Any) -> Any:
    """The model under a `PeftModel` or `PeftBankModel`'s adapters, or `model` itself."""
    return model.base_model if isinstance(model, PeftModel | PeftBankModel) else model


def _in_bank(x: Any) -> bool:
    return isinstance(x, AbstractLoraBank)


def classification_loss(
    model: Any, batch: Batch, key: PRNGKeyArray | None = None
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Summed cross-entropy of `model(input_ids, attention_mask).logits` against
    `batch["labels"]`; rows labelled -100 (padding of the last eval batch) are left out.
    The sums: `count` (rows), `correct` (argmax hits)."""
    scores = logits(model, batch, key).astype(jnp.float32)
    labels = batch["labels"]
    valid = labels >= 0
    safe = jnp.where(valid, labels, 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(scores, safe)
    correct = (jnp.argmax(scores, axis=-1) == labels) & valid
    return jnp.sum(jnp.where(valid, ce, 0.0)), {
        "count": jnp.sum(valid).astype(jnp.float32),
        "correct": jnp.sum(correct).astype(jnp.float32),
    }


def causal_lm_loss(
    model: Any, batch: Batch, key: PRNGKeyArray | None = None
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Summed next-token cross-entropy: position t predicts `labels[t + 1]`, and labels of
    -100 (prompt and padding tokens) are left out, as in transformers. The sum: `count`
    (predicted tokens).

    A mixture of experts' load-balancing `aux_loss` is added, weighted by the config's
    `router_aux_loss_coef`, as transformers adds it with `output_router_logits=True`: to
    the mean loss, so here `count` times over."""
    out = model_output(model, batch, key)
    scores = out.logits[:, :-1].astype(jnp.float32)
    labels = batch["labels"][:, 1:]
    valid = labels >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(scores, jnp.where(valid, labels, 0))
    count = jnp.sum(valid).astype(jnp.float32)
    total = jnp.sum(jnp.where(valid, ce, 0.0))
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        coef = base_model(model).config.router_aux_loss_coef
        total = total + coef * jnp.mean(aux) * count
    return total, {"count": count}


def _micro_batches(batch: Batch, n: int) -> Batch:
    def split(x: Array) -> Array:
        if x.shape[0] % n:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into {n} equal micro-batches"
            )
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(split, batch)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    grad_accumulation: int = 1,
    mesh: Mesh | None = None,
) -> Callable[[TrainState, Any, Batch], tuple[TrainState, dict[str, Array]]]:
    """`step(state, frozen, batch) -> (state, metrics)`, jitted with `eqx.filter_jit`.

    Only `state.trainable` is differentiated. With `grad_accumulation = n` the batch is
    cut into `n` micro-batches run one after the other under `lax.scan` (memory of one
    micro-batch), and the update equals that of the whole batch at once. Each step draws
    fresh dropout keys (LoRA dropout, and the model's own dropout if it takes a `key`).
    The state's train hooks add their penalties to the loss and run after the
    optimizer's update (AdaLoRA's orthogonality penalty and rank allocation).
    `metrics`: `loss` (the mean), `grad_norm`, `finite` (whether both are finite: a run
    that diverged, to stop on; the check needs no extra pass) and the loss function's
    sums.

    With a `mesh` (a state from `init_state(..., mesh=mesh)`), the batch is split over
    `data` and `fsdp` (`peftx.sharding.batch_sharding`), and the new state is constrained
    to the shardings the old one has, so steps follow one another without resharding. In
    a run of several processes (`peftx.sharding.initialize_distributed`), each process
    passes only its own rows (numpy), which make one global batch. `step.lower(state,
    frozen, batch)` gives the compiled program to inspect, as `jax.jit`'s `lower` does.
    """
    if grad_accumulation < 1:
        raise ValueError(f"grad_accumulation must be at least 1, got {grad_accumulation}")

    def summed(trainable: Any, frozen: Any, batch: Batch, key: PRNGKeyArray, hooks: tuple) -> Any:
        dropout_key, model_key = jax.random.split(key)
        model = with_dropout(eqx.combine(trainable, frozen), dropout_key)
        total, sums = loss_fn(model, batch, model_key)
        for hook in hooks:  # a penalty on the mean loss: `count` times over the sum
            total = total + hook.penalty(trainable) * sums["count"]
        return total, sums

    grad_fn = eqx.filter_value_and_grad(summed, has_aux=True)

    @eqx.filter_jit
    def step(
        state: TrainState, frozen: Any, batch: Batch, placed: Any = None
    ) -> tuple[TrainState, dict]:
        if placed is not None:
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh))
        key, step_key = jax.random.split(state.key)
        keys = jax.random.split(step_key, grad_accumulation)
        trainable, opt_state = state.trainable, state.opt_state
        bank = frozen if isinstance(frozen, PeftBankModel) else None
        if bank is not None:
            slots = bank.max_adapters
            rows = batch["input_ids"].shape[0]
            ids = jnp.broadcast_to(batch.get("adapter_ids", bank.active_slot), (rows,))
            batch = {**batch, "adapter_ids": ids}
            # a bank with more slots than the batch has rows is cut down to the slots of
            # this batch's rows (at most one per row): the gradient, the optimizer and the
            # write-back touch no other slot. A smaller bank is stepped whole and masked:
            # cutting it would copy every slot out and back for nothing.
            cut = slots > rows
            if cut:
                groups = jnp.unique(ids, size=rows, fill_value=slots)
                batch["adapter_ids"] = jnp.searchsorted(groups, ids).astype(jnp.int32)
                trainable, opt_state, frozen = (
                    take_slots(t, groups, slots) for t in (trainable, opt_state, frozen)
                )
            else:
                groups = jnp.arange(slots, dtype=jnp.int32)
        if grad_accumulation == 1:
            (total, sums), grads = grad_fn(trainable, frozen, batch, keys[0], state.hooks)
        else:

            def one(carry: Any, xs: Any) -> Any:
                micro, k = xs
                (t, s), g = grad_fn(trainable, frozen, micro, k, state.hooks)
                return jax.tree.map(jnp.add, carry, (t, s, g)), None

            shapes = eqx.filter_eval_shape(grad_fn, trainable, frozen, batch, keys[0], state.hooks)
            (t0, s0), g0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            micro = _micro_batches(batch, grad_accumulation)
            (total, sums, grads), _ = jax.lax.scan(one, (t0, s0, g0), (micro, keys))
        count = jnp.maximum(sums["count"], 1.0)
        if bank is not None:  # each adapter's gradient: the mean over its own rows
            counts = slot_counts(batch["adapter_ids"], row_counts(batch), len(groups))
            grads = per_slot_mean(grads, counts)
            written = (groups < slots) & bank.trained_slots[jnp.minimum(groups, slots - 1)]
            written = written & (counts > 0)
        grads = jax.tree.map(
            lambda g: g if bank is not None and _in_bank(g) else (g / count).astype(g.dtype),
            grads,
            is_leaf=_in_bank,
        )
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = eqx.apply_updates(trainable, updates)
        if bank is not None and cut:
            trainable = put_slots(state.trainable, groups, trainable, written)
            opt_state = put_slots(state.opt_state, groups, opt_state, written)
        elif bank is not None:
            trainable = keep_untrained_slots(trainable, state.trainable, written)
            opt_state = keep_untrained_slots(opt_state, state.opt_state, written)
        hooks = []
        for hook in state.hooks:
            trainable, hook = hook.update(trainable, grads, state.step)
            hooks.append(hook)
        loss, norm = total / count, optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)
        metrics = {"loss": loss, "grad_norm": norm, "finite": finite, **sums}
        new = TrainState(trainable, opt_state, state.step + 1, key, tuple(hooks))
        if placed is not None:
            new = jax.lax.with_sharding_constraint(new, placed)
        return new, metrics

    if mesh is None:
        return step

    def arguments(state: TrainState, batch: dict) -> tuple[dict, Any]:
        """The global batch (checked to split over the mesh) and the state's own
        shardings, a static argument: the jitted step returns the state placed as it came."""
        batch = process_rows(mesh, batch)
        parts = batch_parts(mesh)
        rows = {x.shape[0] for x in jax.tree.leaves(batch)}
        if any(n % parts for n in rows):
            raise ValueError(
                f"a batch of {sorted(rows)} rows cannot be split over data x fsdp = "
                f"{mesh.shape['data']} x {mesh.shape['fsdp']} = {parts} devices; make the "
                f"batch size a multiple of {parts}."
            )
        return batch, jax.tree.map(lambda x: x.sharding, state)

    # a batch of numpy rows (each process's own) or arrays: `arguments` places it
    def sharded_step(state: TrainState, frozen: Any, batch: dict) -> tuple[TrainState, dict]:
        batch, placed = arguments(state, batch)
        with jax.set_mesh(mesh):  # the model keeps its activations split by rows
            return step(state, frozen, batch, placed)

    def lower(state: TrainState, frozen: Any, batch: Batch) -> jax.stages.Lowered:
        """The step for these arguments, lowered (`.compile()` gives its HLO, shardings
        and `memory_analysis()`), as a jitted function's `lower` does."""
        batch, placed = arguments(state, batch)
        with jax.set_mesh(mesh):
            return step.lower(state, frozen, batch, placed).lowered

    sharded_step.lower = lower  # type: ignore[attr-defined]
    return sharded_step


def make_eval_step(
    loss_fn: LossFn, *, groups: int | None = None
) -> Callable[[Any, Any, Batch], dict[str, Array]]:
    """`eval_step(trainable, frozen, batch) -> sums` (the summed `loss` and the loss
    function's sums), without dropout; add them over batches and pass them to
    `summarize`.

    With `groups = n`, `batch["group"]` gives each row's group (`0 <= group < n`) and
    every sum is an array of `n`, one per group: one batch evaluates several adapters
    (`batch["adapter_ids"]`) on several datasets at once. The loss is then computed row
    by row under `jax.vmap`, so any `loss_fn` works.
    """

    def sums_of(model: Any, batch: Batch) -> dict[str, Array]:
        total, sums = loss_fn(model, batch, None)
        return {"loss": total, **sums}

    @eqx.filter_jit
    def eval_step(trainable: Any, frozen: Any, batch: Batch) -> dict[str, Array]:
        model = eqx.combine(trainable, frozen)
        if groups is None:
            return sums_of(model, batch)
        rows = {k: v for k, v in batch.items() if k != "group"}
        one = lambda row: sums_of(model, jax.tree.map(lambda x: x[None], row))  # noqa: E731
        per_row = jax.vmap(one)(rows)
        return jax.tree.map(
            lambda x: jax.ops.segment_sum(x, batch["group"], num_segments=groups), per_row
        )

    return eval_step


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Means from summed eval metrics: `loss`, `accuracy` for classification,
    `perplexity` for causal LM, and every other sum a loss gives (the preference losses'
    rewards) as its mean over `count`."""
    count = max(sums["count"], 1.0)
    out = {"loss": sums["loss"] / count}
    means = {k: v / count for k, v in sums.items() if k not in ("loss", "count", "correct")}
    if "correct" in sums:
        out["accuracy"] = sums["correct"] / count
    elif not means:
        out["perplexity"] = float(jnp.exp(out["loss"]))
    return {**out, **means}
