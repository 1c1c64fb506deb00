"""`fit(keep_best=..., early_stopping_patience=...)` and `[train] keep_best`: a run whose
eval loss falls and then rises returns (and `peftx finetune` writes) the adapter of its
best evaluation, stops once the patience runs out, and keeps the best across a resume."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
import transformers
from helpers import CLASSES, FILLER, as_users_run, run_cli, write_jsonl

import peftx
from peftx import train

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
SETTINGS = dict(
    steps=60, batch_size=8, learning_rate=2e-2, schedule="constant", eval_every=5,
    log_every=5, keep_best="eval_loss", early_stopping_patience=3,
)  # fmt: skip


def _rows(rng, n, second):
    """Prompts of filler words; answers of a red word and then a word of `second`: trained
    on red-red, a model first gets better at red-blue's red, then worse at its blue."""
    prompts = [" ".join(rng.choice(FILLER, 3)) for _ in range(n)]
    texts = [f"{rng.choice(CLASSES['red'])} {rng.choice(CLASSES[second])}" for _ in range(n)]
    return texts, prompts


@pytest.fixture(scope="module")
def job(llama):
    tok = transformers.AutoTokenizer.from_pretrained(llama / "base")
    rng = np.random.default_rng(0)
    (tt, tp), (et, ep) = _rows(rng, 64, "red"), _rows(rng, 16, "blue")
    data = (
        train.encode_causal_lm(tok, tt, tp, max_length=16),
        train.encode_causal_lm(tok, et, ep, max_length=16),
    )
    base = peftx.models.from_pretrained(llama / "base")
    return base, data, (tt, tp, et, ep)


def _fit(base, data, out, **changes):
    model = peftx.get_peft_model(base, peftx.LoraConfig(**LORA), key=jax.random.key(0))
    with jax.numpy_dtype_promotion("standard"):
        return train.fit(model, *data, out=out, key=jax.random.key(1), **{**SETTINGS, **changes})


@pytest.fixture(scope="module")
def whole(job, tmp_path_factory):
    """The run never stopped (checkpoints every 10 steps), and its directory."""
    base, data, _ = job
    out = tmp_path_factory.mktemp("whole")
    return _fit(base, data, out, checkpoint_every=10), out


def _evals(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "eval"}


def _tensors(path):
    return safetensors.numpy.load_file(str(path / "adapter_model.safetensors"))


def test_the_best_evaluation_is_kept_and_the_run_stops_after_its_patience(job, whole):
    _, data, _ = job
    result, out = whole
    evals = _evals(out)
    trained = {step: loss for step, loss in evals.items() if step > 0}
    best = min(trained, key=trained.get)
    assert 0 < best < max(trained), evals  # the loss fell, then rose
    assert result.best_step == best
    assert result.steps == max(trained) == best + 3 * 5 < 60  # three evaluations, no better
    # the model returned is the best step's: evaluated again, its loss is that step's
    eval_step = train.make_eval_step(train.causal_lm_loss)
    sums = {}
    trainable, frozen = peftx.partition(result.model)
    for batch in train.eval_batches(data[1], 64):
        for k, v in eval_step(trainable, frozen, batch).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    assert abs(sums["loss"] / sums["count"] - evals[best]) < 1e-5
    assert result.after["loss"] == evals[best]


def test_a_resumed_run_keeps_the_best_so_far(job, whole, tmp_path):
    """A run killed after a checkpoint past its best evaluation (simulated: a run of 35
    steps at a constant rate, checkpoints every 10, is the longer run's first 35 steps)
    and resumed ends as the whole run does, bit for bit, with the best adapter."""
    base, data, _ = job
    whole, whole_dir = whole
    whole.model.save_pretrained(tmp_path / "adapter")
    _fit(base, data, tmp_path / "killed", steps=35, checkpoint_every=10,
         early_stopping_patience=None)  # fmt: skip
    assert (tmp_path / "killed" / "checkpoints" / "checkpoint-00000030").is_dir()
    resumed = _fit(base, data, tmp_path / "killed", checkpoint_every=10, resume=True)
    resumed.model.save_pretrained(tmp_path / "killed" / "adapter")
    assert whole.best_step == resumed.best_step < 30  # the best came before the checkpoint
    assert (whole.steps, whole.after) == (resumed.steps, resumed.after)
    got, want = _tensors(tmp_path / "killed" / "adapter"), _tensors(tmp_path / "adapter")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    assert _evals(tmp_path / "killed") == _evals(whole_dir)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"keep_best": "eval_bleu"},
            "keep_best: the evaluation has no metric 'bleu'; it has loss, perplexity",
        ),
        ({"keep_best": None}, "go with keep_best"),
        ({"eval_every": None}, "early_stopping_patience counts evaluations: set eval_every"),
        ({"early_stopping_patience": 0}, "early_stopping_patience must be an int >= 1"),
    ],
)
def test_bad_settings_are_refused_before_training(job, changes, match, tmp_path):
    base, data, _ = job
    with as_users_run(), pytest.raises(ValueError, match=match):
        _fit(base, data, tmp_path / "run", **changes)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.command_run
def test_the_command_writes_the_best_adapter_and_says_its_step(job, llama, tmp_path, capsys):
    _, _, (tt, tp, et, ep) = job
    write_jsonl(tmp_path / "train.jsonl", [{"q": p, "a": t} for t, p in zip(tt, tp)])
    write_jsonl(tmp_path / "eval.jsonl", [{"q": p, "a": t} for t, p in zip(et, ep)])
    (tmp_path / "job.toml").write_text(
        f"""
[model]
path = "{llama / "base"}"
task = "causal-lm"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
prompt_column = "q"
text_column = "a"
max_length = 16
[lora]
r = 4
lora_alpha = 8
target_modules = ["q_proj", "v_proj", "down_proj"]
[train]
steps = 60
batch_size = 8
learning_rate = 2e-2
schedule = "constant"
eval_every = 5
log_every = 5
keep_best = "eval_loss"
early_stopping_patience = 3
[output]
dir = "run"
"""
    )
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    evals = _evals(tmp_path / "run")
    trained = {s: v for s, v in evals.items() if s > 0}
    assert summary["best_step"] == min(trained, key=trained.get)
    assert summary["steps"] == max(trained) < 60
    assert summary["after"]["loss"] == evals[summary["best_step"]]
    assert "stopped early at step" in out


def test_a_job_naming_an_unknown_metric_fails_in_one_line(llama, tmp_path, capsys):
    job = (
        (llama / "job.toml").read_text().replace("[train]", '[train]\nkeep_best = "eval_accuracy"')
    )
    (tmp_path / "job.toml").write_text(job.replace('path = "base"', f'path = "{llama / "base"}"'))
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 2 and err.count("\n") == 1, err
    want = "train.keep_best = 'eval_accuracy' is not an eval metric of this job; choose one of"
    assert f"{want} eval_loss, eval_perplexity" in err
