"""What the compiled sharded step holds, read from XLA's own program: under `fsdp=8` a
device holds an eighth of the weights plus at most two layers' gathered weights and the
activations (never the whole model), and the step hands the state back placed as it
came, so steps follow each other without resharding.

(Before the layers kept their activations split by rows, XLA gathered every device's
activations instead of each layer's weights: this model's step held 7.7 MB per device
of its 8.5 MB.)

Runs in a child process with `--xla_force_host_platform_device_count=8`, so this suite
keeps one device."""

import textwrap

import pytest
from helpers import run_script

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

    import jax
    import jax.numpy as jnp
    import optax

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import make_mesh

    layers = 8
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                    model_type="llama"),
        key=jax.random.key(0),
    )
    config = peftx.LoraConfig(r=4, target_modules="all-linear")
    model = peftx.get_peft_model(llama, config, key=jax.random.key(1))
    ids = jax.random.randint(jax.random.key(2), (8, 16), 1, 256)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids}
    optimizer = optax.adamw(1e-3)
    weights = sum(x.nbytes for x in jax.tree.leaves(model))
    stack = model.base_model.model.layers["0-7"]
    layer = sum(x.nbytes for x in jax.tree.leaves(stack)) // layers

    def compiled(preset, mesh):
        state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(3),
                                               mesh=mesh, rules=preset)
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=mesh)
        return state, step.lower(state, frozen, batch).compile()

    _, dp = compiled("dp", make_mesh(data=8, fsdp=1))
    state, fsdp = compiled("fsdp", make_mesh())
    # dp's temporaries are the activations (its weights are arguments); fsdp's arguments
    # are an eighth of the weights, and its temporaries may add a layer being gathered
    # and the next one, never the whole model
    activations = dp.memory_analysis().temp_size_in_bytes
    used = fsdp.memory_analysis()
    held = used.argument_size_in_bytes + used.temp_size_in_bytes
    bound = weights / 8 + 2 * layer + activations
    print(f"fsdp device: {held} bytes; bound {bound:.0f}; whole model {weights}")
    assert used.argument_size_in_bytes < weights / 4, (used.argument_size_in_bytes, weights)
    assert held <= bound, (held, bound)

    # no resharding between steps: the state goes out placed as it came in (found among
    # the compiled program's arguments and results by its shapes, in order)
    leaves = jax.tree.leaves(state)
    shapes = [x.shape for x in leaves]

    def state_part(shardings, infos):
        shardings, infos = jax.tree.leaves(shardings), jax.tree.leaves(infos)
        for start in range(len(infos) - len(leaves) + 1):
            if [i.shape for i in infos[start : start + len(leaves)]] == shapes:
                return shardings[start : start + len(leaves)]
        raise AssertionError("the state is not among the program's arrays")

    went_in = state_part(fsdp.input_shardings[0], fsdp.args_info[0])
    came_out = state_part(fsdp.output_shardings, fsdp.out_info)
    for x, a, b in zip(leaves, went_in, came_out, strict=True):
        assert a.is_equivalent_to(b, x.ndim), (x.shape, a, b)
        assert a.is_equivalent_to(x.sharding, x.ndim), (x.shape, a, x.sharding)
    print("OK")
    """
)


def test_fsdp_step_holds_an_eighth_and_never_reshards_the_state(tmp_path):
    run_script(tmp_path / "sharding_memory.py", SCRIPT, timeout=600)
