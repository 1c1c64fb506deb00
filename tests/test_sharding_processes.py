"""Two processes on this machine (`jax.distributed` over the loopback address, JAX's gloo
CPU collectives), 4 simulated devices each, train and save as one process with 8
devices does: each process feeds only its own rows, process 0 writes, and the adapter,
the training checkpoint and a run resumed from it equal the one-process run's."""

import sys
import textwrap

import numpy as np
import pytest
import safetensors.numpy
from helpers import run_processes

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import pathlib
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import initialize_distributed, make_mesh, own_rows

    count, root = int(sys.argv[1]), pathlib.Path(sys.argv[2])
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

    def batch(n):  # known whole to every process; each feeds its own rows
        ids = np.asarray(jax.random.randint(jax.random.key(10 + n), (8, 6), 1, 64))
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}

    for n in range(2):
        state, _ = step(state, frozen, own_rows(mesh, batch(n)))
    peftx.train.save_checkpoint(root / "checkpoints", state, frozen)
    state, _ = peftx.train.restore_checkpoint(
        peftx.train.latest_checkpoint(root / "checkpoints"), state
    )
    state, metrics = step(state, frozen, own_rows(mesh, batch(2)))
    import equinox as eqx
    peft_model = eqx.combine(state.trainable, frozen)
    peft_model.save_pretrained(root / "adapter")
    # every process sees the files once save_pretrained returns
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    print("OK", index)
    """
)


def _launch(script, count, root):
    results = run_processes([sys.executable, script, count, root], processes=count)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, err[-4000:]
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
