"""The examples run end to end (shortened) and pass their own checks."""

import importlib.util
import pathlib

import jax
import pytest

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("quantize", [False, True])
def test_lora_mlp_demo(capsys, quantize):
    # optax mixes Python floats with its int32 step count, which strict promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        assert _load("lora_mlp").main(steps=100, log_every=50, quantize=quantize) == 0
    assert "OK" in capsys.readouterr().out


def _readme_code(section):
    readme = (EXAMPLES.parent / "README.md").read_text()
    return readme.split(section, 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_readme_quickstart_runs(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax under the tests' strict promotion
        exec(compile(_readme_code("## Quickstart"), "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trainable params: 320 || all params: 872 ||")
    name, loss = out[1].split()
    assert name == "MLP" and float(loss) < 0.1


def test_readme_implicit_example_runs(capsys):
    exec(compile(_readme_code("## `peftx.implicit`"), "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("(8, 3) ")


def test_train_loop_example(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax under the tests' strict promotion
        assert _load("train_loop").main(steps=25, batch=8) == 0
    out = capsys.readouterr().out
    assert "base weights bit-identical after training: True" in out and "OK" in out


def test_implicit_arrays_example(capsys):
    assert _load("implicit_arrays").main(width=12, rank=2, batch=5) == 0
    out = capsys.readouterr().out
    assert "assert_no_dense catches a materialized weight: True" in out and "OK" in out


def test_qlora_example(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax under the tests' strict promotion
        assert _load("qlora").main(steps=15, batch=8) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("NF4 + double quant:"))
    per_param = float(line.split("(")[1].split()[0])
    # 4-bit codes (0.5) + one 8-bit absmax code per 64 weights (1/64) + the second level
    assert 0.5 + 1 / 64 <= per_param < 0.53 and "OK" in out


def test_multi_adapter_example(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax under the tests' strict promotion
        assert _load("multi_adapter").main(steps=40) == 0
    out = capsys.readouterr().out
    assert "max |mixed batch - each alone|" in out and "OK" in out


def test_merge_export_example(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax under the tests' strict promotion
        assert _load("merge_export").main(steps=10) == 0
    out = capsys.readouterr().out
    assert "max |transformers(merged) - peftx(unmerged)| logits" in out
    assert "max |PyTorch PEFT(adapter) - peftx(unmerged)| logits" in out and "OK" in out


def test_structure_editing_example(capsys):
    assert _load("structure_editing").main() == 0
    out = capsys.readouterr().out
    assert "'model.layers.2-3.self_attn.o_proj'" in out and "OK" in out


def test_readme_training_loop_runs(capsys, tmp_path, monkeypatch):
    """The loop by hand, then `fit` on the same model and data (the block after it)."""
    monkeypatch.chdir(tmp_path)
    namespace = {}
    with jax.numpy_dtype_promotion("standard"), pytest.warns(UserWarning, match="fresh"):
        for section in ("## Training utilities", "### The command's loop"):
            exec(compile(_readme_code(section), "README.md", "exec"), namespace)
    by_hand, fitted = capsys.readouterr().out.split("eval loss ")
    loss = float(by_hand.split("loss ")[1].split()[0])
    assert loss < 0.6931  # below chance (ln 2) for the two repeated classes
    assert (tmp_path / "runs/by_hand/checkpoint-00000010/adapter_model.safetensors").is_file()
    before, after = (float(x) for x in fitted.split("\n")[0].split(" -> "))
    assert after < before
    for name in ("metrics.jsonl", "curves.png", "adapter/adapter_model.safetensors"):
        assert (tmp_path / "runs/fit" / name).is_file(), name
