"""An adapter bank under JAX's SPMD: its factors follow their base weight as LoRA's do
(A along the input axis, B along the output axis), the slot axis whole; a mixed batch and
a training step on 8 simulated devices equal one device's.

Runs in a child process with `--xla_force_host_platform_device_count=8`."""

import textwrap

import pytest
from helpers import run_script

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import make_mesh, shard

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    config = peftx.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                              init_lora_weights=False)
    bank = peftx.get_peft_model(llama, config, key=jax.random.key(1), adapter_name="a",
                                max_adapters=4, max_rank=8)
    bank = bank.add_adapter("b", dataclasses.replace(config, r=8, use_rslora=True),
                            key=jax.random.key(2))
    bank = bank.add_adapter("c", dataclasses.replace(config, lora_alpha=3), key=jax.random.key(3))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 6)))
    rows = bank.adapter_ids(["a", "b", "c", "__base__", "c", "b", "a", "a"])
    want = np.asarray(bank(ids, adapter_names=rows).logits)

    for preset, mesh in (("fsdp", make_mesh()), ("fsdp_tp", make_mesh(fsdp=4, tensor=2))):
        placed = shard(bank, mesh, preset)
        q = placed.base_model.model.layers["0-1"].self_attn.q_proj.weight
        specs = (q.weight.sharding.spec, q.lora_A.sharding.spec, q.lora_B.sharding.spec)
        if preset == "fsdp":
            # W (layers, out, in): in over fsdp; A (layers, slots, rank, in); B whole
            assert specs == (P(None, None, "fsdp"), P(None, None, None, "fsdp"), P()), specs
        else:
            assert specs == (P(None, "tensor", "fsdp"), P(None, None, None, "fsdp"),
                             P(None, None, None, "tensor")), specs
        with jax.set_mesh(mesh):
            got = np.asarray(jax.jit(lambda m, x, r: m(x, adapter_names=r).logits)(
                placed, ids, rows))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=preset)

    # one training step on the mesh equals the step on one device
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids,
             "adapter_ids": rows}
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    mesh = make_mesh(fsdp=4, tensor=2)
    results = []
    for on_mesh in (None, mesh):
        state, frozen = peftx.train.init_state(bank, optimizer, key=jax.random.key(4),
                                               adapters=["a", "b", "c"], mesh=on_mesh)
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=on_mesh)
        with jax.numpy_dtype_promotion("standard"):
            state, metrics = step(state, frozen, batch)
        leaves = [np.asarray(x) for x in jax.tree.leaves(state.trainable)]
        results.append((float(metrics["loss"]), leaves))
    (loss1, one), (loss8, eight) = results
    assert abs(loss1 - loss8) < 1e-5, (loss1, loss8)
    for a, b in zip(one, eight):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
    print("OK")
    """
)


def test_a_bank_on_eight_devices_equals_one(tmp_path):
    run_script(tmp_path / "bank_sharding.py", SCRIPT)
