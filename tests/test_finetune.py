"""`peftx finetune`: whole jobs on tiny random checkpoints, in process through
`peftx.cli.main` (one killed in a subprocess and resumed), with PyTorch PEFT and
transformers as the references for what the jobs write."""

import contextlib
import hashlib
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import WORDS, run_cli, write_jsonl

import peftx
from peftx import train
from peftx.cli import main
from peftx.cli._common import UsageError

EPS = np.finfo(np.float32).eps
CONFIGS = Path(__file__).parent.parent / "configs"


def _error(capsys, code, *argv):
    """The one error line of a failing command with exit status `code`."""
    got, out, err = run_cli(capsys, *argv)
    assert got == code, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("peftx: error: ")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n"), err
    return lines[0]


def _finetune(capsys, job, out_dir, *sets, extra=()):
    args = ["finetune", job, "--set", f"output.dir={out_dir}", *extra]
    for item in sets:
        args += ["--set", item]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, (out, err)
    return out


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _tolerance(reference: np.ndarray) -> float:
    return 64 * EPS * max(1.0, float(np.abs(reference).max()))


def _tensors(adapter: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(adapter / "adapter_model.safetensors"))


# -- classification -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(bert, tmp_path_factory):
    """The output dir of a finished 80-step run of the BERT job, and what it printed."""
    out_dir = tmp_path_factory.mktemp("finished") / "run"
    argv = ["finetune", bert / "job.toml", "--set", f"output.dir={out_dir}"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main([*map(str, argv), "--set", "train.steps=80"])
    assert code == 0, err.getvalue()
    return out_dir, stdout.getvalue()


def _three_label_classifiers(bert):
    """transformers' and peftx's 3-label classifier on the tiny encoder `bert / "base"`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the encoder's fresh classifier
        base = transformers.AutoModelForSequenceClassification.from_pretrained(
            bert / "base", num_labels=3
        )
        model = peftx.from_pretrained(
            bert / "base", model_class="BertForSequenceClassification", num_labels=3
        )
    return base, model


@pytest.mark.command_run
def test_classification_job(bert, finished):
    out_dir, out = finished
    assert "trainable params:" in out
    assert "before fine-tuning: loss " in out and "after fine-tuning:  loss " in out
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 80
    assert summary["after"]["accuracy"] > max(0.8, summary["before"]["accuracy"] + 0.3)
    assert summary["after"]["loss"] < summary["before"]["loss"]
    assert f"accuracy {summary['after']['accuracy']:.2%}" in out
    assert json.loads((out_dir / "labels.json").read_text()) == ["blue", "green", "red"]
    assert not (out_dir / "checkpoints").exists() and not (out_dir / "merged").exists()

    records = _records(out_dir)
    train_rows = [r for r in records if r["split"] == "train"]
    eval_rows = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train_rows] == list(range(5, 81, 5))
    assert [r["step"] for r in eval_rows] == list(range(0, 81, 10))
    assert eval_rows[0] | {"step": 0} == {"step": 0, "split": "eval", **summary["before"]}
    assert eval_rows[-1] == {"step": 80, "split": "eval", **summary["after"]}
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in train_rows)
    assert train_rows[0]["learning_rate"] > train_rows[-1]["learning_rate"]  # linear decay
    png = (out_dir / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    # PyTorch PEFT on the same transformers checkpoint predicts what peftx does
    eval_rows = [json.loads(line) for line in (bert / "eval.jsonl").read_text().splitlines()]
    texts = [r["sentence"] for r in eval_rows]
    adapter = out_dir / "adapter"
    tok = transformers.AutoTokenizer.from_pretrained(adapter, local_files_only=True)
    enc = tok(texts, padding=True, return_tensors="np")
    base, model = _three_label_classifiers(bert)
    reference = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        want = reference(
            input_ids=torch.from_numpy(enc["input_ids"]),
            attention_mask=torch.from_numpy(enc["attention_mask"]),
        ).logits.numpy()
    adapted = peftx.PeftModel.from_pretrained(model, adapter)
    ids, mask = (jnp.asarray(enc[k], jnp.int32) for k in ("input_ids", "attention_mask"))
    got = np.asarray(adapted(ids, mask).logits)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    labels = json.loads((out_dir / "labels.json").read_text())
    predicted = [labels[i] for i in want.argmax(-1)]
    accuracy = np.mean([p == r["intent"] for p, r in zip(predicted, eval_rows, strict=True)])
    assert accuracy == pytest.approx(summary["after"]["accuracy"])


@pytest.mark.command_run  # trains the job's 80 steps again, from Python
def test_fit_from_python_trains_the_commands_adapter(bert, finished, tmp_path):
    """`peftx.train.fit`, called from Python with the BERT job's model, data and `[train]`
    settings, trains the adapter the command wrote, byte for byte, with its metrics."""
    out_dir, _ = finished
    labels = json.loads((out_dir / "labels.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert / "base")

    def encode(name):
        rows = train.read_records(bert / name, ["sentence", "intent"])
        texts, ids = [r["sentence"] for r in rows], [labels.index(r["intent"]) for r in rows]
        return train.encode_classification(tokenizer, texts, ids, max_length=16)

    model_key, key = jax.random.split(jax.random.key(3))  # the job's seed, as the command
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the encoder's fresh classifier
        base = peftx.from_pretrained(
            bert / "base", model_class="BertForSequenceClassification", num_labels=3
        )
    config = peftx.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["query", "value"], task_type="SEQ_CLS"
    )
    model = peftx.get_peft_model(base, config, key=model_key)
    result = train.fit(
        model, encode("train.jsonl"), encode("eval.jsonl"), loss_fn=train.classification_loss,
        steps=80, batch_size=16, eval_batch_size=32, seed=3, learning_rate=2e-2,
        warmup_steps=2, log_every=5, eval_every=10, out=tmp_path, key=key,
    )  # fmt: skip
    result.model.save_pretrained(tmp_path / "adapter")
    got, want = _tensors(tmp_path / "adapter"), _tensors(out_dir / "adapter")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    summary = json.loads((out_dir / "summary.json").read_text())
    assert (result.before, result.after, result.steps) == (
        summary["before"], summary["after"], summary["steps"]
    )  # fmt: skip
    timeless = lambda rs: [{k: v for k, v in r.items() if k != "examples_per_s"} for r in rs]  # noqa: E731
    assert timeless(_records(tmp_path)) == timeless(_records(out_dir))
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def _wait_for_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ckpt_dir.is_dir() and any(p.name.startswith("checkpoint-") for p in ckpt_dir.iterdir()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before its first checkpoint: {proc.returncode}")
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint in {timeout} s")


@pytest.mark.command_run
def test_kill_and_resume_is_exact(bert, tmp_path, capsys):
    job = bert / "job.toml"
    sets = ["train.steps=48", "train.checkpoint_every=4", "train.eval_every=16"]
    killed = tmp_path / "killed"
    argv = [sys.executable, "-m", "peftx", "finetune", str(job), "--set", f"output.dir={killed}"]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_checkpoint(proc, killed / "checkpoints", timeout=300)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "summary.json").exists() and not (killed / "adapter").exists()
    assert (killed / "job.json").is_file()

    # the same output dir with a different job refuses to resume
    err = _error(
        capsys, 2, "finetune", job, "--set", f"output.dir={killed}", *_sets(sets),
        "--set", "train.learning_rate=0.5",
    )  # fmt: skip
    assert f"{killed} holds checkpoints of a different job; pass --overwrite" in err

    # nor on a train file edited since, even to the same size
    train_file = bert / "train.jsonl"
    data = train_file.read_bytes()
    edited = data.replace(b'"red"', b'"der"', 1)
    assert len(edited) == len(data) and edited != data
    try:
        train_file.write_bytes(edited)
        err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={killed}", *_sets(sets))
    finally:
        train_file.write_bytes(data)
    size = len(data)
    then, now = (hashlib.sha256(d).hexdigest() for d in (data, edited))
    assert err == (
        f"peftx: error: {killed} holds checkpoints of a run on data file {str(train_file)!r} "
        f"as it was then ({size} bytes, sha256 {then}); it has changed since ({size} bytes, "
        f"sha256 {now}): put it back to resume; pass --overwrite to start over, or set "
        "output.dir"
    )

    out = _finetune(capsys, job, killed, *sets)
    assert f"resuming from {killed / 'checkpoints'}/checkpoint-" in out
    assert "(step " in out and " of 48)" in out
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["steps"] == 48 and not (killed / "checkpoints").exists()

    whole = tmp_path / "whole"
    out = _finetune(capsys, job, whole, *sets)
    assert "resuming" not in out
    got, want = _tensors(killed / "adapter"), _tensors(whole / "adapter")
    assert sorted(got) == sorted(want) and any("lora_A" in k for k in got)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert json.loads((whole / "summary.json").read_text()) == summary
    # the resumed log has each step once, in order
    assert [r["step"] for r in _records(killed)] == [r["step"] for r in _records(whole)]


def _sets(items):
    return [a for item in items for a in ("--set", item)]


# -- causal LM ------------------------------------------------------------------------------


@pytest.mark.command_run
def test_causal_lm_job_packed_with_prompts_and_merged(llama, tmp_path, capsys):
    """The job starts from EVA (`[init]`: two batches of packed train rows), whose file
    PEFT reads to the merged model's logits."""
    out_dir = tmp_path / "run"
    sets = ("train.steps=40", "lora.init_lora_weights=eva", "init.batches=2")
    out = _finetune(capsys, llama / "job.toml", out_dir, *sets)
    assert "initializing the adapter from 2 train batches" in out
    saved = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert saved["init_lora_weights"] == "eva" and saved["eva_config"]["rho"] == 2.0
    assert saved["rank_pattern"]  # EVA moved rank between the layers
    assert "perplexity" in out and "accuracy" not in out
    summary = json.loads((out_dir / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["loss"] < before["loss"] - 0.5
    assert after["perplexity"] == pytest.approx(np.exp(after["loss"]), rel=1e-6)
    assert f"perplexity {after['perplexity']:.4g}" in out
    assert not (out_dir / "labels.json").exists()
    # the loss before fine-tuning, recomputed with transformers: packing keeps every eval
    # example whole in a row, where it sees only itself, so each is run alone here; its
    # prompt is not scored, its answer and EOS are
    tok = transformers.AutoTokenizer.from_pretrained(llama / "base", local_files_only=True)
    rows = [json.loads(line) for line in (llama / "eval.jsonl").read_text().splitlines()]
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    scored, every = [], []
    for r in rows:
        prompt = tok(r["question"], add_special_tokens=False)["input_ids"]
        answer = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = base(ids, use_cache=False).logits[0, :-1]
        ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").tolist()
        scored += ce[len(prompt) - 1 :]
        every += ce
    assert before["loss"] == pytest.approx(np.mean(scored), rel=1e-5)
    assert abs(np.mean(every) - before["loss"]) > 0.01  # scoring the prompts too differs

    # the merged checkpoint: transformers loads it, and it computes PEFT's adapted model
    ids = torch.from_numpy(np.random.default_rng(0).integers(5, len(WORDS), size=(2, 12)))
    merged = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "merged")
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    with torch.no_grad():
        plain = base(ids).logits.numpy()
        reference = peft.PeftModel.from_pretrained(base, out_dir / "adapter").eval()
        want = reference(ids).logits.numpy()
        got = merged(ids).logits.numpy()
    assert np.abs(want - plain).max() > 100 * _tolerance(want)  # the adapter matters
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    # and so does peftx's adapted model
    model = peftx.from_pretrained(llama / "base")
    adapted = peftx.PeftModel.from_pretrained(model, out_dir / "adapter")
    ids = jnp.asarray(ids.numpy(), jnp.int32)
    mine = np.asarray(adapted(ids, jnp.ones(ids.shape, jnp.int32)).logits)
    np.testing.assert_allclose(mine, want, rtol=0, atol=_tolerance(want))
    tok = transformers.AutoTokenizer.from_pretrained(out_dir / "merged", local_files_only=True)
    assert tok.eos_token == "</s>"
    # the base's files beside its weights come along, as `peftx merge` copies them
    beside = [f for f in (llama / "base").iterdir() if not f.name.startswith(("model", "config"))]
    assert "generation_config.json" in [f.name for f in beside]
    for f in beside:
        assert (out_dir / "merged" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.command_run
@pytest.mark.parametrize(
    "init", ["lora_ga", pytest.param("pissa", marks=pytest.mark.variant_sweep)]
)
def test_a_job_whose_init_leaves_a_residual_writes_the_adapter_for_the_original_base(
    init, llama, tmp_path, capsys
):
    """LoRA-GA (and PiSSA) replace the base weights by a residual: the job writes the
    adapter converted (PEFT's `path_initial_model_for_weight_conversion`), a plain LoRA of
    rank `2r` that PEFT applies to the original base to the merged model's logits."""
    out_dir = tmp_path / "run"
    sets = ["train.steps=5", f"lora.init_lora_weights={init}"]
    if init == "lora_ga":
        sets.append("init.batches=1")
    out = _finetune(capsys, llama / "job.toml", out_dir, *sets)
    assert "converted for the original base" in out
    job = tomllib.loads((llama / "job.toml").read_text())
    saved = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert saved["init_lora_weights"] is True and saved["r"] == 2 * job["lora"]["r"]
    ids = torch.from_numpy(np.random.default_rng(0).integers(5, len(WORDS), size=(2, 12)))
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "merged")
    with torch.no_grad():
        plain = base(ids).logits.numpy()
        want = merged(ids).logits.numpy()
        got = peft.PeftModel.from_pretrained(base, out_dir / "adapter").eval()(ids).logits.numpy()
    assert np.abs(want - plain).max() > 100 * _tolerance(want)  # the adapter matters
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))


# -- errors ---------------------------------------------------------------------------------


def test_init_table_schema(llama, tmp_path):
    """`[init]`'s batches come from the split it names; a bad table is refused by the job
    check, naming the key."""
    from peftx.cli._job import Job

    job = tmp_path / "job.toml"
    job.write_text(
        (llama / "job.toml").read_text().replace('path = "base"', f'path = "{llama / "base"}"')
    )
    eva = ("lora.init_lora_weights=eva",)
    ok = Job(job, [*eva, "init.batches=3", "init.batch_size=2", "init.split=eval"])
    assert ok.initializes and not Job(job, []).initializes
    rows = {"input_ids": np.arange(10), "labels": np.arange(10) + 1}
    batches = ok.init_batches({"input_ids": np.zeros(9)}, rows)
    assert [b["input_ids"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert batches[2]["labels"].tolist() == [5, 6]
    short = Job(job, [*eva, "init.batch_size=4"]).init_batches(rows, rows)
    assert [len(b["input_ids"]) for b in short] == [4, 4, 2]  # four batches asked, ten rows
    for sets, message in [
        (("init.batches=2",), "[init] sets the batches of a data-driven LoRA init"),
        ((*eva, "init.batches=0"), "init.batches must be a positive integer, got 0"),
        ((*eva, "init.batch_size=1.5"), "init.batch_size must be a positive integer"),
        ((*eva, "init.split=test"), "init.split must be one of train, eval, got 'test'"),
        ((*eva, "init.rows=4"), "unknown key 'rows' in [init]"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            Job(job, list(sets))
    text = job.read_text().replace('text_column = "answer"', 'chosen_column = "answer"')
    job.write_text(text.replace("pack = true", 'rejected_column = "answer"'))
    assert Job(job, [*eva, "train.objective=dpo"]).initializes  # EVA reads pairs' sequences
    with pytest.raises(UsageError, match="train.objective 'dpo' has preference pairs"):
        Job(job, ["lora.init_lora_weights=lora_ga", "train.objective=dpo"])


def test_errors(bert, tmp_path, capsys):
    job = bert / "job.toml"
    out_dir = tmp_path / "run"
    at = ("--set", f"output.dir={out_dir}")

    err = _error(capsys, 2, "finetune", tmp_path / "nope.toml")
    assert f"no such config file: '{tmp_path / 'nope.toml'}'" in err

    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.learning_rat=0.1")
    assert "unknown key 'learning_rat' in [train]" in err
    assert "(did you mean 'learning_rate'?)" in err

    err = _error(capsys, 2, "finetune", job, *at, "--set", "train_steps=3")
    assert "--set 'train_steps=3': expected TABLE.KEY=VALUE" in err
    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.steps")
    assert "expected TABLE.KEY=VALUE" in err

    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.optimizer=lion")
    assert "train.optimizer must be one of adamw, adam, sgd" in err
    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.schedule=step")
    assert "train.schedule must be one of constant, linear, cosine" in err
    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.batch_size=0")
    assert "batch_size must be a positive integer, got 0" in err

    no_train = tmp_path / "no_train.toml"
    no_train.write_text(
        job.read_text().replace('train = "train.jsonl"\n', "").replace('"base"', f'"{bert}/base"')
    )
    err = _error(capsys, 2, "finetune", no_train, *at)
    assert "[data] needs 'train': a .jsonl, .csv or .parquet file, a directory" in err

    odd = tmp_path / "odd_eval.jsonl"
    write_jsonl(odd, [{"sentence": "w30", "intent": "red"}, {"sentence": "w9", "intent": "mauve"}])
    err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={tmp_path / 'odd'}",
                 "--set", f"data.eval={odd}")  # fmt: skip
    assert f"{odd}: labels ['mauve'] never appear in {bert / 'train.jsonl'}" in err

    err = _error(capsys, 1, "finetune", job, *at, "--set", f"data.train={tmp_path / 'x.jsonl'}")
    assert f"data file '{tmp_path / 'x.jsonl'}' does not exist" in err
    # the job is checked whole before the output is touched: nothing was written
    assert not out_dir.exists()
    err = _error(capsys, 1, "finetune", job, *at, "--set", f"data.train={tmp_path / 'y.jsonl'}")
    assert f"data file '{tmp_path / 'y.jsonl'}' does not exist" in err

    with pytest.MonkeyPatch.context() as mp:  # a path given with --set is from the cwd
        mp.chdir(tmp_path)
        err = _error(capsys, 1, "finetune", job, *at, "--set", "data.train=z.jsonl")
    assert f"data file '{tmp_path / 'z.jsonl'}' does not exist" in err

    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.steps=abc")
    assert "train.steps must be a positive integer, got 'abc'" in err
    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.log_every=-1")
    assert "train.log_every must be a positive integer, got -1" in err
    err = _error(capsys, 2, "finetune", job, *at, "--set", "train.learning_rate=-0.1")
    assert (
        "train.learning_rate must be a finite number > 0 (float32: at most 3.403e+38), got -0.1"
        in err
    )


@pytest.mark.command_run
def test_finished_run_and_overwrite_with_grad_accumulation(bert, finished, tmp_path, capsys):
    job = bert / "job.toml"
    out_dir = tmp_path / "run"
    shutil.copytree(finished[0], out_dir)
    first = (out_dir / "summary.json").read_text()
    err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={out_dir}",
                 "--set", "train.steps=80")  # fmt: skip
    assert f"{out_dir} holds a finished run; pass --overwrite to replace it" in err
    assert (out_dir / "summary.json").read_text() == first

    # a run of micro-batches of 4, two to a step, replaces it, keeping the user's files
    (out_dir / "notes.txt").write_text("mine")
    sets = ("train.batch_size=4", "train.grad_accumulation=2", "train.steps=6", "train.log_every=3")
    out = _finetune(capsys, job, out_dir, *sets, extra=["--overwrite"])
    assert "resuming" not in out and "after fine-tuning:" in out
    assert (out_dir / "notes.txt").read_text() == "mine"
    assert not any(p.name.startswith(".run.peftx") for p in tmp_path.iterdir())
    assert json.loads((out_dir / "summary.json").read_text())["steps"] == 6
    assert json.loads((out_dir / "job.json").read_text())["train"]["grad_accumulation"] == 2
    records = _records(out_dir)
    assert [r["step"] for r in records if r["split"] == "train"] == [3, 6]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records if "grad_norm" in r)

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={other}", *extra)
        assert f"output.dir '{other}' is not empty and is not a peftx run directory" in err
        assert [p.name for p in other.iterdir()] == ["notes.txt"]
        assert (other / "notes.txt").read_text() == "mine"


# -- the shipped configs --------------------------------------------------------------------


# the demo's job is the fast tier's one command run
@pytest.mark.parametrize(
    "name",
    ["lora_minilm_intents", pytest.param("ia3_minilm_intents", marks=pytest.mark.command_run)],
)
def test_minilm_configs_run(name, bert, tmp_path, capsys):
    """On the tiny BERT (its module names are MiniLM's) for speed: the texts become
    mostly [UNK], but every table of the job is exercised."""
    out_dir = tmp_path / "run"
    sets = (f"model.path={bert / 'base'}", "train.steps=2", "train.eval_batch_size=160")
    out = _finetune(capsys, CONFIGS / f"{name}.toml", out_dir, *sets)
    assert "after fine-tuning:" in out
    saved = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == name.split("_")[0].upper() and saved["task_type"] == "SEQ_CLS"
    assert len(json.loads((out_dir / "labels.json").read_text())) == 4


@pytest.mark.command_run
def test_llama_configs_run(llama, tmp_path, capsys):
    """Both Llama jobs on the tiny Llama; the QLoRA one evaluates an NF4 bf16 base, whose
    loss before fine-tuning is near but not that of the float32 base."""
    before = {}
    for name in ("lora_llama_causal", "qlora_llama_causal"):
        out_dir = tmp_path / name
        sets = (f"model.path={llama / 'base'}", "train.steps=2", "data.max_length=32")
        out = _finetune(capsys, CONFIGS / f"{name}.toml", out_dir, *sets)
        assert "perplexity" in out
        saved = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
        assert saved["peft_type"] == "LORA" and saved["task_type"] == "CAUSAL_LM"
        assert saved["r"] == 16 and len(saved["target_modules"]) == 7
        assert (out_dir / "merged").is_dir() == (name == "lora_llama_causal")
        summary = json.loads((out_dir / "summary.json").read_text())
        assert summary["steps"] == 2
        before[name] = summary["before"]["loss"]
    lora, qlora = before["lora_llama_causal"], before["qlora_llama_causal"]
    assert qlora != lora and abs(qlora - lora) < 0.1 * lora


# one non-LoRA job end to end: AdaLoRA's, whose allocator prunes in the loop (every
# table's config and PEFT-readable file: test_cli's inspect test)
ADALORA = 'init_r = 4\ntarget_r = 2\ntinit = 2\ntfinal = 2\ntarget_modules = ["query", "value"]'


@pytest.mark.command_run
def test_adalora_table_trains_and_writes_what_peft_reads(bert, tmp_path, capsys):
    """An [adalora] job (no total_step: the run's steps) writes PEFT's adapter, which PEFT
    reads to peftx's logits. AdaLoRA's allocator runs with no call of the user's, and its
    file is PEFT's pruned one."""
    text = (bert / "job.toml").read_text()
    for name in ("base", "train.jsonl", "eval.jsonl"):
        text = text.replace(f'"{name}"', f'"{bert / name}"')
    lora = text[text.index("[lora]") : text.index("[train]")]
    job = tmp_path / "job.toml"
    job.write_text(text.replace(lora, f"[adalora]\n{ADALORA}\n\n"))
    out_dir = tmp_path / "run"
    _finetune(capsys, job, out_dir, "train.steps=8")  # prune at 3-5, the final ranks at 6
    adapter = out_dir / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["peft_type"] == "ADALORA" and saved["total_step"] == 8
    pattern = saved["rank_pattern"]
    assert len(pattern) == 2 * 2 and sum(map(sum, pattern.values())) == 2 * len(pattern)
    tensors = _tensors(adapter)
    for key, kept in pattern.items():
        module = "base_model.model." + key.removesuffix(".lora_E")
        assert tensors[f"{module}.lora_A"].shape[0] == sum(kept)

    base, model = _three_label_classifiers(bert)
    reference = peft.PeftModel.from_pretrained(base, adapter).eval()
    ids = np.array([[2, 7, 9, 11, 3], [2, 5, 3, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    adapted = peftx.PeftModel.from_pretrained(model, adapter)
    got = np.asarray(adapted(jnp.asarray(ids), jnp.asarray(mask)).logits)
    np.testing.assert_allclose(got, want.logits.numpy(), rtol=0, atol=_tolerance(got))
    untrained = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert np.abs(got - untrained).max() > 100 * _tolerance(got)  # what was trained acts


def _no_model(*args, **kwargs):
    raise AssertionError("the job check let the run load the model")


def test_adalora_target_r_above_init_r_is_refused_by_the_job_check(
    bert, tmp_path, capsys, monkeypatch
):
    """PEFT fails at its first allocation; peftx's job check, before the model loads."""
    monkeypatch.setattr(peftx.models, "from_pretrained", _no_model)
    text = (bert / "job.toml").read_text()
    lora = text[text.index("[lora]") : text.index("[train]")]
    job = bert / f"adalora_{tmp_path.name}.toml"
    job.write_text(text.replace(lora, "[adalora]\ninit_r = 2\ntarget_r = 3\n\n"))
    err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert err == (
        f"peftx: error: {job}: [adalora]: AdaLoRA prunes ranks: target_r=3 must not exceed "
        "init_r=2 to train."
    )
    assert not (tmp_path / "run").exists()


# -- several adapters in mixed batches ------------------------------------------------------


@pytest.mark.command_run
def test_two_adapters_config_trains_and_serves_as_peft(llama, tmp_path, capsys):
    """The two-adapter job on the tiny Llama (the texts become mostly [UNK], still
    learnable): each adapter improves on its own data, and the saved adapters served by
    PyTorch PEFT in one mixed batch give peftx's logits."""
    out_dir = tmp_path / "run"
    sets = (
        f"model.path={llama / 'base'}",
        "train.steps=8",
        "data.max_length=16",
        "train.learning_rate=3e-2",
        "train.eval_every=4",
        "train.eval_batch_size=128",
    )
    out = _finetune(capsys, CONFIGS / "two_adapters_llama_causal.toml", out_dir, *sets)
    summary = json.loads((out_dir / "summary.json").read_text())
    for name in ("stories", "support"):
        before, after = summary["before"][name], summary["after"][name]
        assert after["loss"] < before["loss"] - 0.1, name
        assert f"  {name}: loss {after['loss']:.4g}" in out
        # the base model, evaluated in the same mixed batches, is not trained
        base_before, base_after = (summary[w]["__base__"][name] for w in ("before", "after"))
        assert base_after == pytest.approx(base_before, rel=1e-5)
        assert before["loss"] == pytest.approx(base_before["loss"], rel=1e-5)  # B = 0 at init
    serving = summary["serving"]
    assert serving["rows"] == ["stories", "support", "__base__"]
    assert serving["max_abs_diff"] <= serving["tolerance"] < 1e-3
    eval_rows = [r for r in _records(out_dir) if r["split"] == "eval"]
    assert {(r["adapter"], r["data"]) for r in eval_rows} == {
        (a, d) for a in ("stories", "support", "__base__") for d in ("stories", "support")
    } - {("stories", "support"), ("support", "stories")}
    assert sorted({r["step"] for r in eval_rows}) == [0, 4, 8]

    # PEFT's layout for adapters not named "default": a subfolder each
    adapter = out_dir / "adapter"
    assert not (adapter / "adapter_config.json").exists()
    saved = {n: json.loads((adapter / n / "adapter_config.json").read_text()) for n in
             ("stories", "support")}  # fmt: skip
    assert saved["stories"]["r"] == 16 and saved["support"]["r"] == 8
    # one model card, at the top as PEFT writes it, naming each adapter's data and metrics
    assert [str(p.relative_to(adapter)) for p in adapter.rglob("README.md")] == ["README.md"]
    card = (adapter / "README.md").read_text().splitlines()
    job = CONFIGS / "two_adapters_llama_causal.toml"
    for name, data in (("stories", "tiny_stories"), ("support", "support_intents")):
        assert f"| {name} / train | `{job.parent / 'data' / data / 'train.jsonl'}` |" in card
        assert f"| {name} / loss | {summary['after'][name]['loss']:.6g} |" in card

    # PEFT serves one batch with a row per adapter and one for the base model
    rng = np.random.default_rng(1)
    ids = rng.integers(5, len(WORDS), size=(6, 10))
    names = ["support", "__base__", "stories", "stories", "__base__", "support"]
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    reference = peft.PeftModel.from_pretrained(base, adapter / "stories", adapter_name="stories")
    reference.load_adapter(adapter / "support", adapter_name="support")
    reference.eval()
    with torch.no_grad():
        want = reference(torch.from_numpy(ids), adapter_names=names).logits.numpy()
    model = peftx.PeftModel.from_pretrained(
        peftx.from_pretrained(llama / "base"), adapter / "stories", adapter_name="stories"
    ).load_adapter(adapter / "support", adapter_name="support")
    got = np.asarray(model(jnp.asarray(ids, jnp.int32), adapter_names=names).logits)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    # every row's adapter matters: each adapter's rows differ from the base model's
    with torch.no_grad(), reference.disable_adapter():
        plain = reference(torch.from_numpy(ids)).logits.numpy()
    for row, name in enumerate(names):
        differs = np.abs(want[row] - plain[row]).max() > 100 * _tolerance(want)
        assert differs == (name != "__base__"), (row, name)


TWO = """
[model]
path = "{base}"
task = "causal-lm"

[data]
text_column = "answer"
max_length = 16

[[adapters]]
name = "a"
train = "train.jsonl"
eval = "eval.jsonl"
[adapters.lora]
r = 2

[[adapters]]
name = "b"
train = "train.jsonl"
eval = "eval.jsonl"
[adapters.lora]
r = 4

[train]
batch_size = 4
"""

# the kinds PEFT runs one at a time, never mixed in a batch
UNMIXED = {
    "adalora": "[adapters.adalora]\ninit_r = 4\ntarget_r = 2",
    "lokr": "[adapters.lokr]\nr = 2",
    "loha": "[adapters.loha]\nr = 2",
    "oft": "[adapters.oft]\nr = 2\noft_block_size = 0",
}


@pytest.mark.parametrize(
    "old, new, sets, message",
    [
        ('name = "a"\n', "", (), "[[adapters]][1]: missing 'name'"),
        ('eval = "eval.jsonl"\n[adapters.lora]\nr = 4', '[adapters.lora]\nr = 4', (),
         "[[adapters]][2].eval or data.eval_fraction is needed: the eval data"),
        ('name = "b"', 'name = "a"', (), "[[adapters]][2]: name 'a' is taken by [[adapters]][1]"),
        ('name = "b"', 'name = "__base__"', (),
         "[[adapters]][2]: name '__base__' is not an adapter name"),
        ('name = "b"', 'name = "x/y"', (), "[[adapters]][2]: name 'x/y' is not an adapter name"),
        ('name = "a"', 'name = "a"\ntrian = "x"', (),
         "unknown key 'trian' in [[adapters]][1] of"),
        ("[adapters.lora]\nr = 2", "", (),
         ("[[adapters]][1]: needs exactly one of [adapters.lora], [adapters.adalora], "
          "[adapters.gralora], [adapters.hira], [adapters.ia3], [adapters.lily], "
          "[adapters.loha], [adapters.lokr], [adapters.miss], [adapters.oft], [adapters.vera] "
          "or [adapters.shira], got 0")),
        ("[adapters.lora]\nr = 4", "[adapters.ia3]\ntarget_modules = ['q_proj']", (),
         "[[adapters]][2]: [adapters.ia3] cannot join [adapters.lora] in one model"),
        ("r = 2", "rank = 2", (), "[[adapters]][1]: [adapters.lora]: "),
        ("[train]", "[lora]\nr = 2\n\n[train]", (), "[lora] and [[adapters]] are both given"),
        ("", "", ("data.train=train.jsonl",), "data.train is set per adapter"),
        ("", "", ("train.batch_size=3",),
         "train.batch_size (3) must be a multiple of the number of [[adapters]] (2)"),
        ("", "", ("output.merged=true",), "output.merged merges one adapter"),
        ("", "", ("adapters.name=c",), "[[adapters]] entries are changed in the job file"),
        *[
            ("[adapters.lora]\nr = 2", table, (),
             (f"[[adapters]][1]: [adapters.{kind}] cannot be trained in [[adapters]], which "
              f"mixes its adapters in each batch, as PEFT does not for {kind} adapters; "
              "[[adapters]] trains [adapters.lora], [adapters.ia3], [adapters.vera] together; "
              f"train a {kind} adapter alone, in a job with a [{kind}] table"))
            for kind, table in UNMIXED.items()
        ],
    ],
)  # fmt: skip
def test_adapters_schema_errors(old, new, sets, message, llama, tmp_path, capsys, monkeypatch):
    """Each is refused by the job check, before the model loads."""
    monkeypatch.setattr(peftx.models, "from_pretrained", _no_model)
    job = llama / f"two_{tmp_path.name}.toml"
    text = TWO.format(base=llama / "base")
    assert old in text
    job.write_text(text.replace(old, new, 1))
    err = _error(
        capsys, 2, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}", *_sets(sets)
    )
    assert message in err, err
    assert not (tmp_path / "run").exists()


def _two_classifiers_job(bert, tmp_path, names, rewrite, lora, train):
    """A classification job with two `[[adapters]]` (`lora`, the entries' adapter table):
    `names[0]` on the tiny encoder's data, `names[1]` on `rewrite(rows)` of it, written to
    `tmp_path`; `train` is the `[train]` table's body."""
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (bert / f"{split}.jsonl").read_text().splitlines()]
        write_jsonl(tmp_path / f"{split}.jsonl", rewrite(rows))
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
[model]
path = "{bert / "base"}"
task = "classification"

[data]
text_column = "sentence"
label_column = "intent"
max_length = 16

[[adapters]]
name = "{names[0]}"
train = "{bert / "train.jsonl"}"
eval = "{bert / "eval.jsonl"}"
{lora}
[[adapters]]
name = "{names[1]}"
train = "train.jsonl"
eval = "eval.jsonl"
{lora}
[train]
{train}"""
    )
    return job


@pytest.mark.command_run
def test_two_classifiers_in_mixed_batches_as_peft(bert, tmp_path, capsys):
    """Two classification adapters, each with its own classifier copy (modules_to_save),
    on data whose labels are permuted for the second: each learns its own labelling, and
    PyTorch PEFT serves the saved pair in one mixed batch as peftx does."""
    shift = {"red": "green", "green": "blue", "blue": "red"}
    job = _two_classifiers_job(
        bert,
        tmp_path,
        ("colors", "shifted"),
        lambda rows: [{**r, "intent": shift[r["intent"]]} for r in rows],
        '[adapters.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = ["query", "value"]\n',
        "seed = 3\nbatch_size = 16\neval_batch_size = 32\nlearning_rate = 3e-2\n",
    )
    out_dir = tmp_path / "run"
    _finetune(capsys, job, out_dir, "train.steps=40")
    summary = json.loads((out_dir / "summary.json").read_text())
    for name in ("colors", "shifted"):
        before, after = summary["before"][name], summary["after"][name]
        # below chance (ln 3) for both: one shared head could not learn both labellings
        assert after["loss"] < min(before["loss"], np.log(3)) - 0.2, (name, summary)
        assert after["accuracy"] > before["accuracy"] + 0.2, (name, summary)
    assert summary["serving"]["max_abs_diff"] <= summary["serving"]["tolerance"]
    assert json.loads((out_dir / "labels.json").read_text()) == {
        "colors": ["blue", "green", "red"],
        "shifted": ["blue", "green", "red"],
    }

    adapter = out_dir / "adapter"
    names = ["shifted", "__base__", "colors", "colors", "shifted", "__base__"]
    rows = [json.loads(line) for line in (bert / "eval.jsonl").read_text().splitlines()][:3] * 2
    tok = transformers.AutoTokenizer.from_pretrained(adapter, local_files_only=True)
    enc = tok([r["sentence"] for r in rows], padding=True, return_tensors="np")
    base, model = _three_label_classifiers(bert)
    with torch.no_grad():  # the fresh head of the __base__ rows: the same in both
        base.classifier.weight.copy_(torch.from_numpy(np.array(model.classifier.weight)))
        base.classifier.bias.copy_(torch.from_numpy(np.array(model.classifier.bias)))
    reference = peft.PeftModel.from_pretrained(base, adapter / "colors", adapter_name="colors")
    reference.load_adapter(adapter / "shifted", adapter_name="shifted")
    reference.eval()
    with torch.no_grad():
        want = reference(
            input_ids=torch.from_numpy(enc["input_ids"]),
            attention_mask=torch.from_numpy(enc["attention_mask"]),
            adapter_names=names,
        ).logits.numpy()
    adapted = peftx.PeftModel.from_pretrained(model, adapter / "colors", adapter_name="colors")
    adapted = adapted.load_adapter(adapter / "shifted", adapter_name="shifted")
    batch = {k: jnp.asarray(enc[k], jnp.int32) for k in ("input_ids", "attention_mask")}
    got = np.asarray(
        peftx.train.logits(adapted, {**batch, "adapter_ids": adapted.adapter_ids(names)})
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    # the same text gives other logits through another adapter or the base
    for a, b in [(0, 3), (1, 4), (2, 5)]:
        assert np.abs(want[a] - want[b]).max() > 100 * _tolerance(want), (names[a], names[b])


def test_classifiers_with_different_label_counts_are_refused(bert, tmp_path, capsys):
    """The adapters of one job share the classification head's size: a second dataset
    with fewer classes is one line naming both files, before any training."""
    job = _two_classifiers_job(
        bert,
        tmp_path,
        ("three", "two"),
        lambda rows: [r for r in rows if r["intent"] != "red"],
        '[adapters.lora]\nr = 2\ntarget_modules = ["query"]\n',
        "batch_size = 4\n",
    )
    err = _error(capsys, 2, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert f"{tmp_path / 'train.jsonl'} has 2 labels, {bert / 'train.jsonl'} 3" in err, err
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.command_run
def test_failed_serving_check_saves_no_adapter(llama, tmp_path, capsys, monkeypatch):
    """A mixed batch that differs from the adapters run alone beyond the tolerance fails
    the job (the check's result doubled past it here), and no adapter is written."""
    job = tmp_path / "two.toml"
    text = TWO.format(base=llama / "base")
    job.write_text(text.replace('"train.jsonl"', f'"{llama / "train.jsonl"}"').replace(
        '"eval.jsonl"', f'"{llama / "eval.jsonl"}"'))  # fmt: skip
    checked = peftx.train._fit._serving_check

    def over(*args):
        check = checked(*args)
        return {**check, "max_abs_diff": 2 * check["tolerance"]}

    monkeypatch.setattr(peftx.train._fit, "_serving_check", over)
    out_dir = tmp_path / "run"
    err = _error(capsys, 1, "finetune", job, "--set", f"output.dir={out_dir}", "--set",
                 "train.steps=1")  # fmt: skip
    assert "serving check failed: a mixed batch differs from each adapter run alone by" in err
    assert not (out_dir / "adapter").exists() and not (out_dir / "summary.json").exists()
