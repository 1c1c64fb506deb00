"""`peftx finetune` on a mesh: the `[mesh]` table (and `--set mesh.*`) gives the adapter
the one-device run gives, for LoRA and a QLoRA job, with the mesh and each device's
bytes printed at start; bad `[mesh]` values are one line and change nothing.

The 8-device runs are child processes with `--xla_force_host_platform_device_count=8`,
so this suite keeps one device."""

import os
import subprocess
import sys

import numpy as np
import safetensors.numpy
from helpers import run_cli

EPS = float(np.finfo(np.float32).eps)


def _adapter(out_dir):
    return safetensors.numpy.load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))


def _on_eight(job, *sets, command=None):
    argv = [sys.executable, "-m", "peftx", "finetune", str(job)]
    for item in sets:
        argv += ["--set", item]
    if command is not None:
        argv = [sys.executable, "-m", "peftx", *map(str, command)]
    env = dict(os.environ)
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def _same_adapter(got, want, where):
    got, want = _adapter(got), _adapter(want)
    assert got.keys() == want.keys(), where
    for k in want:
        tol = 256 * EPS * max(1.0, float(np.abs(want[k]).max()))
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=tol, err_msg=f"{where} {k}")


QUICK = ["train.steps=3", "train.log_every=1", "output.merged=false"]


def test_finetune_on_a_mesh_writes_the_one_device_adapter(llama, tmp_path, capsys):
    job = llama / "job.toml"
    runs = {
        "lora": ([], ["mesh.fsdp=8"]),
        "lora 2x2x2": (
            [],
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.rules=fsdp_tp"],
        ),
        # no [mesh] table: every device on fsdp, the default
        "qlora": (["train.quantize=true"], []),
    }
    for name, (common, mesh) in runs.items():
        one, eight = tmp_path / f"{name} one", tmp_path / f"{name} eight"
        if name != "lora 2x2x2":
            sets = [f"output.dir={one}", *QUICK, *common]
            code, out, err = run_cli(
                capsys, "finetune", job, *sum((["--set", s] for s in sets), [])
            )
            assert code == 0, err
            assert "mesh " not in out  # one device and no table: the plain path
            reference = one
        result = _on_eight(job, f"output.dir={eight}", *QUICK, *common, *mesh)
        assert result.returncode == 0, result.stderr[-3000:]
        sizes = {
            "lora": "data=1, fsdp=8, tensor=1",
            "lora 2x2x2": "data=2, fsdp=2, tensor=2",
            "qlora": "data=1, fsdp=8, tensor=1",
        }[name]
        line = next(x for x in result.stdout.splitlines() if x.startswith("mesh "))
        assert line.startswith(f"mesh {sizes} (8 cpu devices), rules "), line
        assert "parameters " in line and "optimizer state " in line, line
        _same_adapter(eight, reference, name)

    # generate and merge take the same settings, as --mesh options
    base, adapter = llama / "base", tmp_path / "lora one" / "adapter"
    generate = ["generate", base, "w5 w6 w7", "--adapter", adapter, "--max-new-tokens", 6]
    code, want, _ = run_cli(capsys, *generate)
    assert code == 0
    got = _on_eight(None, command=[*generate, "--mesh", "tensor=2", "--mesh", "rules=tp"])
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout == want
    assert "mesh data=1, fsdp=4, tensor=2 (8 cpu devices), rules tp" in got.stderr
    code, _, _ = run_cli(capsys, "merge", base, adapter, tmp_path / "merged one")
    assert code == 0
    got = _on_eight(None, command=["merge", base, adapter, tmp_path / "merged eight"])
    assert got.returncode == 0, got.stderr[-3000:]
    assert "mesh data=1, fsdp=8, tensor=1 (8 cpu devices), rules fsdp" in got.stdout
    for name in ("config.json", "model.safetensors"):
        want = (tmp_path / "merged one" / name).read_bytes()
        assert (tmp_path / "merged eight" / name).read_bytes() == want, name

    # a batch the mesh cannot split is one line, before anything is written
    bad = _on_eight(job, f"output.dir={tmp_path / 'bad'}", "mesh.fsdp=8", "train.batch_size=12")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "peftx: error: train.batch_size (12) must be a multiple of data x fsdp = 8, the parts "
        "each batch is split into on this mesh"
    ), bad.stderr
    assert not (tmp_path / "bad").exists()


def test_bad_mesh_tables_are_one_line(llama, tmp_path, capsys):
    job = llama / "job.toml"
    for sets, words in (
        (["mesh.data=3"], "[mesh]: the mesh sizes data=3, fsdp=-1, tensor=1 leave 1 / 3"),
        (["mesh.fsdp=2"], "[mesh]: the mesh sizes data=1, fsdp=2, tensor=1 make 2 devices, but"),
        (["mesh.rules=tensor"], "mesh.rules = 'tensor' is not a preset; choose one of dp, fsdp"),
        (["mesh.size=2"], "unknown key 'size' in [mesh] of"),
        (["mesh.tensor=0"], "mesh.tensor must be a positive integer, or -1"),
    ):
        out_dir = tmp_path / sets[0]
        argv = ["finetune", job, "--set", f"output.dir={out_dir}"]
        code, out, err = run_cli(capsys, *argv, *sum((["--set", s] for s in sets), []))
        assert code == 2, (sets, err)
        assert words in err and err.count("\n") == 1, (sets, err)
        assert not out_dir.exists()


def test_a_partial_multi_process_environment_is_one_line(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    argv = ["finetune", llama / "job.toml", "--set", f"output.dir={tmp_path / 'out'}"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert (
        "JAX_COORDINATOR_ADDRESS=127.0.0.1:1 asks for a run of several processes; it needs "
        "JAX_NUM_PROCESSES" in err
    ), err
    assert not (tmp_path / "out").exists()
