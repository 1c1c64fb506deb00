"""`peftx.train`'s metric writers and a job's `[log]` table: TensorBoard's event files (read
by TensorBoard's own `EventAccumulator`), a W&B offline run (its `.wandb` log read record by
record with W&B's protobufs) and an MLflow run (read with `MlflowClient`) hold the numbers
of `metrics.jsonl`, step for step, after a resumed `fit` too; a writer whose package is
missing is one line naming it."""

import contextlib
import io
import json
import struct
import sys
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FILLER, WORDS, run_cli, word_tokenizer

import peftx
from peftx import train
from peftx.cli._common import UsageError
from peftx.cli._run_dir import DATA_FILES, JOB, MARKER, plan_output

PACKAGES = {
    train.TensorBoardWriter: "tensorboard",
    train.WandbWriter: "wandb",
    train.MLflowWriter: "mlflow",
}


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its settings and caches in the test's directory; MLflow on a
    file store there."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3's file store is opt-in
    }.items():
        monkeypatch.setenv(name, value)


# -- what each writer's files hold, as {name: [(step, value), ...]} -------------------------

Series = dict[str, list[tuple[int, float]]]


def _expected(records: list[dict], name=lambda n: n, value=float) -> Series:
    series: Series = {}
    for record in records:
        for key, v in train.scalars(record).items():
            series.setdefault(name(key), []).append((record["step"], value(v)))
    return series


def _tensorboard(logdir: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}


WANDB_BLOCK = 32768  # the LevelDB log format's block


def _wandb_records(path: Path):
    """The records of a W&B run's transaction log (`run-ID.wandb`) written so far: after
    W&B's 7-byte header, LevelDB's log format (32 KiB blocks of chunks, each with its CRC-32,
    length and kind: 1 whole, 2 first, 3 middle, 4 last), each record one of W&B's
    protobufs."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7 or kind == 0:  # a block's padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            return  # not written yet
        assert zlib.crc32(bytes([kind]) + chunk) == crc
        pos, chunks = pos + 7 + length, chunks + chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def _wandb_run(path: Path) -> tuple[int, Series, int | None]:
    """A W&B run's start time, history and exit code (None before its end is written)."""
    series: Series = {}
    start = exit_code = None
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            start = record.run.start_time.ToNanoseconds()
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own: _step, _runtime, ...
                    series.setdefault(key, []).append((step, json.loads(item.value_json)))
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return start, series, exit_code


def _wandb_runs(directory: Path, count: int) -> list[tuple[Series, int]]:
    """The `count` W&B runs in `directory/wandb`, oldest first: each one's history and exit
    code, once W&B has written their ends (its core writes the log after `finish`
    returns)."""
    deadline = time.monotonic() + 60
    while True:
        logs = (directory / "wandb").glob("offline-run-*/run-*.wandb")
        runs = [_wandb_run(path) for path in logs]
        if len(runs) == count and all(exit_code is not None for *_, exit_code in runs):
            return [
                (series, exit_code) for _, series, exit_code in sorted(runs, key=lambda run: run[0])
            ]
        assert time.monotonic() < deadline, f"{len(runs)} W&B runs, not {count} finished"
        time.sleep(0.05)


def _mlflow_runs(experiment: str = "peftx") -> list[tuple[Series, str, str]]:
    """Each MLflow run of `experiment`, oldest first: its metrics, status and name."""
    import mlflow

    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])
    out = []
    for run in runs:
        series = {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        out.append((series, run.info.status, run.info.run_name))
    return out


def _sorted(series: Series) -> Series:
    return {k: sorted(v) for k, v in sorted(series.items())}


def _float32(v: float) -> float:
    return float(np.float32(v))


# -- names -----------------------------------------------------------------------------------


def test_scalars_name_a_records_numbers_by_split_adapter_and_data():
    trained = {"step": 4, "split": "train", "loss": 1.5, "grad_norm": 2, "rewards/margins": 0.25}
    assert train.scalars(trained) == {
        "train/loss": 1.5,
        "train/grad_norm": 2.0,
        "train/rewards/margins": 0.25,
    }
    assert train.scalars({"step": 0, "split": "eval", "loss": 0.5, "accuracy": 0.75}) == {
        "eval/loss": 0.5,
        "eval/accuracy": 0.75,
    }
    several = {"step": 2, "split": "eval", "adapter": "__base__", "data": "stories", "loss": 3.0}
    assert train.scalars(several) == {"eval/__base__/stories/loss": 3.0}
    # a null (not finite in training) and anything not a number are left out
    assert train.scalars({"step": 1, "split": "eval", "loss": None, "flag": True}) == {}


@pytest.mark.parametrize(
    "name, valid",
    [
        ("eval/__base__/stories-v1.2/loss", "eval/__base__/stories-v1.2/loss"),
        ("eval/a b/c/loss", "eval/a b/c/loss"),
        ("eval/x:y/ü@z/loss", "eval/x_y/__z/loss"),
        ("eval/../c/loss", "eval/_/c/loss"),
        ("eval/./c//loss", "eval/_/c/_/loss"),
    ],
)
def test_mlflow_name_keeps_what_mlflow_takes(name, valid):
    from mlflow.utils.validation import _validate_metric_name

    assert train.mlflow_name(name) == valid
    _validate_metric_name(valid)  # raises for a name MLflow refuses


# -- each writer, on records written by hand --------------------------------------------------

RECORDS = [
    [
        {"step": 0, "split": "eval", "adapter": "a:1", "data": "a:1", "loss": 2.0,
         "perplexity": 7.4},
        {"step": 0, "split": "eval", "adapter": "__base__", "data": "a:1", "loss": 2.5,
         "perplexity": None},
    ],
    [{"step": 2, "split": "train", "loss": 1.5, "learning_rate": 1e-3, "grad_norm": 0.3,
      "examples_per_s": 812.5, "rewards/margins": 0.1, "rewards/accuracies": 0.75}],
    [
        {"step": 2, "split": "eval", "adapter": "a:1", "data": "a:1", "loss": 1.25,
         "perplexity": 3.49, "rewards/margins": -0.5},
    ],
]  # fmt: skip
FLAT = [r for records in RECORDS for r in records]


@pytest.mark.parametrize("failed", [False, True])
def test_each_writer_holds_the_records_step_for_step(tmp_path, failed):
    """Records at one step in two writes (train, then eval) land at that step; a null is
    left out; an MLflow name is made valid; a failed run says so."""
    writers = [
        train.TensorBoardWriter(tmp_path / "tb"),
        train.WandbWriter(tmp_path, name="by-hand", config={"lr": 1e-3}),
        train.MLflowWriter(run_name="by-hand"),
    ]
    for writer in writers:
        for records in RECORDS:
            writer.write(records)
        writer.close(failed=failed)
        writer.close(failed=failed)  # a second close does nothing
    assert _sorted(_tensorboard(tmp_path / "tb")) == _sorted(_expected(FLAT, value=_float32))
    [(history, exit_code)] = _wandb_runs(tmp_path, 1)
    assert _sorted(history) == _sorted(_expected(FLAT)) and exit_code == int(failed)
    [(metrics, status, name)] = _mlflow_runs()
    assert _sorted(metrics) == _sorted(_expected(FLAT, name=train.mlflow_name))
    assert "eval/a_1/a_1/loss" in metrics and (status, name) == (
        "FAILED" if failed else "FINISHED",
        "by-hand",
    )


def test_a_writer_that_gets_no_record_opens_nothing(tmp_path):
    """A writer opens its run on its first records (`fit`'s process 0 only): one that gets
    none writes no file and starts no run."""
    writers = [
        train.TensorBoardWriter(tmp_path / "tb"),
        train.WandbWriter(tmp_path / "wb"),
        train.MLflowWriter(),
    ]
    for writer in writers:
        writer.write([])
        writer.close()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "wb").exists()
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("writer, package", PACKAGES.items(), ids=PACKAGES.values())
def test_a_writer_without_its_package_names_it(writer, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    args = (Path("unused"),) if writer is not train.MLflowWriter else ()
    with pytest.raises(ImportError, match=rf"^{writer.__name__} needs the {package} package: "):
        writer(*args)
    with pytest.raises(ImportError, match=rf"pip install {package}$"):
        writer.require()


# -- fit -------------------------------------------------------------------------------------

LLAMA = peftx.models.LlamaConfig(
    vocab_size=len(WORDS),
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=32,
    pad_token_id=0,
)


class _Recording:
    """A `MetricWriter` that keeps what it is given."""

    def __init__(self):
        self.records, self.closed = [], []

    def write(self, records):
        self.records.append(list(records))

    def close(self, failed=False):
        self.closed.append(failed)


def _two_adapters():
    """A tiny random Llama with LoRA adapters "a" and "b", and each one's data."""
    tokenizer = word_tokenizer(WORDS)
    rng = np.random.default_rng(0)
    data = []
    for n in (8, 12):
        texts = [" ".join(rng.choice(FILLER, 6)) for _ in range(n)]
        data.append(train.encode_causal_lm(tokenizer, texts, max_length=10))
    base = peftx.models.LlamaForCausalLM(LLAMA, key=jax.random.key(0))
    config = peftx.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peftx.get_peft_model(base, config, key=jax.random.key(1), adapter_name="a")
    return model.add_adapter("b", config, key=jax.random.key(2)), data


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.variant_sweep  # several adapters and a resume; each writer alone above
def test_fit_mirrors_metrics_jsonl_to_every_writer_and_a_resumed_run_too(tmp_path):
    """Several adapters' `fit` (4 steps, a checkpoint at 2) with all three writers: each
    holds `metrics.jsonl`'s numbers, eval records under `eval/<adapter>/<data>/`. Resumed
    from step 2, `fit` starts a new W&B and MLflow run with the records kept and the new
    ones, and TensorBoard shows exactly the new `metrics.jsonl`: not the points the first
    run logged after its checkpoint (their `examples_per_s` differ)."""
    model, data = _two_adapters()
    out = tmp_path / "run"
    settings = dict(
        steps=4, batch_size=4, adapters=["a", "b"], learning_rate=1e-2, log_every=1,
        eval_every=2, checkpoint_every=2, out=out, key=jax.random.key(3),
    )  # fmt: skip

    def writers():
        return [
            train.TensorBoardWriter(out / "tensorboard"),
            train.WandbWriter(out, name="two"),
            train.MLflowWriter(run_name="two"),
            _Recording(),
        ]

    first = writers()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train.fit(model, data, data, **settings, writers=first)
    records = _records(out)
    assert {"eval/__base__/b/loss", "eval/a/a/perplexity", "train/grad_norm"} <= set(
        _expected(records)
    )
    assert [r for rs in first[-1].records for r in rs] == records and first[-1].closed == [False]
    assert _tensorboard(out / "tensorboard") == _expected(records, value=_float32)
    [(history, _)] = _wandb_runs(out, 1)
    assert _sorted(history) == _sorted(_expected(records))
    [(metrics, status, _)] = _mlflow_runs()
    assert _sorted(metrics) == _sorted(_expected(records)) and status == "FINISHED"

    again = writers()
    with contextlib.redirect_stdout(io.StringIO()) as said:
        with contextlib.redirect_stderr(io.StringIO()):
            train.fit(model, data, data, **settings, writers=again, resume=True)
    assert "(step 2 of 4)" in said.getvalue()
    resumed = _records(out)
    assert [r["step"] for r in resumed] == [r["step"] for r in records]
    assert resumed != records  # the steps after the checkpoint ran again: new timings
    assert [r for rs in again[-1].records for r in rs] == resumed
    assert _tensorboard(out / "tensorboard") == _expected(resumed, value=_float32)
    assert _sorted(_wandb_runs(out, 2)[1][0]) == _sorted(_expected(resumed))
    assert _sorted(_mlflow_runs()[1][0]) == _sorted(_expected(resumed))


def test_fit_closes_its_writers_when_it_fails():
    writer = _Recording()
    model, data = _two_adapters()
    with pytest.raises(ValueError, match="need a train and an eval dataset each"):
        train.fit(model, data, data[:1], adapters=["a", "b"], steps=1, batch_size=2,
                  writers=[writer], key=jax.random.key(0))  # fmt: skip
    assert writer.records == [] and writer.closed == [True]


# -- the job's [log] table -------------------------------------------------------------------

JOB_TOML = """
[data]
train = "train.jsonl"
eval = "eval.jsonl"

[lora]
r = 4
target_modules = ["query", "value"]

[log]
{log}
"""


def _error(capsys, tmp_path, log: str) -> str:
    job = tmp_path / "job.toml"
    job.write_text(JOB_TOML.format(log=log))
    code, out, err = run_cli(capsys, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and err.count("\n") == 1 and err.startswith("peftx: error: "), err
    assert not (tmp_path / "run").exists()
    return err.removeprefix("peftx: error: ").rstrip("\n").removeprefix(f"{job}: ")


@pytest.mark.parametrize("key, package", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                          ("mlflow", "mlflow")])  # fmt: skip
def test_a_log_writer_without_its_package_is_one_line(key, package, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    assert _error(capsys, tmp_path, f"{key} = true") == (
        f"[log] {key} = true needs the {package} package: pip install {package}"
    )


@pytest.mark.parametrize(
    "log, message",
    [
        ('tensorboard = "yes"', "log.tensorboard must be true or false, got 'yes'"),
        ('project = ""', "log.project must be a non-empty string, got ''"),
        ("run_name = 3", "log.run_name must be a non-empty string, got 3"),
        ("tensorbord = true", "unknown key 'tensorbord' in [log] of "),
    ],
)
def test_log_table_errors(log, message, tmp_path, capsys):
    got = _error(capsys, tmp_path, log)
    assert got.startswith(message), got
    if "unknown key" in message:
        assert "(did you mean 'tensorboard'?)" in got


def test_a_run_resumes_with_other_log_settings(tmp_path):
    """`[log]` says where a run reports, not what it computes: a killed run goes on with
    other `[log]` keys, but not with another `[train]`."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    job = {"train": {"steps": 8}, DATA_FILES: {}}
    (out / MARKER).write_text("{}")
    (out / JOB).write_text(json.dumps(job))
    logged = {**job, "log": {"tensorboard": True, "project": "mine"}}
    assert plan_output(out, logged, overwrite=False, protected=[]) == "resume"
    other = {**logged, "train": {"steps": 9}}
    with pytest.raises(UsageError, match="holds checkpoints of a different job"):
        plan_output(out, other, overwrite=False, protected=[])


@pytest.mark.command_run
def test_finetune_job_logs_to_tensorboard(bert, tmp_path, capsys):
    """`peftx finetune` with `[log] tensorboard = true`: the run's `tensorboard/` holds the
    numbers of its `metrics.jsonl`, step for step."""
    out = tmp_path / "run"
    sets = ["log.tensorboard=true", "train.steps=10", f"output.dir={out}"]
    args = [arg for s in sets for arg in ("--set", s)]
    code, said, err = run_cli(capsys, "finetune", bert / "job.toml", *args)
    assert code == 0, err
    assert f"tensorboard: {out / 'tensorboard'}" in said
    records = _records(out)
    assert {"train/loss", "train/learning_rate", "eval/accuracy"} <= set(_expected(records))
    assert _tensorboard(out / "tensorboard") == _expected(records, value=_float32)
