"""The documentation: the site builds with `mkdocs build --strict`, and the code blocks of
the README and of every page of `docs/` run, each page's in order in one namespace
(blocks marked `<!-- fragment -->`, which use a model or files the page does not make,
are compiled only)."""

import importlib.util
import math
import os
import subprocess
import sys
import tomllib
import warnings

import jax
import pytest
from helpers import DOC_PAGES, ROOT, code_blocks


def _check_readme(out, caught, tmp_path):
    peft_way, equinox_way, loss_line = out.splitlines()
    # LoRA on query and value of 6 layers (6·2·8·(384+384)) and the classifier (384·4 + 4)
    assert peft_way.startswith("trainable params: 75,268 || all params: 22,790,024 ||")
    assert (tmp_path / "runs/quickstart/adapter_model.safetensors").is_file()
    assert equinox_way.startswith("trainable params: 320 || all params: 872 ||")
    name, loss = loss_line.split()
    assert name == "MLP" and float(loss) < 0.1


def _check_implicit(out, caught, tmp_path):
    assert out.startswith("(8, 3) ")


def _check_training(out, caught, tmp_path):
    assert any("fresh" in str(w.message) for w in caught)  # the classifier the base lacks
    assert float(out.split("loss ")[1].split()[0]) < math.log(2)  # the two repeated classes
    assert (tmp_path / "runs/by_hand/checkpoint-00000010/adapter_model.safetensors").is_file()
    # then `fit` on the same model and data
    before, after = (float(x) for x in out.split("eval loss ")[1].split("\n")[0].split(" -> "))
    assert after < before
    for name in ("metrics.jsonl", "curves.png", "adapter/adapter_model.safetensors"):
        assert (tmp_path / "runs/fit" / name).is_file(), name


CHECKS = {
    "README.md": _check_readme,
    "implicit.md": _check_implicit,
    "training.md": _check_training,
}
RUN = [p for p in DOC_PAGES if any(b.language == "python" for b in code_blocks(p))]


def test_every_page_that_runs_code_is_checked():
    running = {
        p.name
        for p in RUN
        if any(b.language == "python" and not b.fragment for b in code_blocks(p))
    }
    assert running == set(CHECKS)


@pytest.mark.parametrize("page", RUN, ids=lambda p: p.name)
def test_code_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "docs"}
    # optax mixes Python floats with its int32 step count, which strict promotion refuses
    with warnings.catch_warnings(record=True) as caught, jax.numpy_dtype_promotion("standard"):
        warnings.simplefilter("always")
        for block in code_blocks(page):
            if block.language == "python":
                code = compile(block.code, f"{page.name}, line {block.line}", "exec")
                if not block.fragment:
                    exec(code, scope)
    if page.name in CHECKS:
        CHECKS[page.name](capsys.readouterr().out, caught, tmp_path)


def test_toml_blocks_parse():
    blocks = [b for p in DOC_PAGES for b in code_blocks(p) if b.language == "toml"]
    assert blocks
    for block in blocks:
        tomllib.loads(block.code)


@pytest.mark.command_run  # mkdocs, a whole program in a child process
def test_site_builds_strict(tmp_path):
    """`make docs`: a warning (a broken link or anchor, a name mkdocstrings cannot find, a
    missing snippet) fails the build."""
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "adapters/index.html").is_file()


def test_bench_keeps_the_focused_scripts_tables(tmp_path, monkeypatch):
    """`suite.py --out` replaces the suite's report and keeps what follows its marker."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("suite", ROOT / "benchmarks/suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    results = tmp_path / "RESULTS.md"
    suite.write_report(str(results), "# new suite\n")
    assert results.read_text() == "# new suite\n"
    results.write_text(f"# old suite\n\n{suite.KEPT}\n\n# Focused scripts\n")
    suite.write_report(str(results), "# new suite\n")
    assert results.read_text() == f"# new suite\n\n{suite.KEPT}\n\n# Focused scripts\n"
    assert suite.KEPT in (ROOT / "benchmarks/RESULTS.md").read_text()
