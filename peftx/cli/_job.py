"""The `peftx finetune` job: its TOML's tables, checked, with `--set` overrides applied."""

import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from .. import BASE
from .._bank import check_bank_config
from .._config import TOML_TABLES, table_names
from .._files import followed
from .._initialize import DATA_INITS
from ..train import (
    DPO_LOSS_TYPES,
    OPTIMIZERS,
    SCHEDULES,
    MLflowWriter,
    TensorBoardWriter,
    WandbWriter,
)
from ._common import (
    BUNDLED_MODEL,
    ModelSettings,
    UsageError,
    adapter_tables,
    job_model,
    read_toml,
    unknown_key,
)
from ._mesh import mesh_settings
from ._run_dir import DATA_FILES, data_record
from ._sources import SOURCES, Source, data_source, with_base

DATA_KEYS = {
    "train": None,
    "eval": None,
    "eval_fraction": None,
    "text_column": "text",
    "label_column": "label",
    "prompt_column": None,
    "messages_column": None,
    "chosen_column": "chosen",
    "rejected_column": "rejected",
    "max_length": 128,
    "truncation_mode": "keep_start",
    "pack": False,
    # preference pairs: each prompt run once for both completions (None: true for them)
    "share_prompts": None,
}
TRAIN_KEYS = {
    "objective": "sft",
    "seed": 0,
    "epochs": 1,
    "steps": None,
    "batch_size": 16,
    "eval_batch_size": 64,
    "grad_accumulation": 1,
    "optimizer": "adamw",
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    "schedule": "linear",
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "log_every": 10,
    "eval_every": None,
    "checkpoint_every": None,
    "keep_best": None,
    "greater_is_better": None,
    "early_stopping_patience": None,
    "quantize": False,
}
OUTPUT_KEYS = {"dir": None, "merged": False, "keep_checkpoints": 2}
# `[train] objective`: supervised fine-tuning, or preference tuning on `[data]`'s
# prompt/chosen/rejected columns with the settings of `[dpo]` or `[orpo]` (TRL's names)
OBJECTIVES = ("sft", "dpo", "orpo")
DPO_KEYS = {
    "beta": 0.1,
    "loss_type": "sigmoid",
    "label_smoothing": 0.0,
    "precompute_ref_log_probs": False,
}
ORPO_KEYS = {"beta": 0.1}
TRUNCATION_MODES = ("keep_start", "keep_end")
# `[log]`: each writer's key (true: mirror metrics.jsonl there), W&B's project and MLflow's
# experiment, and the name of their run (default: output.dir's name)
LOG_WRITERS = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter, "mlflow": MLflowWriter}
LOG_KEYS = {**dict.fromkeys(LOG_WRITERS, False), "project": "peftx", "run_name": None}
# `[bank]`: the slots of the adapter bank the `[[adapters]]` train in (max_rank: their
# largest r when left out)
BANK_KEYS = {"max_adapters": None, "max_rank": None}
# `[init]`: the batches `peftx.initialize_lora` reads for a data-driven init (EVA): how
# many, of how many rows (default: train.batch_size), from which split's first rows
INIT_KEYS = {"batches": 4, "batch_size": None, "split": "train"}
INIT_SPLITS = ("train", "eval")
PATHS = {("model", "path"), ("data", "train"), ("data", "eval"), ("output", "dir")}
TASK_TYPES = {"classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}
# a name is a folder of the output (PEFT saves an adapter in a subfolder of its name)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# the [train] keys that make the optimizer (`peftx.train.make_optimizer`'s keywords)
OPTIMIZER_KEYS = (
    "optimizer",
    "learning_rate",
    "weight_decay",
    "schedule",
    "warmup_steps",
    "max_grad_norm",
)


def _override(job: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    table, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise UsageError(f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. train.steps=100")
    if table == "adapters":
        raise UsageError(f"--set {item!r}: [[adapters]] entries are changed in the job file")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: a string
    if (table, name) in PATHS and isinstance(value, str) and value != BUNDLED_MODEL:
        value = str(Path(value).expanduser().absolute())  # on the command line: from the cwd
    elif (table, name) in PATHS and isinstance(value, dict):  # a datasets spec
        value = with_base(value, Path.cwd())
    job.setdefault(table, {})[name] = value


def _settings(job: dict[str, Any], table: str, defaults: dict[str, Any], path: Path) -> dict:
    given = job.get(table, {})
    if not isinstance(given, dict):
        raise UsageError(f"{path}: {table!r} must be a table ([{table}])")
    for key in given:
        if key not in defaults:
            raise unknown_key(f"[{table}] of {path}", key, defaults)
    return {**defaults, **given}


# the largest count a job may give: steps and sizes are int32 on the device
MAX_COUNT = 2**31 - 1
COUNTS = [("data", "max_length"), ("output", "keep_checkpoints")] + [
    ("train", k)
    for k in ("batch_size", "eval_batch_size", "grad_accumulation", "epochs", "log_every")
]
OPTIONAL_COUNTS = [
    ("train", k) for k in ("steps", "eval_every", "checkpoint_every", "early_stopping_patience")
]
FLOAT32_MAX = 3.4028234663852886e38
# (key, smallest allowed, whether the smallest is allowed)
RATES = [("learning_rate", 0.0, False), ("weight_decay", 0.0, True), ("max_grad_norm", 0.0, True)]
FLAGS = [("data", "pack"), ("output", "merged"), ("train", "quantize")]
TEXT = [("data", "text_column"), ("data", "label_column")]


def _check_numbers(job: "Job", path: Path) -> None:
    """Every number, flag and name of `[data]`, `[train]` and `[output]` has the type and
    range it must: counts are integers in 1..2**31-1, rates finite numbers."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for table, key in COUNTS + OPTIONAL_COUNTS:
        value = getattr(job, table)[key]
        if value is None and (table, key) in OPTIONAL_COUNTS:
            continue
        if not is_int(value) or value < 1:
            raise UsageError(f"{path}: {table}.{key} must be a positive integer, got {value!r}")
        if value > MAX_COUNT:
            raise UsageError(f"{path}: {table}.{key} must be at most {MAX_COUNT}, got {value}")
    t = job.train
    if not is_int(t["warmup_steps"]) or not 0 <= t["warmup_steps"] <= MAX_COUNT:
        raise UsageError(
            f"{path}: train.warmup_steps must be an integer >= 0, got {t['warmup_steps']!r}"
        )
    if not is_int(t["seed"]) or not 0 <= t["seed"] < 2**32:
        raise UsageError(f"{path}: train.seed must be an integer in 0..2**32-1, got {t['seed']!r}")
    for key, low, inclusive in RATES:
        value = t[key]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise UsageError(f"{path}: train.{key} must be a number, got {value!r}")
        # the optimizer computes in float32: a larger value is infinite there
        finite = math.isfinite(value) and abs(value) <= FLOAT32_MAX
        if not finite or value < low or (value == low and not inclusive):
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise UsageError(
                f"{path}: train.{key} must be a finite number {bound} (float32: at most "
                f"{FLOAT32_MAX:.4g}), got {value!r}"
            )
        t[key] = float(value)
    if t["greater_is_better"] is not None and not isinstance(t["greater_is_better"], bool):
        raise UsageError(
            f"{path}: train.greater_is_better must be true or false, got {t['greater_is_better']!r}"
        )
    if t["keep_best"] is None and (
        t["early_stopping_patience"] is not None or t["greater_is_better"] is not None
    ):
        raise UsageError(
            f"{path}: train.early_stopping_patience and train.greater_is_better go with "
            'train.keep_best, the eval metric to compare (e.g. keep_best = "eval_loss")'
        )
    if t["early_stopping_patience"] is not None and t["eval_every"] is None:
        raise UsageError(
            f"{path}: train.early_stopping_patience counts evaluations: set train.eval_every"
        )
    for table, key in FLAGS:
        value = getattr(job, table)[key]
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {table}.{key} must be true or false, got {value!r}")
    optional = [
        ("data", "prompt_column"),
        ("data", "messages_column"),
        ("output", "dir"),
        ("train", "keep_best"),
    ]
    for table, key in TEXT + optional:
        value = getattr(job, table)[key]
        if not isinstance(value, str) and not (value is None and (table, key) in optional):
            raise UsageError(f"{path}: {table}.{key} must be a string, got {value!r}")
    fraction = job.data["eval_fraction"]
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1
    ):
        raise UsageError(
            f"{path}: data.eval_fraction must be a number in (0, 1), the share of the train "
            f"rows to evaluate on (e.g. 0.1), got {fraction!r}"
        )
    if job.data["messages_column"] is not None:
        if job.model.task != "causal-lm":
            raise UsageError(f'{path}: data.messages_column needs model.task = "causal-lm"')
        if job.data["prompt_column"] is not None:
            raise UsageError(
                f"{path}: data.messages_column and data.prompt_column are two formats; "
                "give one (a chat's prompt is its messages before the assistant's turn)"
            )


def _check_log(log: dict[str, Any], path: Path) -> None:
    """`[log]`: its flags and names, and that the package of each writer it turns on is
    installed (one line naming it, before the run starts)."""
    for key, writer in LOG_WRITERS.items():
        if not isinstance(log[key], bool):
            raise UsageError(f"{path}: log.{key} must be true or false, got {log[key]!r}")
        if log[key]:
            try:
                writer.require()
            except ImportError:
                raise UsageError(
                    f"{path}: [log] {key} = true needs the {writer.package} package: "
                    f"pip install {writer.package}"
                ) from None
    for key in ("project", "run_name"):
        value = log[key]
        if value is None and key == "run_name":
            continue  # output.dir's name
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"{path}: log.{key} must be a non-empty string, got {value!r}")


def _check_objective(job: "Job", path: Path) -> None:
    """`[train] objective` and the tables and columns it reads: `[dpo]` and `[orpo]` only
    with their objective, preference tuning only on a causal LM's prompt/chosen/rejected
    columns (not text or messages columns)."""
    objective, raw, d = job.train["objective"], job.raw, job.data
    if objective not in OBJECTIVES:
        raise UsageError(
            f"{path}: train.objective = {objective!r} is not one of {', '.join(OBJECTIVES)}"
        )
    for table in ("dpo", "orpo"):
        if table in raw and objective != table:
            raise UsageError(
                f'{path}: [{table}] sets up train.objective = "{table}", but the objective is '
                f'{objective!r}; set train.objective = "{table}" or remove [{table}]'
            )
    if d["truncation_mode"] not in TRUNCATION_MODES:
        raise UsageError(
            f"{path}: data.truncation_mode = {d['truncation_mode']!r} is not one of "
            f"{', '.join(TRUNCATION_MODES)}"
        )
    for key in ("chosen_column", "rejected_column"):
        if not isinstance(d[key], str):
            raise UsageError(f"{path}: data.{key} must be a string, got {d[key]!r}")
    _check_keep_best(job, path)
    if d["share_prompts"] not in (None, True, False):
        raise UsageError(
            f"{path}: data.share_prompts must be true or false, got {d['share_prompts']!r}"
        )
    if objective == "sft":
        if d["share_prompts"] is not None:
            raise UsageError(
                f"{path}: data.share_prompts runs a preference pair's prompt once for both "
                'completions; it applies to train.objective = "dpo" or "orpo"'
            )
        return
    if d["share_prompts"] is None:
        d["share_prompts"] = True
    if job.model.task != "causal-lm":
        raise UsageError(f'{path}: train.objective = "{objective}" needs model.task = "causal-lm"')
    if d["messages_column"] is not None or "text_column" in raw.get("data", {}):
        raise UsageError(
            f"{path}: preference tuning reads data.prompt_column, data.chosen_column and "
            "data.rejected_column (chats or text, TRL's preference format), not "
            "data.text_column or data.messages_column"
        )
    if d["pack"]:
        raise UsageError(f"{path}: data.pack packs single sequences; not with preference pairs")
    settings = job.dpo if objective == "dpo" else job.orpo
    beta = settings["beta"]
    if (
        isinstance(beta, bool)
        or not isinstance(beta, int | float)
        or not (math.isfinite(beta) and 0 < beta <= FLOAT32_MAX)
    ):
        raise UsageError(f"{path}: {objective}.beta must be a finite number > 0, got {beta!r}")
    settings["beta"] = float(beta)
    if objective == "orpo":
        return
    if job.dpo["loss_type"] not in DPO_LOSS_TYPES:
        raise UsageError(
            f"{path}: dpo.loss_type = {job.dpo['loss_type']!r} is not one of "
            f"{', '.join(DPO_LOSS_TYPES)}"
        )
    smoothing = job.dpo["label_smoothing"]
    if (
        isinstance(smoothing, bool)
        or not isinstance(smoothing, int | float)
        or not (0 <= smoothing < 0.5)
    ):
        raise UsageError(
            f"{path}: dpo.label_smoothing must be a number in [0, 0.5), got {smoothing!r}"
        )
    job.dpo["label_smoothing"] = float(smoothing)
    if not isinstance(job.dpo["precompute_ref_log_probs"], bool):
        raise UsageError(
            f"{path}: dpo.precompute_ref_log_probs must be true or false, got "
            f"{job.dpo['precompute_ref_log_probs']!r}"
        )


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")
# the eval metrics of each objective (and task), which `train.keep_best` may name
EVAL_METRICS = {
    "classification": ("loss", "accuracy"),
    "sft": ("loss", "perplexity"),
    "dpo": ("loss", *REWARDS, *LOGPS),
    "orpo": ("loss", *REWARDS, *LOGPS, "nll_loss", "log_odds_ratio", "log_odds_chosen"),
}


def _check_keep_best(job: "Job", path: Path) -> None:
    name = job.train["keep_best"]
    if name is None:
        return
    kind = "classification" if job.model.task == "classification" else job.train["objective"]
    known = EVAL_METRICS[kind]
    if name.removeprefix("eval_") not in known:
        raise UsageError(
            f"{path}: train.keep_best = {name!r} is not an eval metric of this job; choose "
            f"one of {', '.join('eval_' + m for m in known)}"
        )


@dataclasses.dataclass(frozen=True)
class Bank:
    """A job's `[bank]`: its `[[adapters]]` train as one `PeftBankModel` of
    `max_adapters` slots, each of rank up to `max_rank`."""

    max_adapters: int
    max_rank: int


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter a job trains: its name, config, and its own train and eval data (no
    eval: `[data] eval_fraction` of the train rows)."""

    name: str
    config: Any
    train: Source
    eval: Source | None
    # a config whose `total_step` the table left out takes the run's number of steps
    steps_from_run: bool = False

    def for_steps(self, total: int, where: str) -> "Adapter":
        """This adapter with `total_step` set to the run's `total` steps, if it takes it."""
        if not self.steps_from_run:
            return self
        try:
            config = dataclasses.replace(self.config, total_step=total)
        except ValueError as e:
            raise UsageError(f"{where}: {e} (total_step is the run's {total} steps)") from None
        return dataclasses.replace(self, config=config, steps_from_run=False)


class Job:
    """A fine-tune job's TOML, checked, with `--set` overrides applied: one adapter
    (`[lora]`/`[ia3]`, named "default", data in `[data]`), or several (`[[adapters]]`,
    `multi`) trained and evaluated in mixed batches, as one adapter bank with `[bank]`
    (`bank`)."""

    def __init__(self, path: Path, overrides: list[str]):
        self.path = path
        self._data_record: dict[str, Any] | None = None
        raw = read_toml(path)
        for item in overrides:
            _override(raw, item)
        self.raw = raw
        self.model: ModelSettings = job_model(raw, path)
        self.data = _settings(raw, "data", DATA_KEYS, path)
        self.train = _settings(raw, "train", TRAIN_KEYS, path)
        self.output = _settings(raw, "output", OUTPUT_KEYS, path)
        self.dpo = _settings(raw, "dpo", DPO_KEYS, path)
        self.orpo = _settings(raw, "orpo", ORPO_KEYS, path)
        self.log = _settings(raw, "log", LOG_KEYS, path)
        self.init = _settings(raw, "init", INIT_KEYS, path)
        if self.train["optimizer"] not in OPTIMIZERS:
            raise UsageError(f"{path}: train.optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.train["schedule"] not in SCHEDULES:
            raise UsageError(f"{path}: train.schedule must be one of {', '.join(SCHEDULES)}")
        _check_numbers(self, path)
        _check_objective(self, path)
        _check_log(self.log, path)
        self.mesh = mesh_settings(raw.get("mesh"), str(path))
        self.multi = "adapters" in raw
        self.adapters = self._several(raw, path) if self.multi else [self._single(raw, path)]
        self.bank = self._bank(raw, path)
        self.initializes = self._initializes(raw, path)
        # the file's output.dir is taken from its directory, the default from the current one
        out = self.output["dir"]
        out = path.parent / Path(out).expanduser() if out else Path("runs", path.stem)
        # a link is followed: the run is written beside its target and swapped in there
        self.out = followed(out)

    def _config(self, kind: str, table: Any, where: str) -> tuple[Any, bool]:
        """The config of an adapter table, and whether it takes the run's number of steps
        as its `total_step` (AdaLoRA's schedule, where the table leaves it out; checked
        here with the most steps a run may have, and again once the run's are known)."""
        if not isinstance(table, dict):
            raise UsageError(f"{where}: must be a table, got {table!r}")
        cls = TOML_TABLES[kind]
        from_run = "total_step" in {f.name for f in dataclasses.fields(cls)} and (
            table.get("total_step") is None
        )
        given = {**table, "total_step": MAX_COUNT} if from_run else table
        try:
            config = cls.from_dict({"task_type": TASK_TYPES[self.model.task], **given}, strict=True)
            config.check_trainable()
        except (ValueError, TypeError) as e:
            raise UsageError(f"{where}: {e}") from None
        return config, from_run

    def _initializes(self, raw: dict[str, Any], path: Path) -> bool:
        """Whether the run starts with `peftx.initialize_lora` (an adapter whose init reads
        data); `[init]` is checked, and refused without such an adapter."""
        data_driven = [
            a.name
            for a in self.adapters
            if getattr(a.config, "init_lora_weights", None) in DATA_INITS
        ]
        if "init" in raw and not data_driven:
            raise UsageError(
                f"{path}: [init] sets the batches of a data-driven LoRA init; give the adapter "
                f"table init_lora_weights = one of {list(DATA_INITS)}, or drop [init]"
            )
        if data_driven and (self.multi or self.bank is not None):
            raise UsageError(
                f"{path}: init_lora_weights {list(DATA_INITS)} initializes a job of one adapter "
                "(a [lora] table), not [[adapters]] or a [bank]"
            )
        gradient_init = any(
            getattr(a.config, "init_lora_weights", None) == "lora_ga" for a in self.adapters
        )
        if gradient_init and self.train["objective"] != "sft":
            raise UsageError(
                f"{path}: init_lora_weights 'lora_ga' takes the gradient of the supervised "
                f"loss; train.objective {self.train['objective']!r} has preference pairs "
                "(eva and corda read them)"
            )
        init = self.init
        for key in ("batches", "batch_size"):
            value = init[key]
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_COUNT):
                raise UsageError(f"{path}: init.{key} must be a positive integer, got {value!r}")
        if init["split"] not in INIT_SPLITS:
            raise UsageError(
                f"{path}: init.split must be one of {', '.join(INIT_SPLITS)}, got {init['split']!r}"
            )
        return bool(data_driven)

    def init_batches(self, train: dict[str, Any], eval: dict[str, Any]) -> list[dict[str, Any]]:
        """The batches `[init]` names: the first `batches` of its split's rows, of
        `batch_size` rows each (the last may be shorter)."""
        rows = train if self.init["split"] == "train" else eval
        size = self.init["batch_size"] or self.train["batch_size"]
        total = len(next(iter(rows.values())))
        starts = range(0, min(total, self.init["batches"] * size), size)
        return [{k: v[i : i + size] for k, v in rows.items()} for i in starts]

    def _single(self, raw: dict[str, Any], path: Path) -> Adapter:
        tables = [t for t in TOML_TABLES if t in raw]
        if len(tables) != 1:
            raise UsageError(
                f"{path}: a job needs exactly one adapter table, {table_names()} (or "
                "[[adapters]] entries)"
            )
        if self.data["train"] is None:
            raise UsageError(f"{path}: [data] needs 'train': {SOURCES}")
        if self.data["eval"] is not None and self.data["eval_fraction"] is not None:
            raise UsageError(
                f"{path}: data.eval and data.eval_fraction both give the eval rows: give one, "
                "the eval data or the share of the train rows to evaluate on"
            )
        config, from_run = self._config(tables[0], raw[tables[0]], f"{path}: [{tables[0]}]")
        return Adapter(
            "default",
            config,
            data_source(self.data["train"], "data.train", path),
            self._eval(self.data["eval"], "data.eval", path),
            from_run,
        )

    def _eval(self, value: Any, name: str, path: Path) -> Source | None:
        """The eval data `name` gives, or None for `[data] eval_fraction` of the train
        rows; one of the two is needed."""
        if value is None and self.data["eval_fraction"] is None:
            raise UsageError(
                f"{path}: {name} or data.eval_fraction is needed: the eval data "
                f"({SOURCES}), or the share of the train rows to evaluate on (e.g. 0.1)"
            )
        return None if value is None else data_source(value, name, path)

    def _several(self, raw: dict[str, Any], path: Path) -> list[Adapter]:
        entries = raw["adapters"]
        given = [t for t in TOML_TABLES if t in raw]
        if given:
            raise UsageError(
                f"{path}: [{given[0]}] and [[adapters]] are both given; a job has one adapter "
                "table, or [[adapters]] entries each with its own "
                f"{table_names('adapters.')}"
            )
        if (
            not isinstance(entries, list)
            or not entries
            or not all(isinstance(e, dict) for e in entries)
        ):
            raise UsageError(f"{path}: 'adapters' must be one or more tables, [[adapters]]")
        for key in ("train", "eval"):
            if self.data[key] is not None:
                raise UsageError(
                    f"{path}: data.{key} is set per adapter in a job with [[adapters]]; move it "
                    "into each [[adapters]] entry"
                )
        if self.output["merged"]:
            raise UsageError(f"{path}: output.merged merges one adapter; not with [[adapters]]")
        adapters: list[Adapter] = []
        for n, entry in enumerate(entries, 1):
            where = f"{path}: [[adapters]][{n}]"
            keys = ("name", "train", "eval", *adapter_tables())
            for key in entry:
                if key not in keys:
                    raise unknown_key(f"[[adapters]][{n}] of {path}", key, keys)
            for key in ("name", "train"):
                if key not in entry:
                    raise UsageError(f"{where}: missing {key!r}")
            if not isinstance(entry["name"], str):
                raise UsageError(f"{where}: name must be a string, got {entry['name']!r}")
            name = entry["name"]
            if not ADAPTER_NAME.fullmatch(name) or name == BASE:
                raise UsageError(
                    f"{where}: name {name!r} is not an adapter name: letters, digits, '_', '.' "
                    f"and '-', not starting with '.' or '-', and not {BASE!r} (the base model)"
                )
            taken = [a.name for a in adapters]
            if name in taken:
                raise UsageError(
                    f"{where}: name {name!r} is taken by [[adapters]][{taken.index(name) + 1}]"
                )
            kinds = [t for t in TOML_TABLES if t in entry]
            if len(kinds) != 1:
                raise UsageError(
                    f"{where}: needs exactly one of {table_names('adapters.')}, got {len(kinds)}"
                )
            if not TOML_TABLES[kinds[0]].mixed_batches:
                together = [f"[adapters.{t}]" for t, c in TOML_TABLES.items() if c.mixed_batches]
                raise UsageError(
                    f"{where}: [adapters.{kinds[0]}] cannot be trained in [[adapters]], which "
                    f"mixes its adapters in each batch, as PEFT does not for {kinds[0]} "
                    f"adapters; [[adapters]] trains {', '.join(together)} together; train a "
                    f"{kinds[0]} adapter alone, in a job with a [{kinds[0]}] table"
                )
            first = [t for t in TOML_TABLES if t in entries[0]][0]
            if kinds[0] != first:
                raise UsageError(
                    f"{where}: [adapters.{kinds[0]}] cannot join [adapters.{first}] in one model "
                    "(as in PEFT); give every entry the same kind"
                )
            config, from_run = self._config(
                kinds[0], entry[kinds[0]], f"{where}: [adapters.{kinds[0]}]"
            )
            at = f"[[adapters]][{n}]"
            train = data_source(entry["train"], f"{at}.train", path)
            evaluate = self._eval(entry.get("eval"), f"{at}.eval", path)
            adapters.append(Adapter(name, config, train, evaluate, from_run))
        share = self.train["batch_size"] / len(adapters)
        if share != int(share):
            raise UsageError(
                f"{path}: train.batch_size ({self.train['batch_size']}) must be a multiple of "
                f"the number of [[adapters]] ({len(adapters)}), so each batch mixes them evenly"
            )
        return adapters

    def _bank(self, raw: dict[str, Any], path: Path) -> Bank | None:
        """The `[bank]` table, checked against the `[[adapters]]` it is to hold (what a
        bank cannot hold is `check_bank_config`'s to say), or None without one."""
        if "bank" not in raw:
            return None
        table = raw["bank"]
        if not isinstance(table, dict):
            raise UsageError(f"{path}: 'bank' must be a table ([bank]), got {table!r}")
        if not self.multi:
            raise UsageError(
                f"{path}: [bank] trains the job's [[adapters]] entries as one bank; this job "
                "has none (give each adapter an [[adapters]] entry, with its own data)"
            )
        for key in table:
            if key not in BANK_KEYS:
                raise unknown_key(f"[bank] of {path}", key, BANK_KEYS)
        if self.model.task != "causal-lm":
            raise UsageError(
                f'{path}: [bank] needs model.task = "causal-lm": a classifier\'s head is a '
                "copy per adapter (modules_to_save), which a bank does not hold; train "
                "classifiers in [[adapters]] without [bank]"
            )
        count = len(self.adapters)
        if "max_adapters" not in table:
            raise UsageError(
                f"{path}: [bank] needs max_adapters, its number of slots (at least the "
                f"{count} [[adapters]])"
            )
        for key, value in table.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{path}: bank.{key} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:
                raise UsageError(f"{path}: bank.{key} must be at most {MAX_COUNT}, got {value}")
        if table["max_adapters"] < count:
            raise UsageError(
                f"{path}: bank.max_adapters ({table['max_adapters']}) is less than the "
                f"{count} [[adapters]]: the bank needs a slot for each"
            )
        for n, adapter in enumerate(self.adapters, 1):
            try:  # without max_rank, the largest r is the bank's: no rank is refused
                check_bank_config(adapter.config, table.get("max_rank", MAX_COUNT))
            except (TypeError, ValueError) as e:
                raise UsageError(
                    f"{path}: [[adapters]][{n}] ({adapter.name!r}) cannot go in the [bank]: {e}"
                ) from None
        ranks = (r for a in self.adapters for r in (a.config.r, *a.config.rank_pattern.values()))
        return Bank(table["max_adapters"], table.get("max_rank", max(ranks)))

    def loss_settings(self) -> dict[str, Any]:
        """The keywords of the objective's loss (`dpo_loss`, `orpo_loss`): its table."""
        objective = self.train["objective"]
        if objective == "dpo":
            return {k: v for k, v in self.dpo.items() if k != "precompute_ref_log_probs"}
        return dict(self.orpo) if objective == "orpo" else {}

    def best_settings(self) -> dict[str, Any]:
        """The `[train]` settings of `fit`'s best checkpoint and early stopping."""
        keys = ("keep_best", "greater_is_better", "early_stopping_patience")
        return {key: self.train[key] for key in keys}

    def optimizer_settings(self) -> dict[str, Any]:
        """The `[train]` settings of `peftx.train.make_optimizer` (and `fit`)."""
        return {key: self.train[key] for key in OPTIMIZER_KEYS}

    def sources(self) -> list[Source]:
        """The job's data sources, each once."""
        given = (s for a in self.adapters for s in (a.train, a.eval) if s is not None)
        return list(dict.fromkeys(given))

    def resolved(self) -> dict[str, Any]:
        """The job as it runs, with its data's sizes and hashes, for `job.json` (a resumed
        run must be the same job on the same data)."""
        plain = json.loads(json.dumps(self.raw, default=str))
        plain["model"] = {k: str(v) for k, v in vars(self.model).items()}
        if self._data_record is None:  # hashed once a run
            self._data_record = data_record(self.sources())
        return {**plain, DATA_FILES: self._data_record}
