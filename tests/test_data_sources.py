"""Data sources: `[data] train` and `eval` as a Parquet file, a `datasets.Dataset.save_to_disk`
directory or a `datasets` spec read offline give the rows (and train the adapter, bit for
bit) their JSONL file gives, for every task; `[data] eval_fraction` draws the eval rows from
the train rows by `[train] seed`; `job.json` records each source, so a resumed run is on
the same data; and a bad source is one line naming it."""

import json
import math
import re
import shutil
import socket
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.numpy
import transformers
from helpers import as_users_run, run_cli, write_jsonl

from peftx import train
from peftx.cli import main
from peftx.cli._common import UsageError
from peftx.cli._finetune import _datasets
from peftx.cli._job import Job
from peftx.cli._run_dir import JOB, MARKER, plan_output

# each source, as a job's TOML gives it, of the rows written to `NAME.jsonl` by `_write`
KINDS = {
    "jsonl": '"{name}.jsonl"',
    "parquet": '"{name}.parquet"',
    "saved": '"{name}_saved"',
    "spec": '{{dataset = "json", data_files = "{name}.jsonl", split = "train"}}',
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }} {{ m.content }} eot {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@pytest.fixture(autouse=True, scope="module")
def _own_datasets_cache(tmp_path_factory):
    """`load_dataset` writes Arrow files into the datasets cache: the tests' own. And
    no progress bars (saving, loading), which would come between a command's lines."""
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets"))
        yield
    if shown:
        datasets.enable_progress_bars()


def _write(root: Path, name: str, rows: list[dict]) -> None:
    """`rows` as `NAME.jsonl`, `NAME.parquet` and the save_to_disk directory `NAME_saved`."""
    write_jsonl(root / f"{name}.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), root / f"{name}.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / f"{name}_saved"))


def _source(kind: str, name: str) -> str:
    return KINDS[kind].format(name=name)


def _job(root: Path, base: Path, task: str, source: str, body: str) -> Path:
    """`root/job.toml`: `[model]` the checkpoint `base` and `task`, `[data]` with `source`
    (a TOML value) to train and evaluate on, then `body` (more `[data]` keys, tables)."""
    job = f'[model]\npath = "{base}"\ntask = "{task}"\n[data]\ntrain = {source}\n'
    (root / "job.toml").write_text(job + f"eval = {source}\n{body}")
    return root / "job.toml"


def _llama_rows(llama: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (llama / f"{name}.jsonl").read_text().splitlines()]


def _llama_job(llama: Path, root: Path, kind: str, *, eval: bool = True) -> Path:
    """The `llama` fixture's causal-LM job, its data in `root` as `kind`."""
    for name in ("train", "eval"):
        if not (root / f"{name}.jsonl").exists():
            _write(root, name, _llama_rows(llama, name))
    job = (llama / "job.toml").read_text().replace('path = "base"', f'path = "{llama / "base"}"')
    job = job.replace('train = "train.jsonl"', f"train = {_source(kind, 'train')}")
    job = job.replace('eval = "eval.jsonl"\n', f"eval = {_source(kind, 'eval')}\n" if eval else "")
    (root / "job.toml").write_text(job)
    return root / "job.toml"


def _tensors(adapter: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(adapter / "adapter_model.safetensors"))


def _one_error(capsys, code: int, *argv) -> str:
    """The one line a failing command writes, all it writes, with exit status `code`."""
    got, out, err = run_cli(capsys, *argv)
    assert got == code and err.startswith("peftx: error: ") and err.count("\n") == 1, (out, err)
    return err


# -- read_records --------------------------------------------------------------------------

ROWS = [
    {"text": "w5 w6", "label": 1, "messages": [{"role": "user", "content": "w7"}]},
    {"text": "w8", "label": 0, "messages": [{"role": "assistant", "content": "w9 w10"}]},
    {"text": "", "label": 2, "messages": [{"role": "user", "content": "w11"}]},
]


def test_read_records_gives_the_jsonls_rows_from_every_source(tmp_path):
    _write(tmp_path, "rows", ROWS)
    columns = ["text", "label", "messages"]
    want = train.read_records(tmp_path / "rows.jsonl", columns)
    assert want == ROWS
    assert train.read_records(tmp_path / "rows.parquet", columns) == want
    assert train.read_records(str(tmp_path / "rows_saved"), columns) == want
    assert train.read_records(datasets.Dataset.from_list(ROWS), columns) == want
    spec = train.load_local_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train")
    assert isinstance(spec, datasets.Dataset) and train.read_records(spec, columns) == want
    # a Dataset's selection and order (its indices), not its Arrow table's
    picked = datasets.Dataset.from_list(ROWS).select([2, 0])
    assert train.read_records(picked, ["text"]) == [ROWS[2], ROWS[0]]


def test_read_records_names_the_source_and_column_at_fault(tmp_path, monkeypatch):
    _write(tmp_path, "rows", ROWS)
    parquet = tmp_path / "rows.parquet"
    with pytest.raises(
        ValueError,
        match=rf"data file '{parquet}' has no column 'answer'; its columns are "
        r"\['label', 'messages', 'text'\]",
    ):
        train.read_records(parquet, ["text", "answer"])
    saved = tmp_path / "rows_saved"
    with pytest.raises(ValueError, match=rf"data directory '{saved}' has no column 'answer'"):
        train.read_records(saved, ["answer"])
    with pytest.raises(ValueError, match=r"the dataset has no column 'answer'"):
        train.read_records(datasets.Dataset.from_list(ROWS), ["answer"])
    with pytest.raises(ValueError, match=r"the dataset has no rows"):
        train.read_records(datasets.Dataset.from_list(ROWS).select([]), ["text"])

    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(TypeError, match=r"holds the splits \['train'\]: pass one"):
        train.read_records(both, ["text"])
    both.save_to_disk(str(tmp_path / "both"))
    with pytest.raises(ValueError, match=r"holds a datasets.DatasetDict \(splits train\); name"):
        train.read_records(tmp_path / "both", ["text"])
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"'.*plain' is not one datasets.Dataset.save_to_disk"):
        train.read_records(tmp_path / "plain", ["text"])
    (tmp_path / "rows.txt").write_text("w5\n")
    with pytest.raises(ValueError, match=r"expected a .jsonl, .csv or .parquet file, or a dir"):
        train.read_records(tmp_path / "rows.txt", ["text"])
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"'.*bad.parquet' is not a readable Parquet file"):
        train.read_records(tmp_path / "bad.parquet", ["text"])
    with pytest.raises(TypeError, match=r"a path \(str or Path\) or a datasets.Dataset, got"):
        train.read_records(ROWS, ["text"])

    # without the packages: one line naming what to install
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs the pyarrow package: pip install pya"):
        train.read_records(parquet, ["text"])
    with pytest.raises(ModuleNotFoundError, match=r"needs the datasets package: pip install d"):
        train.read_records(saved, ["text"])
    with pytest.raises(ModuleNotFoundError, match=r"needs the datasets package: pip install d"):
        train.load_local_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train")


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_dataset_not_in_the_local_cache_fails_without_the_network(no_network, tmp_path):
    offline = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(
        FileNotFoundError,
        match=r"dataset 'peftx-tests/not-cached' \(split 'train'\) is neither local nor in the "
        r"datasets cache \(.*\), and peftx loads datasets offline",
    ):
        train.load_local_dataset("peftx-tests/not-cached", split="train")
    assert datasets.config.HF_HUB_OFFLINE == offline  # as it was
    with pytest.raises(FileNotFoundError, match=r"Unable to find '.*missing.jsonl'"):
        train.load_local_dataset("json", data_files=str(tmp_path / "missing.jsonl"), split="train")
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"\(split 'test'\): Unknown split \"test\""):
        train.load_local_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="test")


# -- the same job from each source ---------------------------------------------------------


@pytest.fixture(scope="module")
def jsonl_run(llama, tmp_path_factory):
    """The adapter the `llama` job trains in 4 steps from its JSONL files."""
    root = tmp_path_factory.mktemp("jsonl_run")
    argv = ["finetune", str(_llama_job(llama, root, "jsonl")), "--set", f"output.dir={root}/run"]
    assert main(argv + SHORT) == 0
    return _tensors(root / "run" / "adapter")


SHORT = ["--set", "train.steps=4", "--set", "output.merged=false"]


@pytest.mark.parametrize(
    "kind",
    [
        "parquet",
        pytest.param("saved", marks=pytest.mark.command_run),
        pytest.param("spec", marks=pytest.mark.command_run),
    ],
)
def test_the_same_job_from_each_source_trains_the_same_adapter(
    kind, llama, jsonl_run, tmp_path, capsys, monkeypatch
):
    job = _llama_job(llama, tmp_path, kind)
    monkeypatch.chdir(tmp_path.parent)  # relative paths are the job file's, not the cwd's
    code, out, err = run_cli(
        capsys, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}", *SHORT
    )
    assert code == 0, (out, err)
    train_source = {
        "parquet": str(tmp_path / "train.parquet"),
        "saved": str(tmp_path / "train_saved"),
        "spec": f'{{dataset = "json", data_files = "{tmp_path / "train.jsonl"}", split = "train"}}',
    }[kind]
    assert re.search(rf"supervised tokens: \d+ in {re.escape(train_source)}, ", out), out
    got = _tensors(tmp_path / "run" / "adapter")
    assert got.keys() == jsonl_run.keys()
    assert any("lora_B" in k and np.abs(v).max() > 0 for k, v in got.items())  # trained
    for name, want in jsonl_run.items():
        assert got[name].tobytes() == want.tobytes(), name
    # job.json records the source: a file's bytes, a directory's or spec's files
    record = json.loads((tmp_path / "run" / JOB).read_text())["data_files"][train_source]
    if kind == "parquet":
        assert record["bytes"] == (tmp_path / "train.parquet").stat().st_size
    else:
        files = {
            "saved": sorted(str(p) for p in (tmp_path / "train_saved").iterdir()),
            "spec": [str(tmp_path / "train.jsonl")],
        }[kind]
        assert sorted(record["files"]) == files
        assert all(r["bytes"] == Path(f).stat().st_size for f, r in record["files"].items())


def test_a_specs_paths_are_taken_from_the_job_file(llama, tmp_path, monkeypatch):
    """Relative `data_files` are taken from the job file's directory (from the current
    one with `--set`), as every path of a job; a `dataset` that names a local directory
    is taken from there, and its `data_files` are within it, as in `datasets`."""
    job = _llama_job(llama, tmp_path, "spec")
    here = tmp_path / "here"
    (here / "local").mkdir(parents=True)
    write_jsonl(here / "local" / "rows.jsonl", ROWS)
    monkeypatch.chdir(here)
    (adapter,) = Job(job, []).adapters
    assert adapter.train.data_files == str(tmp_path / "train.jsonl")
    spec = '{dataset = "json", data_files = ["rows.jsonl", "more.jsonl"], split = "train"}'
    (adapter,) = Job(job, [f"data.train={spec}"]).adapters
    assert adapter.train.data_files == (str(here / "rows.jsonl"), str(here / "more.jsonl"))
    (adapter,) = Job(
        job, ['data.eval={dataset = "local", data_files = "rows.jsonl", split = "train"}']
    ).adapters
    assert (adapter.eval.dataset, adapter.eval.data_files) == (str(here / "local"), "rows.jsonl")
    assert train.read_records(adapter.eval.load(), ["text"]) == ROWS
    assert str(adapter.eval) == (
        f'{{dataset = "{here / "local"}", data_files = "rows.jsonl", split = "train"}}'
    )


@pytest.mark.parametrize("kind", ["saved", "spec"])
def test_a_run_resumes_only_on_the_same_data(kind, llama, tmp_path):
    """A run's directory of checkpoints goes on only while its data is as `job.json`
    recorded it: a directory's files, a spec's `data_files`."""
    job = _llama_job(llama, tmp_path, kind)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / MARKER).write_text("{}")
    (out / JOB).write_text(json.dumps(Job(job, []).resolved()))

    def plan() -> str:
        return plan_output(out, Job(job, []).resolved(), overwrite=False, protected=[])

    assert plan() == "resume"
    rows = _llama_rows(llama, "train")
    rows[0] = {**rows[0], "answer": rows[0]["answer"] + " w9"}
    changed = tmp_path / ("train_saved" if kind == "saved" else "train.jsonl")
    if kind == "saved":
        shutil.rmtree(changed)
        datasets.Dataset.from_list(rows).save_to_disk(str(changed))
        file = next(changed.glob("data-*.arrow"))
    else:
        write_jsonl(changed, rows)
        file = changed
    with pytest.raises(
        UsageError,
        match=rf"holds checkpoints of a run on data '.*' as it was then; its file "
        rf"'{re.escape(str(file))}' "
        r"has changed since \(\d+ bytes, sha256 \w+ then, \d+ bytes, sha256 \w+ now\): put it "
        "back to resume",
    ):
        plan()


def test_output_dir_may_not_lie_inside_a_data_directory(llama, tmp_path, capsys):
    job = _llama_job(llama, tmp_path, "saved")
    out = tmp_path / "train_saved" / "run"
    err = _one_error(capsys, 2, "finetune", job, "--set", f"output.dir={out}")
    assert f"output.dir '{out}' lies inside the data directory '{tmp_path / 'train_saved'}'" in err
    assert not out.exists()


# -- every task ------------------------------------------------------------------------------


def _classification():
    return [{"sentence": f"w{k} w{k + 1}", "intent": ["red", "blue"][k % 2]} for k in range(5, 25)]


def _chats():
    return [
        {
            "messages": [
                {"role": "user", "content": f"w{k}"},
                {"role": "assistant", "content": f"w{k + 1}"},
            ]
        }
        for k in range(5, 25)
    ]


def _pairs():
    return [
        {"question": f"w{k} w{k + 1}", "good": f" w{k + 2}", "bad": f" w{k + 3} w9"}
        for k in range(5, 25)
    ]


# each task: its rows, `[model] task`, and the rest of its job after `[data]`'s sources
TASKS = {
    "classification": (
        _classification,
        "classification",
        'text_column = "sentence"\nlabel_column = "intent"\n[lora]\ntarget_modules = ["query"]\n',
    ),
    "causal-lm messages": (
        _chats,
        "causal-lm",
        'messages_column = "messages"\n[lora]\ntarget_modules = ["q_proj"]\n',
    ),
    "dpo": (
        _pairs,
        "causal-lm",
        (
            'prompt_column = "question"\nchosen_column = "good"\nrejected_column = "bad"\n'
            '[lora]\ntarget_modules = ["q_proj"]\n[train]\nobjective = "dpo"\n'
        ),
    ),
}


@pytest.mark.parametrize("kind", ["parquet", "saved", "spec"])
@pytest.mark.parametrize("task", TASKS)
def test_every_task_reads_each_source_as_its_jsonl(task, kind, bert, llama, tmp_path, capsys):
    rows, model_task, body = TASKS[task]
    base = (bert if task == "classification" else llama) / "base"
    tokenizer = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    _write(tmp_path, "rows", rows())
    encoded = {}
    for k in ("jsonl", kind):
        job = _job(tmp_path, base, model_task, _source(k, "rows"), body)
        encoded[k] = _datasets(Job(job, []), tokenizer)
    (pairs, labels), (want_pairs, want_labels) = encoded[kind], encoded["jsonl"]
    assert labels == want_labels
    for got, want in zip(pairs[0], want_pairs[0], strict=True):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (pairs[0][0]["labels"] != -100).any()  # something to learn from


# -- eval_fraction -------------------------------------------------------------------------


def _fraction_job(llama, root, *sets) -> Job:
    return Job(_llama_job(llama, root, "jsonl", eval=False), ["data.pack=false", *sets])


def test_eval_fraction_draws_the_eval_rows_by_the_seed(llama, tmp_path, capsys):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama / "base", local_files_only=True)

    def split(seed: int) -> tuple[dict, dict]:
        job = _fraction_job(llama, tmp_path, "data.eval_fraction=0.2", f"train.seed={seed}")
        (pair,), _ = _datasets(job, tokenizer)
        return pair

    first, again, other = split(0), split(0), split(1)
    out = capsys.readouterr().out
    counts = "(drawn by train.seed = {}): 96 rows to train on, 24 to evaluate on"
    assert out.count(f"data.eval_fraction = 0.2 of the 120 rows of {tmp_path / 'train.jsonl'}") == 3
    assert out.count(counts.format(0)) == 2 and out.count(counts.format(1)) == 1, out
    assert f"in {tmp_path / 'train.jsonl'} [train rows], " in out
    for side in (0, 1):
        assert first[side]["input_ids"].shape[0] == (96, 24)[side]
        for name in first[side]:
            np.testing.assert_array_equal(first[side][name], again[side][name])
        assert not np.array_equal(first[side]["input_ids"], other[side]["input_ids"])


def test_split_records_partitions_the_rows_in_order():
    rows = [{"n": n} for n in range(50)]
    kept, held = train.split_records(rows, 0.1, seed=3)
    assert len(held) == 5 and len(kept) == 45
    assert sorted(kept + held, key=lambda r: r["n"]) == rows
    assert kept == sorted(kept, key=lambda r: r["n"]) and held == sorted(held, key=lambda r: r["n"])
    assert train.split_records(rows, 0.1, seed=3) == (kept, held)
    assert train.split_records(rows, 0.1, seed=4)[1] != held
    for bad in (0, 1, 1.5, -0.1, True, math.nan, "0.1"):
        with as_users_run(), pytest.raises(ValueError, match=r"must be a number in \(0, 1\)"):
            train.split_records(rows, bad, seed=0)
    with pytest.raises(ValueError, match=r"eval_fraction 0.001 of 50 rows leaves no row to eval"):
        train.split_records(rows, 0.001, seed=0)
    with pytest.raises(ValueError, match=r"eval_fraction 0.999 of 50 rows leaves no row to train"):
        train.split_records(rows, 0.999, seed=0)


def test_adapters_without_eval_take_eval_fraction(llama, tmp_path, capsys):
    """In `[[adapters]]`, `[data] eval_fraction` draws the eval rows of each entry that
    gives no `eval`; an entry's own `eval` is its own."""
    for name in ("train", "eval"):
        write_jsonl(tmp_path / f"{name}.jsonl", _llama_rows(llama, name))
    entry = '[[adapters]]\nname = "{}"\ntrain = "train.jsonl"\n{}[adapters.lora]\nr = 2\n'
    (tmp_path / "job.toml").write_text(
        f'[model]\npath = "{llama / "base"}"\ntask = "causal-lm"\n[data]\neval_fraction = 0.25\n'
        'text_column = "answer"\nprompt_column = "question"\n'
        + entry.format("own", 'eval = "eval.jsonl"\n')
        + entry.format("drawn", "")
        + "[train]\nbatch_size = 8\n"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama / "base", local_files_only=True)
    (own, drawn), _ = _datasets(Job(tmp_path / "job.toml", []), tokenizer)
    assert own[1]["input_ids"].shape[0] == 30  # eval.jsonl's rows
    assert (own[0]["input_ids"].shape[0], drawn[0]["input_ids"].shape[0]) == (120, 90)
    assert drawn[1]["input_ids"].shape[0] == 30
    assert capsys.readouterr().out.count("data.eval_fraction = 0.25 of the 120 rows") == 1


@pytest.mark.command_run
def test_a_job_with_eval_fraction_trains(llama, tmp_path, capsys):
    job = _llama_job(llama, tmp_path, "jsonl", eval=False)
    sets = ("--set", "data.eval_fraction=0.25", "--set", f"output.dir={tmp_path / 'run'}", *SHORT)
    code, out, err = run_cli(capsys, "finetune", job, *sets)
    assert code == 0, err
    assert "90 rows to train on, 30 to evaluate on" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["after"]["loss"] < summary["before"]["loss"]


# -- one line for a bad source -------------------------------------------------------------

SPEC = '{dataset = "json", data_files = "train.jsonl", split = "train"}'
NO_EVAL = ('eval = "eval.jsonl"\n', "")
MISSING = ('prompt_column = "question"', 'prompt_column = "missing"')
# (the job's lines changed, the exit status, the line)
BAD_JOBS = [
    ([('eval = "eval.jsonl"', 'eval = "eval.jsonl"\neval_fraction = 0.1')], 2,
     "data.eval and data.eval_fraction both give the eval rows: give one"),
    ([NO_EVAL], 2,
     ("data.eval or data.eval_fraction is needed: the eval data (a .jsonl, .csv or .parquet "
     "file, a directory datasets.Dataset.save_to_disk wrote, or a datasets spec")),
    *[
        ([NO_EVAL, ("pack", f"eval_fraction = {value}\npack")], 2,
         ("data.eval_fraction must be a number in (0, 1), the share of the train rows to "
         f"evaluate on (e.g. 0.1), got {shown}"))
        for value, shown in [("0", "0"), ("1", "1"), ("1.5", "1.5"), ("true", "True"),
                             ('"0.1"', "'0.1'"), ("nan", "nan")]
    ],
    ([NO_EVAL, ("pack", "eval_fraction = 0.001\npack")], 2,
     "train.jsonl: data.eval_fraction 0.001 of 120 rows leaves no row to evaluate on"),
    ([('train = "train.jsonl"', 'train = {dataset = "json", data_files = "train.jsonl"}')], 2,
     "data.train needs 'split', e.g. " + SPEC),
    ([('train = "train.jsonl"', 'train = {dataset = "json", splitt = "train"}')], 2,
     "unknown key 'splitt' in data.train of"),
    ([('train = "train.jsonl"', 'train = {dataset = "json", data_files = 3, split = "train"}')],
     2, "data.train.data_files must be a file name (or glob pattern) or a list of them, got 3"),
    ([('train = "train.jsonl"', "train = 3")], 2,
     "data.train must be a .jsonl, .csv or .parquet file"),
    ([('train = "train.jsonl"', f"train = {SPEC}"), MISSING], 1,
     SPEC.replace("train.jsonl", "{root}/train.jsonl") + ": the dataset has no column "
     "'missing'; its columns are ['answer', 'question']"),
    ([('train = "train.jsonl"', 'train = "train.parquet"'), MISSING], 1,
     ("data file '{root}/train.parquet' has no column 'missing'; its columns are ['answer', "
     "'question']")),
]  # fmt: skip


@pytest.mark.parametrize("changes, code, message", BAD_JOBS)
def test_a_bad_source_is_one_line(changes, code, message, llama, tmp_path, capsys):
    job = _llama_job(llama, tmp_path, "jsonl")
    text = job.read_text()
    for old, new in changes:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    job.write_text(text)
    err = _one_error(capsys, code, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert message.replace("{root}", str(tmp_path)) in err
    assert not (tmp_path / "run").exists()


def test_a_spec_not_in_the_local_cache_is_one_line_without_the_network(
    no_network, llama, tmp_path, capsys
):
    job = _llama_job(llama, tmp_path, "jsonl")
    job.write_text(
        job.read_text().replace(
            'train = "train.jsonl"', 'train = {dataset = "peftx-tests/not-cached", split = "train"}'
        )
    )
    err = _one_error(capsys, 1, "finetune", job, "--set", f"output.dir={tmp_path / 'run'}")
    assert (
        "dataset 'peftx-tests/not-cached' (split 'train') is neither local nor in the datasets "
        "cache" in err
    )
    assert not (tmp_path / "run").exists()
