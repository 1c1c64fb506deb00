"""`peftx finetune` with `[bank]`: a job's `[[adapters]]`, each on its own data, trained as
one adapter bank; each saved in PEFT's layout, loaded by PyTorch PEFT to peftx's logits;
the job check refuses what a bank cannot train before the output directory is touched."""

import contextlib
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FILLER, WORDS, run_cli, write_jsonl

import peftx
from peftx import train
from peftx.cli import main
from peftx.cli._job import Bank, Job

# three adapters, each its own way of going on from the prompt's last word: by 1, by 2,
# and back by 1; ranks 2, 4 and 8, the last rsLoRA, on nested targets
LORA = "[adapters.lora]\n"
ADAPTERS = [
    (
        "default",
        1,
        LORA + 'r = 2\nlora_alpha = 4\ntarget_modules = ["q_proj", "v_proj", "down_proj"]',
    ),
    ("skip", 2, LORA + 'r = 4\nlora_alpha = 4\ntarget_modules = ["q_proj", "v_proj"]'),
    ("back", -1, LORA + 'r = 8\nlora_alpha = 8\nuse_rslora = true\ntarget_modules = ["v_proj"]'),
]
CONFIGS = Path(__file__).parents[1] / "configs"
BANK = "[bank]\nmax_adapters = 4\n"
NAMES = [name for name, _, _ in ADAPTERS]


def _rows(rng: np.random.Generator, step: int, n: int) -> list[dict]:
    """Prompts of three filler words and a word, continued by 5 words `step` apart."""
    low, high = (5, len(WORDS) - 5 * step) if step > 0 else (5 - 5 * step, len(WORDS))
    rows = []
    for _ in range(n):
        start = int(rng.integers(low, high))
        prompt = " ".join(rng.choice(FILLER, 3)) + f" {WORDS[start]}"
        text = " ".join(WORDS[start + step * k] for k in range(1, 6))
        rows.append({"question": prompt, "answer": text})
    return rows


def _job(root, *, bank=BANK, adapters=ADAPTERS, head='task = "causal-lm"', extra=""):
    """A job on the tiny Llama with an `[[adapters]]` entry per `adapters` (name, step,
    adapter table), each with its own data files, and `bank` after them."""
    rng = np.random.default_rng(0)
    entries = []
    for name, step, table in adapters:
        write_jsonl(root / f"{name}_train.jsonl", _rows(rng, step, 48))
        write_jsonl(root / f"{name}_eval.jsonl", _rows(rng, step, 12))
        entries.append(
            f'[[adapters]]\nname = "{name}"\ntrain = "{name}_train.jsonl"\n'
            f'eval = "{name}_eval.jsonl"\n{table}\n'
        )
    text = (
        f'[model]\npath = "base"\n{head}\n\n'
        '[data]\ntext_column = "answer"\nprompt_column = "question"\nmax_length = 16\n\n'
        + "\n".join(entries)
        + f"\n{bank}\n"
        + "[train]\nbatch_size = 12\nsteps = 12\nlearning_rate = 5e-2\nlog_every = 4\n"
        + 'schedule = "constant"\neval_every = 4\ncheckpoint_every = 4\n'
        + extra
    )
    path = root / "bank_job.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def bank_run(llama, tmp_path_factory):
    """The output dir of the three-adapter bank job on the tiny Llama, and what it printed."""
    root = tmp_path_factory.mktemp("bank_job")
    (root / "base").symlink_to(llama / "base")
    out_dir = root / "run"
    argv = ["finetune", _job(root), "--set", f"output.dir={out_dir}"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main([str(a) for a in argv])
    assert code == 0, err.getvalue()
    return out_dir, stdout.getvalue()


@pytest.mark.command_run
def test_a_bank_job_trains_each_adapter_on_its_own_data(bank_run):
    out_dir, out = bank_run
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 12
    for name in NAMES:
        before, after = summary["before"][name], summary["after"][name]
        assert after["loss"] < before["loss"] - 0.1, name
        assert before["loss"] == pytest.approx(summary["before"]["__base__"][name]["loss"])
        assert f"  {name}: loss {after['loss']:.4g}" in out
    serving = summary["serving"]
    assert serving["rows"] == [*NAMES, "__base__"]
    assert serving["max_abs_diff"] <= serving["tolerance"] < 1e-3
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records if r["split"] == "eval"}) == [0, 4, 8, 12]
    assert not (out_dir / "checkpoints").exists()  # written at steps 4 and 8, removed at the end


@pytest.mark.command_run
def test_a_bank_job_writes_three_adapters_peft_loads(bank_run, llama):
    """PEFT's layout ("default" at the root, the others in their subfolders), each
    adapter of its own rank; PyTorch PEFT gives, adapter by adapter, the logits of the
    adapters loaded into a peftx bank and served in one mixed batch."""
    import peft
    import torch
    import transformers

    out_dir, out = bank_run
    adapter = out_dir / "adapter"
    dirs = {name: adapter if name == "default" else adapter / name for name in NAMES}
    for name, r in zip(NAMES, (2, 4, 8), strict=True):
        config = json.loads((dirs[name] / "adapter_config.json").read_text())
        assert config["r"] == r and config["use_rslora"] == (name == "back")
        assert f"adapter {name!r} (PEFT format): {dirs[name]}" in out
    # one model card for the bank, at the top (as PEFT writes it), naming every adapter
    assert [str(p.relative_to(adapter)) for p in adapter.rglob("README.md")] == ["README.md"]
    card = (adapter / "README.md").read_text()
    assert all(f"### `{name}`: LORA, in " in card for name in NAMES)

    rows = ["back", "__base__", "default", "skip", "default", "back"]
    ids = np.random.default_rng(1).integers(5, len(WORDS), size=(len(rows), 10))
    bank = peftx.PeftModel.from_pretrained(
        peftx.from_pretrained(llama / "base"), dirs["default"], max_adapters=4, max_rank=8
    )
    for name in NAMES[1:]:
        bank = bank.load_adapter(dirs[name], adapter_name=name)
    got = np.asarray(bank(jnp.asarray(ids, jnp.int32), adapter_names=rows).logits)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    plain = base(torch.from_numpy(ids)).logits.detach().numpy()
    for name in NAMES:
        reference = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(llama / "base"), dirs[name]
        ).eval()
        with torch.no_grad():
            want = reference(torch.from_numpy(ids)).logits.numpy()
        for row in (i for i, n in enumerate(rows) if n == name):
            np.testing.assert_allclose(got[row], want[row], rtol=0, atol=1e-4)
            assert np.abs(want[row] - plain[row]).max() > 1e-2, name  # it was trained
    np.testing.assert_allclose(got[1], plain[1], rtol=0, atol=1e-4)


@pytest.mark.command_run  # two `fit` runs end to end
def test_a_bank_resumes_from_its_checkpoint_bit_for_bit(llama, tmp_path):
    """A bank's checkpoint (step 2 of 4; its adapters in PEFT's layout) restores: `fit`
    resumed from it reaches the weights of a run never stopped, bit for bit (dropout's
    key and the data position included)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama / "base")
    rng = np.random.default_rng(0)
    data = []
    for _, step, _ in ADAPTERS[:2]:
        rows = _rows(rng, step, 16)
        texts, prompts = [r["answer"] for r in rows], [r["question"] for r in rows]
        data.append(train.encode_causal_lm(tokenizer, texts, prompts, max_length=16))
    config = peftx.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    key = jax.random.key(0)
    model = peftx.get_peft_model(
        peftx.from_pretrained(llama / "base"), config, key=key, adapter_name="a", max_adapters=3
    ).add_adapter("b", peftx.LoraConfig(r=1, target_modules=["v_proj"]), key=key)
    settings = dict(
        steps=4, batch_size=4, adapters=["a", "b"], learning_rate=3e-2, log_every=2, key=key
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        whole = train.fit(model, data, data, **settings)
        stopped = tmp_path / "stopped"
        train.fit(model, data, data, **settings, checkpoint_every=2, out=stopped)
        assert (stopped / "checkpoints" / "checkpoint-00000002").is_dir()
    with (
        contextlib.redirect_stdout(io.StringIO()) as out,
        contextlib.redirect_stderr(io.StringIO()),
    ):
        resumed = train.fit(model, data, data, **settings, out=stopped, resume=True)
    assert "resuming from" in out.getvalue() and "(step 2 of 4)" in out.getvalue()
    saved = peftx.PeftModel.from_pretrained(
        peftx.from_pretrained(llama / "base"),
        stopped / "checkpoints" / "checkpoint-00000002" / "b",
    )
    assert saved.peft_config["default"].r == 1  # the checkpoint's adapters, in PEFT's layout
    for x, y in zip(jax.tree.leaves(whole.model), jax.tree.leaves(resumed.model), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def _no_model(*args, **kwargs):
    raise AssertionError("the job check let the run load the model")


IA3 = [(name, step, '[adapters.ia3]\ntarget_modules = ["v_proj"]') for name, step, _ in ADAPTERS]
DORA = [ADAPTERS[0], (ADAPTERS[1][0], 2, ADAPTERS[1][2] + "\nuse_dora = true"), ADAPTERS[2]]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bank="[bank]\nmax_adapters = 2\n"),
         "bank.max_adapters (2) is less than the 3 [[adapters]]: the bank needs a slot for each"),
        (dict(adapters=IA3),
         ("[[adapters]][1] ('default') cannot go in the [bank]: a bank holds LoRA adapters "
         "(LoraConfig, rsLoRA or not), on Linear weights and on experts; got a IA3Config.")),
        (dict(adapters=DORA),
         ("[[adapters]][2] ('skip') cannot go in the [bank]: a bank holds plain LoRA and rsLoRA, "
         "on Linear weights and on experts; this config has use_dora=True.")),
        (dict(bank=BANK + "max_rank = 4\n"),
         ("[[adapters]][3] ('back') cannot go in the [bank]: adapter rank 8 exceeds the bank's "
         "max_rank=4")),
        (dict(bank=BANK + "max_adapter = 4\n"),
         "unknown key 'max_adapter' in [bank] of"),
        (dict(bank="[bank]\nmax_rank = 8\n"),
         "[bank] needs max_adapters, its number of slots (at least the 3 [[adapters]])"),
        (dict(bank="[bank]\nmax_adapters = true\n"),
         "bank.max_adapters must be a positive integer, got True"),
        (dict(bank=BANK + "max_rank = 0\n"), "bank.max_rank must be a positive integer, got 0"),
        (dict(head='task = "classification"'), '[bank] needs model.task = "causal-lm"'),
    ],
)  # fmt: skip
def test_bad_bank_jobs_are_refused_before_the_model_loads(
    change, message, llama, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(peftx.models, "from_pretrained", _no_model)
    (tmp_path / "base").symlink_to(llama / "base")
    job = _job(tmp_path, **change)
    code, out, err = run_cli(capsys, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("peftx: error: "), err
    assert message in err, err
    assert not (tmp_path / "run").exists()


def test_a_job_without_adapters_entries_cannot_have_a_bank(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(peftx.models, "from_pretrained", _no_model)
    job = llama / f"bank_{tmp_path.name}.toml"
    job.write_text((llama / "job.toml").read_text() + "\n" + BANK)
    code, out, err = run_cli(capsys, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2, (out, err)
    assert "[bank] trains the job's [[adapters]] entries as one bank; this job has none" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_an_adapter_on_layers_the_bank_lacks_is_refused_before_the_output(llama, tmp_path, capsys):
    """A bank holds the layers its first adapter targets: the model shows which those
    are, still before the output directory is touched."""
    (tmp_path / "base").symlink_to(llama / "base")
    wider = [ADAPTERS[2], ADAPTERS[1]]  # q_proj after a bank of v_proj only
    job = _job(tmp_path, adapters=wider, bank="[bank]\nmax_adapters = 2\n")
    code, out, err = run_cli(capsys, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2, (out, err)
    assert "[[adapters]][2] cannot join the [bank]: adapter 'skip' adapts " in err, err
    assert "(the bank's layers are those [[adapters]][1], 'back', targets)" in err
    assert not (tmp_path / "run").exists()


def test_the_bank_config_is_a_job_of_three_adapters_in_a_bank(llama, capsys):
    """configs/bank_llama_causal.toml on the tiny Llama (MODEL_DIR in place of its
    model.path): the job check passes, its bank has the entries' largest r, and
    `peftx inspect` lists each adapter."""
    job = CONFIGS / "bank_llama_causal.toml"
    parsed = Job(job, [f"model.path={llama / 'base'}"])
    assert [a.name for a in parsed.adapters] == ["stories", "support", "support_small"]
    assert parsed.bank == Bank(max_adapters=4, max_rank=16)
    code, out, err = run_cli(capsys, "inspect", llama / "base", job)
    assert code == 0, err
    assert [s.split("'")[0] for s in out.split("\nadapter '")[1:]] == [
        a.name for a in parsed.adapters
    ]
