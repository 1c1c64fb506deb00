"""Writers that mirror `metrics.jsonl` where users look: TensorBoard event files, Weights &
Biases and MLflow. `fit` gives each writer every record as it writes it, and closes it at
the end."""

import abc
import contextlib
import functools
import importlib
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Protocol, runtime_checkable

Record = dict[str, Any]
# the keys of a record that say what it is, not what was measured
LABELS = ("step", "split", "adapter", "data")
# what MLflow takes in a metric name (on every OS): anything else becomes "_"
_MLFLOW_REFUSED = re.compile(r"[^A-Za-z0-9_\-. /]")


@runtime_checkable
class MetricWriter(Protocol):
    """What `fit(writers=...)` takes: `write` gets the records of `metrics.jsonl` as `fit`
    writes them (one list per log step or evaluation, each record a dict with `step` and
    `split`; `scalars` names their numbers), and `close` is called once when `fit` ends,
    `failed` if it raised."""

    def write(self, records: Sequence[Record]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def scalars(record: Record) -> dict[str, float]:
    """The numbers of a `metrics.jsonl` record, by the names the writers log them under:
    the split, with several adapters the adapter and the data it was evaluated on, then
    the key (`train/loss`, `train/rewards/margins`, `eval/accuracy`,
    `eval/stories/stories/loss`, `eval/__base__/stories/loss`). A null (a value that was
    not finite) is left out."""
    prefix = record["split"]
    if "adapter" in record:
        prefix = f"{prefix}/{record['adapter']}/{record['data']}"
    return {
        f"{prefix}/{key}": float(value)
        for key, value in record.items()
        if key not in LABELS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def mlflow_name(name: str) -> str:
    """`name` as MLflow takes a metric name: every character other than a letter, digit,
    `_`, `-`, `.`, `/` or space becomes `_`, and so does a part between slashes that is
    empty, `.` or `..` (MLflow refuses names that a file path would change)."""
    parts = _MLFLOW_REFUSED.sub("_", name).split("/")
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)


@contextlib.contextmanager
def closing_writers(writers: Sequence[MetricWriter]) -> Iterator[None]:
    """Close every writer when the block ends (each one, even if another's `close`
    raises), with `failed=True` if the block raised."""
    with contextlib.ExitStack() as stack:
        for writer in writers:
            stack.push(functools.partial(_close, writer))
        yield


def _close(writer: MetricWriter, kind: Any, error: Any, traceback: Any) -> None:
    writer.close(failed=kind is not None)


class _AbstractServiceWriter(abc.ABC):
    """A writer through a package that may not be installed (`package`, what `pip install`
    takes). It opens its run on the first records it gets, so that of several processes
    only the one that writes (`fit`'s process 0) opens one, and logs each step's numbers
    together."""

    package: ClassVar[str]

    @classmethod
    def require(cls) -> ModuleType:
        """The package, imported; an `ImportError` naming what to install without it."""
        try:
            return importlib.import_module(cls.package)
        except ImportError:
            raise ImportError(
                f"{cls.__name__} needs the {cls.package} package: pip install {cls.package}"
            ) from None

    def __init__(self) -> None:
        self._module = self.require()
        self._opened = False

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        if not self._opened:
            self._open(int(records[0]["step"]))
            self._opened = True
        steps: dict[int, dict[str, float]] = {}
        for record in records:
            steps.setdefault(int(record["step"]), {}).update(scalars(record))
        self._log(steps)

    def close(self, failed: bool = False) -> None:
        if self._opened:
            self._opened = False
            self._close(failed)

    @abc.abstractmethod
    def _open(self, step: int) -> None:
        """Start the run, whose first record is at `step`."""

    @abc.abstractmethod
    def _log(self, steps: dict[int, dict[str, float]]) -> None:
        """Log each step's numbers, by their `scalars` names."""

    @abc.abstractmethod
    def _close(self, failed: bool) -> None:
        """End the run."""


class TensorBoardWriter(_AbstractServiceWriter):
    """TensorBoard event files in `logdir` (`tensorboard --logdir`), written with the
    `tensorboard` package alone (no TensorFlow): a scalar per `scalars` name and step.

    Event files are only appended to. Each run starts a new file with a restart marker at
    its first step (TensorFlow's `SessionLog.START`), so that TensorBoard drops the points
    an earlier run in `logdir` logged from that step on: a resumed `fit` starts over from
    the records it kept (step 0), and TensorBoard shows those and the new ones, not what
    the killed run logged after its checkpoint."""

    package = "tensorboard"

    def __init__(self, logdir: str | os.PathLike):
        super().__init__()
        self.logdir = Path(logdir)

    def _open(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._events = EventFileWriter(str(self.logdir))
        restart = SessionLog(status=SessionLog.START)
        self._events.add_event(Event(wall_time=time.time(), step=step, session_log=restart))

    def _log(self, steps: dict[int, dict[str, float]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for step, values in steps.items():
            summary = Summary(
                value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
            )
            self._events.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._events.flush()  # TensorBoard shows a run as it goes

    def _close(self, failed: bool) -> None:
        self._events.close()


class WandbWriter(_AbstractServiceWriter):
    """A Weights & Biases run: `wandb.init(project=, name=, dir=, config=)` in `dir` (its
    files go in `dir/wandb/`), then `run.log(scalars, step=step)`; `close` finishes it
    (`exit_code=1` when `fit` failed). Online or offline as W&B's settings say
    (`WANDB_MODE=offline`, `wandb login`). Every `fit` is a new W&B run: a resumed one
    starts with the records kept from before, so it holds the whole curve."""

    package = "wandb"

    def __init__(
        self,
        dir: str | os.PathLike,
        *,
        project: str = "peftx",
        name: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.dir, self.project, self.name, self.config = Path(dir), project, name, config

    def _open(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)  # else W&B writes to a temporary one
        self._run = self._module.init(
            project=self.project,
            name=self.name,
            dir=str(self.dir),
            config=self.config,
            reinit="create_new",  # a W&B run of the caller's own stays open
        )

    def _log(self, steps: dict[int, dict[str, float]]) -> None:
        for step, values in steps.items():
            self._run.log(values, step=step)

    def _close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class MLflowWriter(_AbstractServiceWriter):
    """An MLflow run in `experiment` (made if missing), named `run_name`, on
    `tracking_uri` (default: `MLFLOW_TRACKING_URI`, else MLflow's default), each step's
    numbers logged in one batch under their `scalars` names made valid for MLflow
    (`mlflow_name`); `close` ends the run `FINISHED`, or `FAILED` when `fit` failed. Every
    `fit` is a new MLflow run: a resumed one starts with the records kept from before, so
    it holds the whole curve. Uses `MlflowClient`, not the active run of `mlflow.start_run`,
    so that a run of the caller's own is left alone."""

    package = "mlflow"

    def __init__(
        self,
        *,
        experiment: str = "peftx",
        run_name: str | None = None,
        tracking_uri: str | None = None,
    ):
        super().__init__()
        self.experiment, self.run_name, self.tracking_uri = experiment, run_name, tracking_uri

    def _open(self, step: int) -> None:
        self._client = self._module.MlflowClient(self.tracking_uri)
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id if found else self._client.create_experiment(self.experiment)
        )
        run = self._client.create_run(experiment_id, run_name=self.run_name)
        self._run_id = run.info.run_id

    def _log(self, steps: dict[int, dict[str, float]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(mlflow_name(k), v, now, step)
            for step, values in steps.items()
            for k, v in values.items()
        ]
        self._client.log_batch(self._run_id, metrics=metrics)

    def _close(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")
