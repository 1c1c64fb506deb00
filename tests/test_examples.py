"""The examples run end to end (shortened) and pass their own checks."""

import importlib.util
import pathlib

import jax
import pytest

# whole example programs, end to end
pytestmark = pytest.mark.command_run

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
