"""Two processes on this machine (`jax.distributed` over the loopback address, JAX's gloo
CPU collectives), 4 simulated devices each, train and save as one process with 8
devices does: each process feeds only its own rows, process 0 writes, and the adapter,
the training checkpoint and a run resumed from it equal the one-process run's."""

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import numpy as np
import safetensors.numpy

SCRIPT = textwrap.dedent(
    """
    import os
    import pathlib
    import sys

    count, root = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={8 // count}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import initialize_distributed, make_mesh

    assert initialize_distributed() == (count > 1)
    assert jax.process_count() == count and jax.device_count() == 8
    index = jax.process_index()

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    config = peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peftx.get_peft_model(llama, config, key=jax.random.key(1))
    mesh = make_mesh()  # fsdp over all 8 devices, both processes'
    optimizer = optax.adam(1e-2)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(2),
                                           mesh=mesh, rules="fsdp")
    step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=mesh)

    def own_rows(n):  # the whole batch n is known to all; a process feeds its share
        ids = np.asarray(jax.random.randint(jax.random.key(10 + n), (8, 6), 1, 64))
        mine = ids.reshape(count, -1, 6)[index]
        return {"input_ids": mine, "attention_mask": np.ones_like(mine), "labels": mine}

    for n in range(2):
        state, _ = step(state, frozen, own_rows(n))
    peftx.train.save_checkpoint(root / "checkpoints", state, frozen)
    state, _ = peftx.train.restore_checkpoint(
        peftx.train.latest_checkpoint(root / "checkpoints"), state
    )
    state, metrics = step(state, frozen, own_rows(2))
    import equinox as eqx
    peft_model = eqx.combine(state.trainable, frozen)
    peft_model.save_pretrained(root / "adapter")
    # every process sees the files once save_pretrained returns
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    print("OK", index)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script, count, root):
    env = dict(os.environ)
    if count > 1:
        env |= {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
            "JAX_NUM_PROCESSES": str(count),
        }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(count), str(root)],
            env=env | ({"JAX_PROCESS_ID": str(i)} if count > 1 else {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=pathlib.Path(__file__).parent,
        )
        for i in range(count)
    ]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
        assert out.strip().endswith(f"OK {i}"), out


def test_two_processes_train_and_save_as_one(tmp_path):
    script = tmp_path / "processes.py"
    script.write_text(SCRIPT)
    _launch(script, 1, tmp_path / "one")
    _launch(script, 2, tmp_path / "two")
    for name in (
        "adapter/adapter_model.safetensors",
        "checkpoints/checkpoint-00000002/train_state.safetensors",
    ):
        want = safetensors.numpy.load_file(str(tmp_path / "one" / name))
        got = safetensors.numpy.load_file(str(tmp_path / "two" / name))
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)
    info = tmp_path / "two" / "checkpoints" / "checkpoint-00000002" / "train_state.json"
    assert '"processes": 2' in info.read_text()


def test_peftx_finetune_refuses_several_processes(llama, tmp_path):
    """The command's run directory is one process's: in a run of two it says so, in one
    line from each, and writes nothing."""
    env = {**os.environ, "JAX_NUM_PROCESSES": "2"}
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "peftx", "finetune", str(llama / "job.toml")]
    argv += ["--set", f"output.dir={tmp_path / 'out'}"]
    procs = [
        subprocess.Popen(
            argv,
            env=env | {"JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2, err[-2000:]
        assert (
            err.strip()
            .splitlines()[-1]
            .startswith(
                "peftx: error: peftx finetune runs in one process (with all its devices); this run "
                "has 2."
            )
        ), err[-2000:]
    assert not (tmp_path / "out").exists()
