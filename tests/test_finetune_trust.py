"""`peftx finetune` never loses what is the user's and never writes a broken adapter with
exit 0: the repros of the fault campaign (issue 22), each with the user's files checked
byte for byte, on the tiny BERT job of `conftest.py`."""

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from helpers import as_users_run, example_count, run_cli, write_jsonl
from hypothesis import HealthCheck, given, settings, strategies as st

import peftx.cli._finetune as finetune
from peftx import train
from peftx.cli import _job
from peftx.cli._common import RunFailed, UsageError
from peftx.cli._run_dir import LOCK, MARKER, Lock
from peftx.train import _fit

STEPS = ("--set", "train.steps=6", "--set", "train.eval_every=3")


def _tree(directory: Path) -> dict[str, str]:
    """Every file under `directory` (hidden ones too) by relative path, as a hash."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _user_files(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    (root / "src" / "train.py").write_text("print('my code')\n")
    (root / "job.json").write_text('{"mine": true}\n')  # a user's own job file
    (root / "notes.txt").write_bytes(b"\x00\xffbinary notes")


def _fails(capsys, code, *argv):
    got, out, err = run_cli(capsys, *argv)
    assert got == code, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("peftx: error: ")]
    assert len(lines) == 1, err
    return lines[0], out


def _runs(capsys, *argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, (out, err)
    return out


# -- data loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_dir_with_user_files_is_never_touched(
    bert, tmp_path, capsys, monkeypatch, overwrite
):
    """The repro: `--set output.dir=. --set data.train=/nonexistent.jsonl --overwrite`
    emptied the current directory."""
    home = tmp_path / "project"
    _user_files(home)
    before = _tree(home)
    monkeypatch.chdir(home)
    extra = ["--overwrite"] if overwrite else []
    job = bert / "job.toml"
    err, _ = _fails(capsys, 2, "finetune", job, "--set", "output.dir=.",
                    "--set", "data.train=/nonexistent.jsonl", *extra)  # fmt: skip
    assert f"output.dir '{home}' is not empty and is not a peftx run directory" in err
    # a valid job too: the directory is not peftx's
    err, _ = _fails(capsys, 2, "finetune", job, "--set", "output.dir=.", *STEPS, *extra)
    assert "is not empty and is not a peftx run directory" in err
    assert _tree(home) == before
    # into a new directory, the missing data is found before the directory is made
    err, _ = _fails(capsys, 1, "finetune", job, "--set", "output.dir=new",
                    "--set", "data.train=/nonexistent.jsonl", *extra)  # fmt: skip
    assert "'/nonexistent.jsonl' does not exist" in err
    assert _tree(home) == before and not (home / "new").exists()


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("base", "is the model directory"),
        (".", "contains the model directory"),
        ("data", "contains the data file"),
    ],
)
def test_output_dir_may_not_hold_the_model_or_the_data(bert, tmp_path, capsys, where, says):
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    for name in ("job.toml", "train.jsonl", "eval.jsonl"):
        (root / name).write_bytes((bert / name).read_bytes())
    (root / "data" / "eval.jsonl").write_bytes((bert / "eval.jsonl").read_bytes())
    shutil.copytree(bert / "base", root / "base")
    before = _tree(root)
    out = (root / where).resolve()
    err, _ = _fails(capsys, 2, "finetune", root / "job.toml", "--set", f"output.dir={out}",
                    "--set", f"data.eval={root / 'data' / 'eval.jsonl'}", *STEPS,
                    "--overwrite")  # fmt: skip
    assert says in err
    assert _tree(root) == before


@pytest.mark.command_run
def test_a_failed_replacement_keeps_the_finished_run(bert, tmp_path, capsys):
    job, out = bert / "job.toml", tmp_path / "run"
    _runs(capsys, "finetune", job, "--set", f"output.dir={out}", *STEPS)
    (out / "mine.txt").write_text("the user's")
    assert (out / MARKER).is_file()
    finished = _tree(out)

    # a typo in the new job: it fails before anything is written
    err, _ = _fails(capsys, 2, "finetune", job, "--set", f"output.dir={out}", *STEPS,
                    "--set", "train.optimizer=adamx", "--overwrite")  # fmt: skip
    assert "train.optimizer must be one of" in err
    # a new job that fails while it trains (diverges): the old run stays whole
    err, _ = _fails(capsys, 1, "finetune", job, "--set", f"output.dir={out}", *STEPS,
                    "--set", "train.learning_rate=1e9", "--set", "train.max_grad_norm=0",
                    "--overwrite")  # fmt: skip
    assert "the run diverged at step" in err
    assert _tree(out) == finished

    # and a replacement that succeeds keeps the user's file, and drops the old run's
    text = _runs(capsys, "finetune", job, "--set", f"output.dir={out}", *STEPS,
                 "--set", "train.seed=7", "--overwrite")  # fmt: skip
    assert "it replaces" in text
    assert (out / "mine.txt").read_text() == "the user's"
    assert json.loads((out / "job.json").read_text())["train"]["seed"] == 7
    assert _tree(out) != finished
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # nothing left beside it


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, f"no {path} in {timeout} s"
        time.sleep(0.01)


@pytest.mark.command_run
def test_a_killed_replacement_keeps_the_finished_run(bert, tmp_path, capsys):
    job, out = bert / "job.toml", tmp_path / "run"
    _runs(capsys, "finetune", job, "--set", f"output.dir={out}", *STEPS)
    finished = _tree(out)
    sets = ["train.steps=24", "train.checkpoint_every=4", "train.seed=5"]
    argv = [sys.executable, "-m", "peftx", "finetune", str(job), "--set", f"output.dir={out}"]
    argv += [a for s in sets for a in ("--set", s)] + ["--overwrite"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        staging = tmp_path / ".run.peftx-next"
        _wait_for(staging / "checkpoints" / "checkpoint-00000004", proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert _tree(out) == {**finished, LOCK: _tree(out)[LOCK]}  # the lock names the dead run
    # the replacement goes on from its checkpoint, then takes the old run's place
    text = _runs(capsys, "finetune", job, "--set", f"output.dir={out}",
                 *[a for s in sets for a in ("--set", s)], "--overwrite")  # fmt: skip
    assert f"resuming from {staging / 'checkpoints'}/checkpoint-" in text
    assert json.loads((out / "summary.json").read_text())["steps"] == 24
    assert not staging.exists()


def _finished_run(directory: Path) -> None:
    """What a finished run leaves, as far as `--overwrite` looks."""
    (directory / "adapter").mkdir(parents=True)
    for name in (MARKER, "job.json", "summary.json", "adapter/adapter_model.safetensors"):
        (directory / name).write_text(f"{name} of the finished run")
    (directory / "notes.txt").write_text("the user's")


@pytest.mark.command_run
def test_overwrite_through_a_linked_output_dir(bert, tmp_path, capsys):
    """The repro: `--overwrite` with output.dir a link to a finished run swapped the link
    itself and failed; the next run took the stray `.slink.peftx-next` link for its own
    staging directory and cleared the run it led to. The link is followed: the run is
    written beside its target and swapped in there; a link in the staging directory's
    place is never written through."""
    job, scratch = bert / "job.toml", tmp_path / "scratch"
    srun, slink = scratch / "srun", scratch / "slink"
    _finished_run(srun)
    slink.symlink_to("srun")
    (scratch / ".slink.peftx-next").symlink_to("srun")  # what the swap of the link left
    finished = _tree(srun)
    text = _runs(capsys, "finetune", job, "--set", f"output.dir={slink}", *STEPS, "--overwrite")
    assert f"it replaces {srun}" in text
    assert os.readlink(slink) == "srun" and os.readlink(scratch / ".slink.peftx-next") == "srun"
    replaced = _tree(srun)
    assert replaced != finished and json.loads((srun / "summary.json").read_text())["steps"] == 6
    assert (srun / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in scratch.iterdir()) == [".slink.peftx-next", "slink", "srun"]

    # a replacement that diverges leaves the run as it was
    err, _ = _fails(capsys, 1, "finetune", job, "--set", f"output.dir={slink}", *STEPS,
                    "--set", "train.learning_rate=1e9", "--set", "train.max_grad_norm=0",
                    "--overwrite")  # fmt: skip
    assert "the run diverged at step" in err
    assert _tree(srun) == replaced
    # a link where the replacement would be staged is refused, and what it leads to kept
    staging = scratch / ".srun.peftx-next"
    shutil.rmtree(staging)  # the diverged replacement
    shutil.copytree(srun, scratch / "other")
    other = _tree(scratch / "other")
    staging.symlink_to("other")
    err, _ = _fails(capsys, 2, "finetune", job, "--set", f"output.dir={slink}", *STEPS,
                    "--set", "train.seed=9", "--overwrite")  # fmt: skip
    assert f"{staging} is in the way of the run replacing {srun}; move it" in err
    assert _tree(srun) == replaced and _tree(scratch / "other") == other
    assert os.readlink(staging) == "other"


def test_a_relative_output_dir_is_taken_from_the_job_file(bert, tmp_path, monkeypatch):
    """As every path of a job file: its output.dir from the file's directory; `--set`'s
    from the current directory; the default `runs/<job name>` in the current directory."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    text = (bert / "job.toml").read_text().replace('path = "base"', f'path = "{bert / "base"}"')
    (jobs / "cls.toml").write_text(text + '\n[output]\ndir = "../runs/cls"\n')
    (jobs / "plain.toml").write_text(text)
    monkeypatch.chdir(bert)
    assert _job.Job(jobs / "cls.toml", []).out.resolve() == tmp_path / "runs" / "cls"
    moved = _job.Job(jobs / "cls.toml", ["output.dir=elsewhere"]).out
    assert moved.resolve() == bert / "elsewhere"
    assert _job.Job(jobs / "plain.toml", []).out.resolve() == bert / "runs" / "plain"


def test_a_users_job_json_is_not_a_run(bert, tmp_path, capsys):
    """The repro: a directory holding a `job.json` and no `checkpoints/` was deleted
    without any flag."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "job.json").write_text('{"model": "my own"}')
    before = _tree(out)
    for extra in ([], ["--overwrite"]):
        err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"output.dir={out}",
                        *STEPS, *extra)  # fmt: skip
        assert "not a peftx run directory" in err
    assert _tree(out) == before


# -- locks ----------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_directory_is_refused(bert, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = Lock(out)
    holder.acquire()  # another run, still going
    try:
        err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"output.dir={out}",
                        *STEPS)  # fmt: skip
    finally:
        holder.release()
    assert f"is in use by another peftx run (process {os.getpid()}" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


@pytest.mark.command_run
def test_the_lock_of_a_dead_run_is_taken_over(bert, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / LOCK).write_text(f"{gone.pid}\n")  # left by a run that was killed
    text = _runs(capsys, "finetune", bert / "job.toml", "--set", f"output.dir={out}", *STEPS)
    assert f"left by process {gone.pid}, which is gone" in text
    assert (out / "summary.json").is_file() and (out / LOCK).read_text() == ""


# -- restoring checkpoints ------------------------------------------------------------------


@pytest.mark.command_run
def test_damaged_checkpoints_are_passed_over(bert, tmp_path, capsys, monkeypatch):
    job, out = bert / "job.toml", tmp_path / "run"
    sets = ["train.steps=20", "train.checkpoint_every=4", "output.keep_checkpoints=4"]
    argv = ["finetune", job, "--set", f"output.dir={out}", *[a for s in sets for a in ("--set", s)]]
    whole = _runs(capsys, *argv[:3], f"output.dir={tmp_path / 'whole'}", *argv[4:])
    assert "resuming" not in whole

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # stopped after training, before its results
        m.setattr(finetune, "_finish", interrupted)
        code, _, _ = run_cli(capsys, *argv)
    assert code == 130
    ckpts = out / "checkpoints"
    assert [p.name for p in sorted(ckpts.iterdir())] == [
        f"checkpoint-{n:08d}" for n in (4, 8, 12, 16)
    ]
    state = ckpts / "checkpoint-00000016" / "train_state.safetensors"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # truncated
    info = ckpts / "checkpoint-00000012" / "train_state.json"
    info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items()
                                if k != "step"}))  # fmt: skip
    info = ckpts / "checkpoint-00000008" / "train_state.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "batches": 1000000}))
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 17, "split": "tr')  # a torn line
    (out / ".curves.png.x1y2.peftx-tmp").write_bytes(b"half a png")  # a killed write
    stale = ckpts / f".checkpoint-00000020.peftx-new-{2**22 + 7}-zz"
    stale.mkdir()

    text = _runs(capsys, *argv)
    passed_over = [line for line in text.splitlines() if "is damaged, passed over" in line]
    assert len(passed_over) == 3, text
    assert "checkpoint-00000016" in passed_over[0] and "checkpoint-00000008" in passed_over[2]
    assert "1000000" in passed_over[2]
    assert f"resuming from {ckpts / 'checkpoint-00000004'} (step 4 of 20)" in text
    assert not stale.exists() and not (out / ".curves.png.x1y2.peftx-tmp").exists()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [5, 10, 15, 20]
    # the resumed run is the uninterrupted one, bit for bit
    import safetensors.numpy

    got = safetensors.numpy.load_file(str(out / "adapter" / "adapter_model.safetensors"))
    want = safetensors.numpy.load_file(
        str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors")
    )
    assert sorted(got) == sorted(want)
    for k in want:
        assert (got[k] == want[k]).all(), k


@pytest.mark.command_run
def test_a_full_disk_at_a_checkpoint_is_one_line_and_resumes(bert, tmp_path, capsys, monkeypatch):
    """The repro: a full disk at a checkpoint was a `SafetensorError` traceback."""
    import safetensors.numpy
    from safetensors import SafetensorError

    job, out = bert / "job.toml", tmp_path / "run"
    argv = ["finetune", job, "--set", f"output.dir={out}", *STEPS,
            "--set", "train.checkpoint_every=2"]  # fmt: skip
    real = safetensors.numpy.save_file

    def full_at_step_4(tensors, filename, metadata=None):
        if "checkpoint-00000004" in filename:
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                'space left on device" })'
            )
        return real(tensors, filename, metadata=metadata)

    with monkeypatch.context() as m:
        m.setattr(safetensors.numpy, "save_file", full_at_step_4)
        err, _ = _fails(capsys, 1, *argv)
    failed = out / "checkpoints" / "checkpoint-00000004"
    assert f"no space left on the device to write '{failed}': it needs about " in err
    assert " bytes are free there; free some space and run it again" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-00000002"]
    text = _runs(capsys, *argv)
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-00000002'} (step 2 of 6)" in text
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


# -- silent wrong results -------------------------------------------------------------------


@pytest.mark.command_run
def test_a_diverging_run_fails_and_writes_no_adapter(bert, tmp_path, capsys):
    """The repro: learning_rate=1e9 wrote a NaN adapter, bare NaN in metrics.jsonl, and
    exited 0."""
    out = tmp_path / "run"
    err, text = _fails(capsys, 1, "finetune", bert / "job.toml", "--set", f"output.dir={out}",
                       "--set", "train.learning_rate=1e9", "--set", "train.max_grad_norm=0",
                       "--set", "train.steps=12", "--set", "train.checkpoint_every=1",
                       "--set", "train.log_every=1")  # fmt: skip
    assert "the run diverged at step" in err and "No adapter was written" in err
    step = int(err.split("diverged at step ")[1].split(":")[0])
    assert f"the last good checkpoint stays in {out / 'checkpoints'}" in err
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()
    kept = sorted((out / "checkpoints").iterdir())[-1]
    assert kept.name == f"checkpoint-{step - 1:08d}"

    def no_constants(name):
        raise AssertionError(f"{name} in metrics.jsonl is not JSON")

    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=no_constants)


@pytest.mark.command_run
def test_a_collapsing_causal_run_fails_and_writes_no_adapter(llama, tmp_path, capsys):
    """The repro: learning_rate=1e9 made every prediction uniform (eval loss ln(vocab)),
    wrote that adapter, and exited 0. The tiny Llama's eval loss starts above ln(vocab)."""
    out = tmp_path / "run"
    err, _ = _fails(capsys, 1, "finetune", llama / "job.toml", "--set", f"output.dir={out}",
                    "--set", "train.learning_rate=1e9", "--set", "train.steps=10")  # fmt: skip
    vocab = json.loads((llama / "base" / "config.json").read_text())["vocab_size"]
    before, after = (
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if r["split"] == "eval"
    )
    assert after == pytest.approx(math.log(vocab), rel=1e-5) and before > after  # uniform
    assert err == (
        f"peftx: error: the run collapsed: eval loss {after:.4g} after training ({before:.4g} "
        f"before) is no better than a uniform prediction over the {vocab} tokens (ln {vocab} "
        f"= {math.log(vocab):.4g}); lower train.learning_rate (now 1e+09). No adapter was "
        "written"
    )
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()


UNIFORM = math.log(1000)


@pytest.mark.parametrize(
    ("before", "after", "collapsed"),
    [
        (2.0, UNIFORM, True),  # uniform output, from a trained base
        (2.0, UNIFORM + 1.0, True),  # worse than uniform, and than before
        (UNIFORM + 1.0, UNIFORM * (1 + 1e-6), True),  # uniform, from a confidently wrong init
        (UNIFORM + 1.0, UNIFORM + 0.5, False),  # above uniform, but learning (a short run)
        (UNIFORM + 1.0, UNIFORM - 0.5, False),
        (2.0, 1.5, False),
        (2.0, 2.5, False),  # worse, yet far better than uniform (overfitting, not collapse)
    ],
)
def test_collapse_rule(before, after, collapsed):
    """A run has collapsed when its eval loss after is not below ln(vocab) (the uniform
    prediction's) and is worse than before, or is ln(vocab) itself."""
    assert _fit._collapsed(before, after, vocab_size=1000) == collapsed


@pytest.mark.parametrize("key", ["learning_rate", "weight_decay", "max_grad_norm"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused(bert, tmp_path, capsys, key, value):
    out = tmp_path / "run"
    err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"output.dir={out}",
                    "--set", f"train.{key}={value}")  # fmt: skip
    assert f"train.{key} must be a finite number" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("train.steps=1000000000000000000", "train.steps must be at most 2147483647"),
        ("train.epochs=2147483647", "train.epochs makes 12884901882 steps, more than"),
        ("train.warmup_steps=-1", "train.warmup_steps must be an integer >= 0"),
        ("train.seed=1.5", "train.seed must be an integer"),
        ("data.pack=1", "data.pack must be true or false"),
    ],
)
def test_huge_and_odd_numbers_are_one_line(bert, tmp_path, capsys, item, says):
    """The repro: train.steps=10**18 was an OverflowError traceback."""
    out = tmp_path / "run"
    err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"output.dir={out}",
                    "--set", item)  # fmt: skip
    assert says in err
    assert not out.exists()


def test_non_finite_adapter_numbers_are_refused(bert, tmp_path, capsys):
    for key in ("lora_alpha", "lora_dropout"):
        at = f"output.dir={tmp_path / 'run'}"
        err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", at,
                        "--set", f"lora.{key}=nan")  # fmt: skip
        assert key in err


def test_a_run_that_changes_nothing_fails():
    weights = {"lora_A": jnp.ones((2, 3)), "lora_B": jnp.zeros((3, 2))}
    with pytest.raises(RunFailed, match="changed no trained weight"):
        _fit._check_trained(weights, dict(weights), steps=5)
    broken = {**weights, "lora_B": jnp.full((3, 2), jnp.nan)}
    with pytest.raises(RunFailed, match="not finite"):
        _fit._check_trained(weights, broken, steps=5)
    _fit._check_trained(weights, {**weights, "lora_B": jnp.ones((3, 2))}, steps=5)


# -- the job validator, on any value ---------------------------------------------------------

NUMBERS = [
    ("data", "max_length"),
    ("train", "seed"),
    ("train", "epochs"),
    ("train", "steps"),
    ("train", "batch_size"),
    ("train", "eval_batch_size"),
    ("train", "grad_accumulation"),
    ("train", "learning_rate"),
    ("train", "weight_decay"),
    ("train", "warmup_steps"),
    ("train", "max_grad_norm"),
    ("train", "log_every"),
    ("train", "eval_every"),
    ("train", "checkpoint_every"),
    ("output", "keep_checkpoints"),
    ("lora", "r"),
    ("lora", "lora_alpha"),
    ("lora", "lora_dropout"),
]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 10**18, 1e-300, 0.5]),
    st.booleans(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


@settings(
    max_examples=example_count(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(field=st.sampled_from(NUMBERS), value=VALUES)
def test_the_job_validator_on_any_value(bert, field, value):
    """Any value of any numeric field: a clean `UsageError` (exit 2), or a job whose
    numbers are all in range, with an optimizer whose schedule is finite."""
    table, key = field
    try:
        job = _job.Job(bert / "job.toml", [f"{table}.{key}={_toml(value)}"])
    except UsageError as e:
        assert f"{table}.{key}" in str(e) or key in str(e)
        return
    t = job.train
    counts = [job.data["max_length"], job.output["keep_checkpoints"]] + [
        t[k] for k in ("epochs", "batch_size", "eval_batch_size", "grad_accumulation", "log_every")
    ]
    counts += [t[k] for k in ("steps", "eval_every", "checkpoint_every") if t[k] is not None]
    assert all(type(c) is int and 1 <= c < 2**31 for c in counts)
    assert type(t["warmup_steps"]) is int and 0 <= t["warmup_steps"] < 2**31
    assert type(t["seed"]) is int and 0 <= t["seed"] < 2**32
    for k in ("learning_rate", "weight_decay", "max_grad_norm"):
        assert math.isfinite(t[k]) and t[k] >= 0
    assert t["learning_rate"] > 0
    config = job.adapters[0].config
    assert 1 <= config.r and math.isfinite(config.lora_alpha) and 0 <= config.lora_dropout < 1
    _, schedule = train.make_optimizer(t["steps"] or 10, **job.optimizer_settings())
    assert all(math.isfinite(float(schedule(n))) for n in (0, 1, (t["steps"] or 10) - 1))


# -- data the model cannot learn from ---------------------------------------------------------


def _causal_job(llama, tmp_path, rows, *sets):
    write_jsonl(tmp_path / "rows.jsonl", rows)
    at = tmp_path / "rows.jsonl"
    return ["finetune", llama / "job.toml", "--set", f"output.dir={tmp_path / 'run'}",
            "--set", f"data.train={at}", "--set", f"data.eval={at}",
            *[a for s in sets for a in ("--set", s)]]  # fmt: skip


def test_a_list_column_is_not_text(llama, tmp_path, capsys):
    """The repro: a `messages` column given as text_column trained on its repr."""
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    rows = [{"question": "w5", "answer": messages}] * 4
    with as_users_run():
        err, _ = _fails(capsys, 2, *_causal_job(llama, tmp_path, rows))
    assert f"{tmp_path / 'rows.jsonl'}: column 'answer': row 1 holds a list" in err
    assert not (tmp_path / "run").exists()


def test_more_labels_than_a_saved_classifier_names_the_data(bert, tmp_path, capsys):
    """The repro: 3 classes of data on a saved 2-label classifier named only the weight
    shapes. The error says the data has 3 labels and the checkpoint 2."""
    import transformers

    saved = tmp_path / "two_labels"
    head = transformers.BertForSequenceClassification.from_pretrained(bert / "base", num_labels=2)
    head.save_pretrained(saved)
    for f in (bert / "base").glob("*token*"):
        shutil.copy(f, saved / f.name)
    err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"model.path={saved}",
                    "--set", f"output.dir={tmp_path / 'run'}")  # fmt: skip
    train = bert / "train.jsonl"
    assert f"{train} has 3 labels (" in err and f"the classifier saved in {saved} has 2" in err
    assert not (tmp_path / "run").exists()


def _without_tokenizer(base: Path, to: Path) -> Path:
    shutil.copytree(base, to, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert not {p.name for p in to.iterdir()} & {"tokenizer.json", "tokenizer_config.json"}
    return to


def test_a_model_directory_without_a_tokenizer_is_refused(bert, llama, tmp_path, capsys):
    """The repros: BERT without tokenizer files trained on all-[UNK] input (transformers
    built an empty vocabulary from config.json) and exited 0; Llama's message was about
    sentencepiece/tiktoken. Each command that tokenizes refuses it in one line, naming
    the directory and the files a tokenizer needs, before anything is written."""
    needs = "has no tokenizer: it needs one of tokenizer.json, tokenizer.model, vocab.json"
    plain_bert = _without_tokenizer(bert / "base", tmp_path / "bert")
    err, _ = _fails(capsys, 2, "finetune", bert / "job.toml", "--set", f"model.path={plain_bert}",
                    "--set", f"output.dir={tmp_path / 'run'}")  # fmt: skip
    assert f"model directory {str(plain_bert)!r} {needs}" in err
    plain_llama = _without_tokenizer(llama / "base", tmp_path / "llama")
    rows = [{"question": "w1 w2", "answer": "w3"}] * 4
    err, _ = _fails(capsys, 2, *_causal_job(llama, tmp_path, rows, f"model.path={plain_llama}"))
    assert f"model directory {str(plain_llama)!r} {needs}" in err
    err, _ = _fails(capsys, 2, "generate", plain_llama, "w1 w2")
    assert f"model directory {str(plain_llama)!r} {needs}" in err
    assert not (tmp_path / "run").exists()


def test_prompts_that_fill_max_length_leave_nothing_to_learn(llama, tmp_path, capsys):
    """The repro: every response cut by max_length gave loss 0, perplexity 1 and an all-zero
    lora_B."""
    rows = [{"question": " ".join(["w30"] * 20), "answer": "w31 w32"}] * 8
    with as_users_run():
        err, _ = _fails(capsys, 2, *_causal_job(llama, tmp_path, rows, "data.pack=false"))
    assert "no supervised tokens" in err and str(tmp_path / "rows.jsonl") in err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_the_vocabulary(llama, tmp_path, capsys):
    """The repro: a tokenizer with ids past the model's vocab_size made every step NaN."""
    small = tmp_path / "small"
    shutil.copytree(llama / "base", small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    rows = [{"question": "w1 w2", "answer": "w50 w51"}] * 4  # ids past 40
    with as_users_run():
        err, _ = _fails(capsys, 2, *_causal_job(llama, tmp_path, rows, f"model.path={small}"))
    assert "outside the model's vocab_size 40" in err
