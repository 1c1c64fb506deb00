"""`fit`: the whole training loop of `peftx finetune` (steps, evaluation, checkpoints it
resumes from, the divergence and collapse checks, metrics and curves) as one function."""

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray
from tqdm import tqdm

from .._bank import PeftBankModel
from .._errors import CheckpointError, RunFailed
from .._files import naming_a_full_disk, temporary_file, write_text
from .._peft_model import BASE, PeftModel
from ..sharding import own_rows, placement_line, writes_files
from ._checkpoints import checkpoints, restore_best, restore_checkpoint, save_checkpoint
from ._data import eval_batches, mixed_batches, train_batches
from ._step import (
    LossFn,
    TrainState,
    causal_lm_loss,
    init_state,
    logits,
    make_eval_step,
    make_train_step,
    summarize,
    trained_model,
)
from ._writers import MetricWriter, closing_writers

Data = dict[str, np.ndarray]
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "linear", "cosine")
# how near ln(vocab_size) an eval loss is the uniform prediction's (float rounding)
UNIFORM_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns: the trained `model` (save this one), the eval metrics
    `before` and `after` training (of `model`), the number of `steps` trained, with
    several adapters the `serving` check of their mixed batch, and with `keep_best` the
    step `model` is from (`best_step`)."""

    model: PeftModel | PeftBankModel
    before: dict[str, Any]
    after: dict[str, Any]
    steps: int
    serving: dict[str, Any] | None = None
    best_step: int | None = None


def make_optimizer(
    steps: int,
    *,
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    schedule: Literal["constant", "linear", "cosine"] = "linear",
    warmup_steps: int = 0,
    max_grad_norm: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`(optimizer, schedule)` of a run of `steps` steps, as a job's `[train]` table
    names them: `warmup_steps` of linear warm-up to `learning_rate`, then the `schedule`
    down to 0 (or `constant`), gradients clipped to `max_grad_norm` (0: not clipped)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    lr, warmup = learning_rate, min(warmup_steps, steps)
    decay = max(steps - warmup, 1)
    tail = {
        "constant": optax.constant_schedule(lr),
        "linear": optax.linear_schedule(lr, 0.0, decay),
        "cosine": optax.cosine_decay_schedule(lr, decay),
    }[schedule]
    rates = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), tail], [warmup])
    update = {
        "adamw": lambda: optax.adamw(rates, weight_decay=weight_decay),
        "adam": lambda: optax.adam(rates),
        "sgd": lambda: optax.sgd(rates),
    }[optimizer]()
    clip = optax.clip_by_global_norm(max_grad_norm) if max_grad_norm else None
    return (optax.chain(clip, update) if clip else update), rates


def fit(
    model: PeftModel | PeftBankModel,
    train_data: Data | Sequence[Data],
    eval_data: Data | Sequence[Data],
    *,
    steps: int,
    batch_size: int,
    loss_fn: LossFn = causal_lm_loss,
    adapters: Sequence[str] | None = None,
    seed: int = 0,
    grad_accumulation: int = 1,
    eval_batch_size: int = 64,
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    schedule: Literal["constant", "linear", "cosine"] = "linear",
    warmup_steps: int = 0,
    max_grad_norm: float = 1.0,
    log_every: int = 10,
    eval_every: int | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 2,
    keep_best: str | None = None,
    greater_is_better: bool | None = None,
    early_stopping_patience: int | None = None,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    writers: Sequence[MetricWriter] = (),
    vocab_size: int | None = None,
    mesh: Mesh | None = None,
    rules: Any = "fsdp",
    key: PRNGKeyArray,
) -> FitResult:
    """Train `model`'s active adapter, or with `adapters` several at once in mixed
    batches, as `peftx finetune` does; the keywords are its `[train]` table's. A
    `PeftBankModel` trains the named adapters' slots, each on the mean over its own rows.

    **Arguments:**

    - `train_data`, `eval_data`: encoded rows (`encode_causal_lm`, `encode_chat`,
      `encode_classification`); with `adapters`, one dataset each, in their order, each
      adapter trained on its own and evaluated on its own and by the base model.
    - `loss_fn`: `causal_lm_loss`, `classification_loss`, or for preference pairs
      (`encode_preference`) `dpo_loss` or `orpo_loss` with their settings
      (`functools.partial(dpo_loss, beta=0.1)`); the train records of `metrics.jsonl`
      carry the means of what a loss sums besides the loss (DPO's rewards).
    - `steps`, `batch_size`, `grad_accumulation`, `seed`: `train_batches`' order.
    - `optimizer` ... `max_grad_norm`: `make_optimizer`'s.
    - `out`: the directory (made if missing) of `metrics.jsonl` (a line per `log_every`
      steps and per evaluation), `curves.png` and `checkpoints/` (every
      `checkpoint_every` steps, the newest `keep_checkpoints` kept); `None` writes
      nothing. With `resume`, the run goes on from the newest checkpoint there that
      restores.
    - `keep_best`: an eval metric (`"eval_loss"` or `"loss"`, `"accuracy"`,
      `"rewards/accuracies"`, ...; with several adapters, its mean over them): the model
      returned is the one of the evaluation (every `eval_every` steps, and the last) where
      it was best, as transformers' `load_best_model_at_end` does; higher is better if
      `greater_is_better`, which by default is False for losses and perplexity, True
      otherwise. `early_stopping_patience`: stop once that many evaluations in a row have
      not improved on the best (transformers' `EarlyStoppingCallback`). A resumed run
      keeps the best so far (checkpoints hold it).
    - `writers`: `TensorBoardWriter`, `WandbWriter`, `MLflowWriter` (any `MetricWriter`):
      each gets the records of `metrics.jsonl` as they are written (by process 0 of
      several; when resuming, first the records kept from before), and is closed when
      `fit` ends, `failed` if it raised.
    - `vocab_size`: a causal LM's vocabulary, for the collapse check (below).
    - `mesh`, `rules`: train on a mesh, as `init_state` places the model.
    - `key`: dropout's PRNG key.

    **Returns:** a `FitResult`. It evaluates before and after training (and every
    `eval_every` steps), printing both and a progress bar.

    **Raises:** `peftx.RunFailed` if a step's loss or gradient norm is not finite (the
    run diverged), the trained weights are not finite or none changed, an evaluation is
    not finite, a causal LM's eval loss after training collapsed to the uniform
    prediction's `ln(vocab_size)`, or several adapters in one batch differ from each run
    alone.
    """
    names = None if adapters is None else list(adapters)
    best = _Best.for_run(keep_best, greater_is_better, early_stopping_patience, eval_every)
    # optax mixes Python floats and int32
    with jax.numpy_dtype_promotion("standard"), closing_writers(writers):
        if names is not None and not len(names) == len(train_data) == len(eval_data):
            raise ValueError(
                f"adapters {names} need a train and an eval dataset each, in their order; "
                f"got {len(train_data)} train and {len(eval_data)} eval datasets"
            )
        tx, rates = make_optimizer(
            steps,
            optimizer=optimizer,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            schedule=schedule,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
        )
        state, frozen = init_state(model, tx, key=key, adapters=names, mesh=mesh, rules=rules)
        if mesh is not None:
            print(placement_line(mesh, rules, (state.trainable, frozen), state.opt_state))
        loop = _Loop(
            names,
            [train_data] if names is None else list(train_data),
            [eval_data] if names is None else list(eval_data),
            loss_fn,
            eval_batch_size,
            learning_rate,
            None if out is None else Path(out),
            best,
            writers,
        )
        state, before, after, trained = loop.train(
            state,
            frozen,
            tx,
            rates,
            steps=steps,
            batch_size=batch_size,
            grad_accumulation=grad_accumulation,
            seed=seed,
            log_every=log_every,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
            mesh=mesh,
        )
        return loop.checked(state, frozen, before, after, trained, vocab_size)


class _Loop:
    """One run of `fit`: its adapters (None: the active one), datasets, evaluation and
    where it writes."""

    def __init__(
        self,
        names: list[str] | None,
        train_sets: list[Data],
        eval_sets: list[Data],
        loss_fn: LossFn,
        eval_batch_size: int,
        learning_rate: float,
        out: Path | None,
        best: "_Best | None",
        writers: Sequence[MetricWriter],
    ):
        self.names, self.train_sets, self.eval_sets = names, train_sets, eval_sets
        self.best = best
        self.loss_fn, self.eval_batch_size = loss_fn, eval_batch_size
        self.learning_rate, self.out, self.writers = learning_rate, out, writers
        self.log = None if out is None else MetricsLog(out / "metrics.jsonl")
        if out is not None and writes_files():
            out.mkdir(parents=True, exist_ok=True)

    def train(
        self,
        state: TrainState,
        frozen: Any,
        tx: optax.GradientTransformation,
        rates: optax.Schedule,
        *,
        steps: int,
        batch_size: int,
        grad_accumulation: int,
        seed: int,
        log_every: int,
        eval_every: int | None,
        checkpoint_every: int | None,
        keep_checkpoints: int,
        resume: bool,
        mesh: Mesh | None,
    ) -> tuple[TrainState, dict, dict, int]:
        """The trained state (with `keep_best`, the best one's adapter), the metrics
        before and after (of that adapter), and the steps trained; or `RunFailed`."""
        total, names = steps, self.names
        initial = state.trainable
        step_fn = make_train_step(self.loss_fn, tx, grad_accumulation=grad_accumulation, mesh=mesh)
        if names is not None:
            ids = np.asarray(trained_model(state, frozen).adapter_ids(names))
        evaluate = self._evaluation(state, frozen, None if names is None else ids)
        report = writes_files()  # process 0 of several

        ckpt_dir = None if self.out is None else self.out / "checkpoints"
        start, last_ckpt = 0, None
        restored = _restore(ckpt_dir, state, total) if resume and ckpt_dir else None
        if restored is not None:
            state, info = restored
            start, before = info["batches"], info["before"]
            last_ckpt = ckpt_dir / f"checkpoint-{start:08d}"
            if self.best is not None:
                self.best.restore(info.get("best"), last_ckpt, state.trainable)
            self._mirror(self._truncate(after=start))  # a new run of each writer: from step 0
            print(f"resuming from {last_ckpt} (step {start} of {total})")
        else:
            if resume and ckpt_dir and checkpoints(ckpt_dir):
                print(f"no checkpoint in {ckpt_dir} restores: starting from step 0")
            self._truncate(after=0)
            before = evaluate(state)
            self._write(*self._eval_records(0, before))
        if self.best is not None:
            self.best.value_of(before, names)  # a metric the evaluation lacks: before training
        self._report("before fine-tuning:", before)

        if names is None:
            batches = train_batches(
                self.train_sets[0],
                batch_size,
                seed=seed,
                start=start,
                grad_accumulation=grad_accumulation,
            )
        else:
            mixed = mixed_batches(
                self.train_sets,
                batch_size,
                seed=seed,
                start=start,
                grad_accumulation=grad_accumulation,
            )
            batches = ({**b, "adapter_ids": ids[b.pop("source")]} for b in mixed)
        every = lambda n, k: bool(k) and n % k == 0  # noqa: E731
        check = lambda n, m: _check_finite(n, m, last_ckpt, self.learning_rate)  # noqa: E731
        tick, seen, pending, stopped = time.perf_counter(), 0, None, None
        with tqdm(
            total=total,
            initial=start,
            desc="fine-tuning",
            unit="step",
            dynamic_ncols=True,
            disable=not report,
        ) as bar:
            for n in range(start + 1, total + 1):
                state, metrics = step_fn(state, frozen, own_rows(mesh, next(batches)))
                if pending is not None:  # a step late, so the device is never left waiting
                    check(*pending)
                pending = (n, metrics)
                seen += batch_size * grad_accumulation
                bar.update()
                if every(n, log_every) or n == total:
                    check(n, metrics)
                    loss = float(metrics["loss"])
                    rate = seen / (time.perf_counter() - tick)
                    lr = float(rates(n - 1))
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", ex_s=f"{rate:.0f}")
                    self._write(
                        {
                            "step": n,
                            "split": "train",
                            "loss": loss,
                            "learning_rate": lr,
                            "examples_per_s": rate,
                            "grad_norm": float(metrics["grad_norm"]),
                            **_loss_means(metrics),
                        }
                    )
                    tick, seen = time.perf_counter(), 0
                if every(n, eval_every) and n != total:
                    check(n, metrics)
                    evaluated = evaluate(state)
                    self._write(*self._eval_records(n, evaluated))
                    self._plot(report)
                    if self.best is not None and self.best.update(
                        n, evaluated, state.trainable, names
                    ):
                        stopped = (n, evaluated)
                        break
                if ckpt_dir and every(n, checkpoint_every) and n != total:
                    check(n, metrics)
                    kept = {} if self.best is None else {"best": self.best.info()}
                    last_ckpt = save_checkpoint(
                        ckpt_dir,
                        state,
                        frozen,
                        info={"batches": n, "before": before, **kept},
                        keep=keep_checkpoints,
                        best=None if self.best is None else self.best.trainable,
                    )
        if pending is not None:
            check(*pending)
        if stopped is not None:
            last, after = stopped
            print(
                f"stopped early at step {last}: {self.best.patience} evaluations without "
                f"improving {self.best.metric} on step {self.best.step}'s"
            )
        else:
            last, after = total, evaluate(state)
            self._write(*self._eval_records(total, after))
            self._plot(report)
            if self.best is not None:
                self.best.update(total, after, state.trainable, names)
        _check_trained(initial, state.trainable, last)
        best = self.best
        if best is not None and best.trainable is not None and best.step != last:
            state = TrainState(best.trainable, state.opt_state, state.step, state.key, state.hooks)
            after = best.metrics
            print(
                f"the best evaluation ({best.metric} {best.value:.4g}) was at step "
                f"{best.step}: its adapter is kept"
            )
        self._report("after fine-tuning: ", after)
        return state, before, after, last

    def checked(
        self,
        state: TrainState,
        frozen: Any,
        before: dict,
        after: dict,
        steps: int,
        vocab_size: int | None,
    ) -> FitResult:
        """The run's result once its evaluations are finite, a causal LM's has not
        collapsed, and several adapters serve in one batch as each alone; or `RunFailed`."""
        model = trained_model(state, frozen)
        for split, metrics in (("before", before), ("after", after)):
            if not _all_finite(metrics):
                raise RunFailed(
                    f"the evaluation {split} training is not finite ({metrics}); no adapter "
                    "was written"
                )
        if vocab_size is not None:
            self._check_learned(before, after, vocab_size)
        serving = None
        if self.names is not None:
            serving = _serving_check(model, self.names, self.eval_sets)
            print(
                f"served {serving['rows']} in one batch: max |mixed - each alone| = "
                f"{serving['max_abs_diff']:.3g} (tolerance {serving['tolerance']:.3g})"
            )
            if not serving["max_abs_diff"] <= serving["tolerance"]:
                raise RunFailed(
                    "serving check failed: a mixed batch differs from each adapter run alone "
                    f"by {serving['max_abs_diff']:.3g}, over the tolerance "
                    f"{serving['tolerance']:.3g}; nothing was saved"
                )
        best_step = None if self.best is None else self.best.step
        return FitResult(model, before, after, steps, serving, best_step)

    def _evaluation(self, state: TrainState, frozen: Any, ids: np.ndarray | None) -> Any:
        """`evaluate(state)`: the eval metrics; with several adapters, each one's on its
        own eval data, and the base model's on each (`{name: metrics, ..., "__base__":
        {name: metrics}}`)."""
        if ids is None:
            data, eval_step = self.eval_sets[0], make_eval_step(self.loss_fn)
        else:
            base = int(trained_model(state, frozen).adapter_ids([BASE])[0])
            data = _eval_set(self.eval_sets, ids, base)
            eval_step = make_eval_step(self.loss_fn, groups=2 * len(ids))

        def evaluate(state: TrainState) -> dict:
            sums: dict[str, Any] = {}
            for batch in eval_batches(data, self.eval_batch_size):
                for k, v in eval_step(state.trainable, frozen, batch).items():
                    sums[k] = sums.get(k, 0.0) + v
            if self.names is None:
                return summarize({k: float(v) for k, v in sums.items()})
            pick = lambda g: summarize({k: float(v[g]) for k, v in sums.items()})  # noqa: E731
            out = {name: pick(2 * i) for i, name in enumerate(self.names)}
            return {**out, BASE: {name: pick(2 * i + 1) for i, name in enumerate(self.names)}}

        return evaluate

    def _eval_records(self, step: int, metrics: dict) -> list[dict]:
        """`metrics.jsonl` records of an evaluation: one, or one per adapter and dataset."""
        if self.names is None:
            return [{"step": step, "split": "eval", **metrics}]
        return [
            {"step": step, "split": "eval", "adapter": who, "data": name, **m}
            for name in self.names
            for who, m in ((name, metrics[name]), (BASE, metrics[BASE][name]))
        ]

    def _report(self, when: str, metrics: dict) -> None:
        if self.names is None:
            print(f"{when} {_describe(metrics)}")
            return
        print(when.rstrip())
        for name in self.names:
            base = _describe(metrics[BASE][name])
            print(f"  {name}: {_describe(metrics[name])} (on its data, {BASE}: {base})")

    def _check_learned(self, before: dict, after: dict, vocab_size: int) -> None:
        """`RunFailed` if a causal LM's run collapsed for any of its adapters (`_collapsed`:
        it diverged to uniform output, or worse, without overflowing)."""
        if self.names is None:
            losses = [("", before, after)]
        else:
            losses = [(f"adapter {n!r}: ", before[n], after[n]) for n in self.names]
        for who, b, a in losses:
            if _collapsed(b["loss"], a["loss"], vocab_size):
                raise RunFailed(
                    f"the run collapsed: {who}eval loss {a['loss']:.4g} after training "
                    f"({b['loss']:.4g} before) is no better than a uniform prediction over the "
                    f"{vocab_size} tokens (ln {vocab_size} = {math.log(vocab_size):.4g}); lower "
                    f"train.learning_rate (now {self.learning_rate:g}). No adapter was "
                    "written"
                )

    def _write(self, *records: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(*records)
        self._mirror(records)

    def _mirror(self, records: Sequence[dict[str, Any]]) -> None:
        """Give the writers `records` as `metrics.jsonl` holds them (by process 0)."""
        if self.writers and records and writes_files():
            plain = [_finite_or_null(r) for r in records]
            for writer in self.writers:
                writer.write(plain)

    def _truncate(self, after: int) -> list[dict[str, Any]]:
        return [] if self.log is None else self.log.truncate(after)

    def _plot(self, report: bool) -> None:
        if self.out is not None and report:
            plot(self.out / "metrics.jsonl", self.out / "curves.png")


@dataclasses.dataclass
class _Best:
    """`fit(keep_best=...)`: the best evaluation so far (its step, metric value, metrics
    and trainable tree) and how many evaluations since have not improved on it."""

    metric: str
    greater: bool
    patience: int | None
    step: int = 0
    value: float | None = None
    metrics: dict | None = None
    trainable: Any = None
    bad: int = 0

    @classmethod
    def for_run(
        cls,
        keep_best: str | None,
        greater_is_better: bool | None,
        patience: int | None,
        eval_every: int | None,
    ) -> "_Best | None":
        if keep_best is None:
            if patience is not None or greater_is_better is not None:
                raise ValueError(
                    "early_stopping_patience and greater_is_better go with keep_best, the "
                    'eval metric to compare (e.g. keep_best="eval_loss")'
                )
            return None
        if not isinstance(keep_best, str) or not keep_best.removeprefix("eval_"):
            raise ValueError(
                f'keep_best must name an eval metric, e.g. "eval_loss", got {keep_best!r}'
            )
        metric = keep_best.removeprefix("eval_")
        if patience is not None:
            if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
                raise ValueError(f"early_stopping_patience must be an int >= 1, got {patience!r}")
            if eval_every is None:
                raise ValueError(
                    "early_stopping_patience counts evaluations: set eval_every as well"
                )
        if greater_is_better is None:  # transformers' default, and perplexity is a loss too
            greater_is_better = not metric.endswith(("loss", "perplexity"))
        return cls(metric, bool(greater_is_better), patience)

    def value_of(self, metrics: dict, names: list[str] | None) -> float:
        """The metric of an evaluation: with several adapters, its mean over them."""
        each = [metrics] if names is None else [metrics[n] for n in names]
        if self.metric not in each[0]:
            raise ValueError(
                f"keep_best: the evaluation has no metric {self.metric!r}; it has "
                f"{', '.join(sorted(each[0]))}"
            )
        return float(np.mean([m[self.metric] for m in each]))

    def update(self, step: int, metrics: dict, trainable: Any, names: list[str] | None) -> bool:
        """Record step `step`'s evaluation; whether the run should stop (patience spent)."""
        value = self.value_of(metrics, names)
        better = self.value is None or (value > self.value if self.greater else value < self.value)
        if better and math.isfinite(value):
            self.step, self.value, self.metrics, self.trainable, self.bad = (
                step,
                value,
                metrics,
                trainable,
                0,
            )
        else:
            self.bad += 1
        return self.patience is not None and self.bad >= self.patience

    def info(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (its trainable tree goes beside)."""
        return {"step": self.step, "value": self.value, "metrics": self.metrics, "bad": self.bad}

    def restore(self, info: Any, checkpoint: Path, like: Any) -> None:
        """The best so far of a resumed run, from its checkpoint."""
        if not isinstance(info, dict) or not info.get("step"):
            return  # no evaluation after training began before the checkpoint
        self.step, self.value, self.metrics, self.bad = (
            info["step"],
            info["value"],
            info["metrics"],
            info["bad"],
        )
        self.trainable = restore_best(checkpoint, like)


def _eval_set(eval_sets: list[Data], ids: np.ndarray, base: int) -> Data:
    """Every adapter's eval rows twice, routed to the adapter (group 2i) and to the base
    (group 2i + 1), as one dataset for `make_eval_step(groups=...)`."""
    parts = []
    for i, data in enumerate(eval_sets):
        for group, route in ((2 * i, ids[i]), (2 * i + 1, base)):
            rows = len(data["input_ids"])
            extra = {"adapter_ids": np.full(rows, route, np.int32), "group": np.full(rows, group)}
            parts.append({**data, **extra})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _describe(metrics: dict[str, float]) -> str:
    return ", ".join(
        f"{k} {v:.2%}" if k == "accuracy" else f"{k} {v:.4g}" for k, v in metrics.items()
    )


def _loss_means(metrics: dict) -> dict[str, float]:
    """A step's means of what its loss function sums besides the loss (the preference
    losses' rewards: `rewards/margins`, ...), over the step's `count`."""
    count = max(float(metrics["count"]), 1.0)
    skip = ("loss", "grad_norm", "finite", "count", "correct")
    return {k: float(v) / count for k, v in metrics.items() if k not in skip}


def _check_finite(n: int, metrics: dict, last_checkpoint: Path | None, lr: float) -> None:
    """`RunFailed` if step `n`'s loss or gradient norm is not finite."""
    if bool(metrics["finite"]):
        return
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    kept = (
        f"the last good checkpoint stays in {last_checkpoint}"
        if last_checkpoint is not None
        else "no checkpoint was saved"
    )
    raise RunFailed(
        f"the run diverged at step {n}: loss {loss}, gradient norm {norm}; lower "
        f"train.learning_rate (now {lr:g}) or set train.max_grad_norm. No adapter was "
        f"written; {kept}"
    )


def _restore(ckpt_dir: Path, state: TrainState, total: int) -> tuple[TrainState, dict] | None:
    """The newest checkpoint in `ckpt_dir` that restores, and its info: a damaged one is
    passed over with one line saying so."""
    for ckpt in reversed(checkpoints(ckpt_dir)):
        try:
            restored, info = restore_checkpoint(ckpt, state)
            batches, before = info.get("batches"), info.get("before")
            if not isinstance(batches, int) or not 1 <= batches <= total:
                raise CheckpointError(f"'batches' is {batches!r}, not a step in 1..{total}")
            if batches != info["step"]:
                raise CheckpointError(f"'batches' is {batches}, 'step' {info['step']}")
            if not isinstance(before, dict):
                raise CheckpointError(f"'before' is {before!r}, not the first evaluation")
            return restored, info
        except CheckpointError as e:
            print(f"checkpoint {ckpt} is damaged, passed over: {' '.join(str(e).split())}")
    return None


def _check_trained(initial: Any, trained: Any, steps: int) -> None:
    """`RunFailed` if a trained array is not finite, or none changed in training."""
    pairs = list(
        zip(
            jax.tree.leaves(eqx.filter(initial, eqx.is_array)),
            jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
            strict=True,
        )
    )
    if not all(bool(jnp.isfinite(b).all()) for _, b in pairs):
        raise RunFailed("the trained weights are not finite; no adapter was written")
    if all(bool(jnp.array_equal(a, b)) for a, b in pairs):
        raise RunFailed(
            f"{steps} steps changed no trained weight: nothing was learned (is every "
            "gradient zero?); no adapter was written"
        )


def _serving_check(
    model: PeftModel | PeftBankModel, names: list[str], eval_sets: list[Data]
) -> dict:
    """One batch with a row for each adapter and one for the base (`__base__`), each
    row's logits against that adapter run alone (`set_adapter`) and the base alone."""
    run = eqx.filter_jit(logits)
    serve = [*names, BASE]
    # adapter i gets a row of its eval data; the base the row of the first adapter's
    rows = [eval_sets[i] for i in range(len(names))] + [eval_sets[0]]
    # a row's first sequence (of a preference pair, the chosen one)
    first = lambda x: x[0].reshape(-1, x.shape[-1])[0]  # noqa: E731
    ids = jnp.asarray(np.stack([first(r["input_ids"]) for r in rows]))
    mask = jnp.asarray(np.stack([first(r["attention_mask"]) for r in rows]))
    mixed = run(
        model, {"input_ids": ids, "attention_mask": mask, "adapter_ids": model.adapter_ids(serve)}
    )
    alone = jnp.stack(
        [
            run(
                model.disable_adapters() if name == BASE else model.set_adapter(name),
                {"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]},
            )[0]
            for i, name in enumerate(serve)
        ]
    )
    eps = float(jnp.finfo(mixed.dtype).eps)
    mixed, alone = np.asarray(mixed, np.float32), np.asarray(alone, np.float32)
    tolerance = 64 * eps * max(1.0, float(np.abs(alone).max()))  # as the batch size changes
    return {
        "rows": serve,
        "max_abs_diff": float(np.abs(mixed - alone).max()),
        "tolerance": tolerance,
    }


def _collapsed(before: float, after: float, vocab_size: int) -> bool:
    """Whether a causal LM's eval losses before and after training say the run collapsed:
    the loss after is not below the uniform prediction's, ln(vocab_size), and is worse
    than before or is the uniform prediction's itself (within `UNIFORM_TOLERANCE`)."""
    uniform = math.log(vocab_size)
    margin = UNIFORM_TOLERANCE * uniform
    return after >= uniform - margin and (after > before or after <= uniform + margin)


def _all_finite(tree: Any) -> bool:
    if isinstance(tree, dict):
        return all(_all_finite(v) for v in tree.values())
    return not isinstance(tree, float) or math.isfinite(tree)


def _finite_or_null(value: Any) -> Any:
    """A record's value as strict JSON allows: a non-finite float becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    return value


class MetricsLog:
    """`metrics.jsonl`: one JSON object per line, appended as the run goes (by process 0
    of several)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, *records: dict[str, Any]) -> None:
        if not writes_files():
            return
        lines = "".join(json.dumps(_finite_or_null(r), allow_nan=False) + "\n" for r in records)
        data = lines.encode("utf-8")
        with naming_a_full_disk(self.path, len(data)), self.path.open("ab") as f:
            f.write(data)

    def truncate(self, after: int) -> list[dict[str, Any]]:
        """Drop the records past step `after` (a killed run's, after its last checkpoint),
        and any line a kill tore; returns the records kept."""
        if not writes_files() or not self.path.exists():
            return []
        kept, records = [], []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                if record["step"] <= after:
                    kept.append(line)
                    records.append(record)
        write_text(self.path, "".join(line + "\n" for line in kept))
        return records


def plot(metrics: str | os.PathLike, png: str | os.PathLike) -> None:
    """The train loss and the eval metrics of a `metrics.jsonl` against the step, as a
    PNG: accuracy for classification, the reward margins and accuracies of preference
    tuning, perplexity for causal LM."""
    # matplotlib only here: importing it adds ~0.5 s to every command's start-up (`--help` too)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = Path(metrics).read_text(encoding="utf-8")
    records = [json.loads(line) for line in text.splitlines()]
    train_rows = [r for r in records if r["split"] == "train"]
    eval_rows = [r for r in records if r["split"] == "eval"]
    first = eval_rows[0] if eval_rows else {}
    extras = ["perplexity"]
    if "accuracy" in first:
        extras = ["accuracy"]
    elif "rewards/margins" in first:
        extras = ["rewards/margins", "rewards/accuracies"]
    series: dict[str, list[dict]] = {}  # one eval line, or one per adapter and dataset
    for r in eval_rows:
        who, data = r.get("adapter"), r.get("data")
        label = "eval" if who is None else who if who == data else f"{who} on {data}"
        series.setdefault(label, []).append(r)
    fig, (ax_loss, *axes) = plt.subplots(1, 1 + len(extras), figsize=(5 + 5 * len(extras), 4))
    train_steps = [r["step"] for r in train_rows]
    ax_loss.plot(train_steps, [r["loss"] for r in train_rows], label="train")
    for label, rows in series.items():
        steps = [r["step"] for r in rows]
        ax_loss.plot(steps, [r["loss"] for r in rows], "o-", label=label)
        for ax, extra in zip(axes, extras, strict=True):
            ax.plot(steps, [r[extra] for r in rows], "o-", label=label)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    for ax, extra in zip(axes, extras, strict=True):
        trained = bool(train_rows) and extra in train_rows[0]  # preference tuning's rewards
        if trained:
            ax.plot(train_steps, [r[extra] for r in train_rows], label="train")
        if len(series) > 1 or trained:
            ax.legend()
        ax.set(xlabel="step", ylabel=extra, title=extra if trained else f"eval {extra}")
    fig.tight_layout()
    tmp = temporary_file(Path(png))
    try:
        fig.savefig(tmp, dpi=80, format="png")
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
