"""`peftx finetune` on a mesh: the `[mesh]` table (and `--set mesh.*`) gives the adapter
the one-device run gives, for LoRA and a QLoRA job (resumed on another mesh), with the
mesh and each device's bytes printed at start; bad `[mesh]` values are one line and
change nothing.

The 8-device runs are child processes with `--xla_force_host_platform_device_count=8`,
so this suite keeps one device."""

import json
import re
import signal
import sys
import time

import numpy as np
import pytest
import safetensors.numpy
from helpers import run_cli, run_processes, start_processes

EPS = float(np.finfo(np.float32).eps)


def _adapter(out_dir):
    return safetensors.numpy.load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))


def _on_eight(job, *sets, command=None, processes=1):
    """`peftx finetune job --set ...` (or `peftx *command`) on 8 simulated devices, in one
    process or several: each process's `(exit status, stdout, stderr)`, process 0's first."""
    argv = [sys.executable, "-m", "peftx", "finetune", job]
    for item in sets:
        argv += ["--set", item]
    if command is not None:
        argv = [sys.executable, "-m", "peftx", *command]
    results = run_processes(argv, processes=processes)
    return results[0] if processes == 1 else results


def _same_adapter(got, want, where):
    got, want = _adapter(got), _adapter(want)
    assert got.keys() == want.keys(), where
    for k in want:
        tol = 256 * EPS * max(1.0, float(np.abs(want[k]).max()))
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=tol, err_msg=f"{where} {k}")


QUICK = ["train.steps=3", "train.log_every=1", "output.merged=false"]
MESH_LINE = "mesh {} (8 cpu devices), rules "


def _one_device(job, out, *sets):
    """The reference: `peftx finetune` in this process, on its one device (no table)."""
    from peftx.cli import main

    sets = [f"output.dir={out}", *QUICK, *sets]
    assert main(["finetune", str(job), *sum((["--set", s] for s in sets), [])]) == 0
    return out


def _mesh_line(stdout, sizes):
    line = next(x for x in stdout.splitlines() if x.startswith("mesh "))
    assert line.startswith(MESH_LINE.format(sizes)), line
    assert "parameters " in line and "optimizer state " in line, line


@pytest.fixture(scope="module")
def lora_one(llama, tmp_path_factory):
    return _one_device(llama / "job.toml", tmp_path_factory.mktemp("lora") / "one")


@pytest.mark.simulated_devices
def test_finetune_on_a_mesh_writes_the_one_device_adapter(llama, lora_one, tmp_path):
    """2 x 2 x 2 over two processes of 4 devices: process 0 owns the run directory (and
    its checkpoints), each feeds its own rows, and the one-device adapter comes out. (One
    process on `fsdp=8` is the QLoRA test's default mesh below.)"""
    job = llama / "job.toml"
    sets = [f"output.dir={tmp_path / 'two'}", *QUICK, "train.checkpoint_every=1"]
    sets += ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.rules=fsdp_tp"]
    (code, out, err), (code1, out1, err1) = _on_eight(job, *sets, processes=2)
    assert code == 0 and code1 == 0, err[-3000:] + err1[-3000:]
    _mesh_line(out, "data=2, fsdp=2, tensor=2")
    # process 0 reports; process 1 prints none of it (gloo's own lines, which come from
    # both and may run into each other, aside)
    for line in ("supervised tokens", "mesh data=2", "trainable params", "wrote"):
        assert line in out and line not in out1, (line, out1)
    _same_adapter(tmp_path / "two", lora_one, "2x2x2 in two processes")
    assert not (tmp_path / "two" / "checkpoints").exists()  # removed once the run is done

    # a batch the mesh cannot split is one line, before anything is written
    code, _, err = _on_eight(
        job, f"output.dir={tmp_path / 'bad'}", "mesh.fsdp=8", "train.batch_size=12"
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "peftx: error: train.batch_size (12) must be a multiple of data x fsdp = 8, the parts "
        "each batch is split into on this mesh"
    ), err
    assert not (tmp_path / "bad").exists()


def _stopped_after_first_checkpoint(job, sets, monkeypatch):
    """`peftx finetune job --set ...` in this process, on its one device, stopped (as by
    Ctrl-C) once it has saved its first checkpoint."""
    from peftx.cli import main
    from peftx.train import _fit

    save = _fit.save_checkpoint

    def save_and_stop(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_fit, "save_checkpoint", save_and_stop)  # the name `fit` calls
        assert main(["finetune", str(job), *sum((["--set", s] for s in sets), [])]) == 130


@pytest.mark.simulated_devices
def test_qlora_without_a_mesh_table_uses_every_device(llama, tmp_path, capsys, monkeypatch):
    """The 8-device run goes on from the checkpoint of a run stopped on one device, on
    a one-device mesh of the `dp` rules: another mesh and device count, the same job."""
    job = llama / "job.toml"
    one = _one_device(job, tmp_path / "one", "train.quantize=true")
    assert "mesh " not in capsys.readouterr().out  # one device and no table: the plain path
    sets = [f"output.dir={tmp_path / 'eight'}", *QUICK, "train.quantize=true"]
    sets += ["train.checkpoint_every=1"]
    _stopped_after_first_checkpoint(job, [*sets, "mesh.rules=dp"], monkeypatch)
    assert "mesh data=1, fsdp=1, tensor=1 (1 cpu devices), rules dp" in capsys.readouterr().out
    code, out, err = _on_eight(job, *sets)
    assert code == 0, err[-3000:]
    _mesh_line(out, "data=1, fsdp=8, tensor=1")  # the default: every device on fsdp
    checkpoint = tmp_path / "eight" / "checkpoints" / "checkpoint-00000001"
    assert f"resuming from {checkpoint} (step 1 of 3)" in out
    _same_adapter(tmp_path / "eight", one, "qlora")


@pytest.mark.simulated_devices
def test_generate_and_merge_take_the_mesh_as_options(llama, lora_one, tmp_path, capsys):
    base, adapter = llama / "base", lora_one / "adapter"
    generate = ["generate", base, "w5 w6 w7", "--adapter", adapter, "--max-new-tokens", 6]
    code, want, _ = run_cli(capsys, *generate)
    assert code == 0
    code, out, err = _on_eight(
        None, command=[*generate, "--mesh", "tensor=2", "--mesh", "rules=tp"]
    )
    assert code == 0, err[-3000:]
    assert out == want
    assert "mesh data=1, fsdp=4, tensor=2 (8 cpu devices), rules tp" in err
    code, _, _ = run_cli(capsys, "merge", base, adapter, tmp_path / "merged one")
    assert code == 0
    code, out, err = _on_eight(None, command=["merge", base, adapter, tmp_path / "merged eight"])
    assert code == 0, err[-3000:]
    assert "mesh data=1, fsdp=8, tensor=1 (8 cpu devices), rules fsdp" in out
    one, eight = tmp_path / "merged one", tmp_path / "merged eight"
    assert (eight / "config.json").read_bytes() == (one / "config.json").read_bytes()
    # weights the adapter leaves are the same bytes; a merged one W + s·B·A (XLA compiles
    # the sharded B·A apart from the one-device one, summing in another order): each is
    # within (r + 1)·eps/2 of |W| + s·|B|·|A| of the exact value (a rank-r dot product and
    # an add), so the two differ by at most (r + 1) ulps of that (seen: 1-2 ulps)
    got, want = (safetensors.numpy.load_file(str(d / "model.safetensors")) for d in (eight, one))
    weights = safetensors.numpy.load_file(str(base / "model.safetensors"))
    factors = safetensors.numpy.load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert got.keys() == want.keys()
    merged = 0
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        lora_a = f"base_model.model.{k.removesuffix('.weight')}.lora_A.weight"
        if lora_a not in factors:
            assert got[k].tobytes() == want[k].tobytes(), k
            continue
        merged += 1
        a = factors[lora_a].astype(np.float64)
        b = factors[lora_a.replace("lora_A", "lora_B")].astype(np.float64)
        terms = np.abs(weights[k].astype(np.float64)) + scale * (np.abs(b) @ np.abs(a))
        ulp = np.spacing(terms.astype(np.float32))
        assert (np.abs(got[k].astype(np.float64) - want[k]) <= (config["r"] + 1) * ulp).all(), k
    assert merged == 3 * 2  # q_proj, v_proj and down_proj of both layers


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
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("PEFTX_JOIN_TIMEOUT", "soon")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err == "peftx: error: PEFTX_JOIN_TIMEOUT='soon' must be a number of seconds above 0.\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.simulated_devices
def test_a_missing_or_lost_process_is_one_line(llama, tmp_path):
    """A process whose peer never starts says at once what it waits for, and gives up after
    `PEFTX_JOIN_TIMEOUT` with one line; one whose peer is killed mid-run exits at once with
    one line naming it, not JAX's C++ stack, and the run resumes from its checkpoints."""
    generate = [sys.executable, "-m", "peftx", "generate", llama / "base", "w5"]
    (alone,) = start_processes(generate, processes=2, started=1, PEFTX_JOIN_TIMEOUT="2")
    first = alone.stderr.readline()
    assert alone.poll() is None, first  # said before giving up
    _, err = alone.communicate(timeout=120)
    address = first.split(" at ")[1].split()[0]
    assert first == (
        f"peftx: waiting for 2 processes at {address} (this is process 0), up to 2 s "
        "(PEFTX_JOIN_TIMEOUT)\n"
    )
    assert alone.returncode == 1 and "Check failure" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"peftx: error: gave up after 2 s (PEFTX_JOIN_TIMEOUT) waiting for 2 processes at "
        f"{address} (this is process 0): start each with the same JAX_COORDINATOR_ADDRESS and "
        "JAX_NUM_PROCESSES and its own JAX_PROCESS_ID"
    ), err

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "peftx", "finetune", llama / "job.toml"]
    for item in (f"output.dir={out}", *QUICK, "train.steps=12", "train.checkpoint_every=1"):
        argv += ["--set", item]
    survivor, victim = start_processes(argv, processes=2)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "checkpoint-00000002").is_dir():
        assert survivor.poll() is None and time.monotonic() < deadline, survivor.stderr.read()
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    _, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 1 and "Check failure" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("peftx: error: process 0 of 2 lost process 1"), err
    assert last.endswith(
        "; run the command again on every process (a fine-tune resumes from its last checkpoint)"
    ), err
    results = run_processes(argv, processes=2)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert re.search(r"resuming from \S+checkpoint-\d+ \(step \d+ of 12\)", results[0][1])
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
