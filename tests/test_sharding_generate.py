"""Mixed-adapter batches on a mesh: a training step on fsdp and fsdp x tensor meshes
equals the step on one device, and greedy generation (tensor-parallel weights, a sharded
KV cache) equals one-device generation token for token.

Runs in a child process with `--xla_force_host_platform_device_count=8`, so this suite
keeps one device."""

import textwrap

import pytest
from helpers import run_script

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import os
    import pathlib
    import sys

    dump = pathlib.Path(sys.argv[1])  # XLA writes each program it compiles here
    os.environ["XLA_FLAGS"] += (
        f" --xla_force_host_platform_device_count=8 --xla_dump_to={dump} "
        "--xla_dump_hlo_module_re=.*generate.* --xla_dump_hlo_pass_re=^$"
    )

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import make_mesh, shard

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    model = peftx.get_peft_model(
        llama, peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
        key=jax.random.key(1), adapter_name="a",
    )
    model = model.add_adapter(
        "b", peftx.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                              init_lora_weights=False),
        key=jax.random.key(2),
    )
    # fsdp over all 8, and data x fsdp x tensor: every mesh axis splits a mixed batch or
    # its adapters (test_sharding_presets runs the dp and tp presets' plain steps)
    meshes = {"fsdp": make_mesh(), "fsdp_tp": make_mesh(data=2, fsdp=2, tensor=2)}
    ids = jax.random.randint(jax.random.key(3), (8, 5), 1, 64)
    names = ["a", "b", "__base__", "a", "b", "b", "__base__", "a"]

    # -- training on mixed batches ---------------------------------------------------------
    optimizer = optax.adam(1e-2)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids,
             "adapter_ids": model.adapter_ids(names)}

    def one_step(mesh, preset):
        state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(4),
                                               adapters=["a", "b"], mesh=mesh, rules=preset)
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=mesh)
        return step(state, frozen, batch)

    want_state, want_metrics = one_step(None, None)
    for preset, mesh in meshes.items():
        state, metrics = one_step(mesh, preset)
        np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
        for x, y in zip(jax.tree.leaves((state.trainable, state.opt_state)),
                        jax.tree.leaves((want_state.trainable, want_state.opt_state)),
                        strict=True):
            np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6, err_msg=preset)

    # a bfloat16 base on the 2x2x2 mesh (adapters in float32, as PEFT keeps them), to
    # bfloat16's precision (SGD: the update is the gradient)
    half = peftx.get_peft_model(
        LlamaForCausalLM(llama.config, key=jax.random.key(0), dtype=jnp.bfloat16),
        peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
        key=jax.random.key(1), adapter_name="a",
    ).add_adapter("b", peftx.LoraConfig(r=2, target_modules=["q_proj"],
                                        init_lora_weights=False), key=jax.random.key(2))
    sgd = optax.sgd(1e-2)

    def half_step(mesh, preset):
        state, frozen = peftx.train.init_state(half, sgd, key=jax.random.key(4),
                                               adapters=["a", "b"], mesh=mesh, rules=preset)
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, sgd, mesh=mesh)
        return step(state, frozen, batch)

    eps = float(jnp.finfo(jnp.bfloat16).eps)
    (want_state, want_metrics), (state, metrics) = (
        half_step(None, None), half_step(meshes["fsdp_tp"], "fsdp_tp"))
    np.testing.assert_allclose(np.float32(metrics["loss"]), np.float32(want_metrics["loss"]),
                               rtol=8 * eps)
    for x, y in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(want_state.trainable),
                    strict=True):
        y = np.asarray(y, np.float32)
        np.testing.assert_allclose(np.asarray(x, np.float32), y, rtol=8 * eps,
                                   atol=8 * eps * float(np.abs(y).max()))

    # -- greedy generation ---------------------------------------------------------------
    want_plain = peftx.generate(llama, ids, 6)
    want_mixed = peftx.generate(model, ids, 6, adapter_names=names)
    assert len({tuple(r) for r in np.asarray(want_mixed[:, 5:])}) > 1  # adapters differ
    for preset, mesh in meshes.items():
        got = peftx.generate(shard(model, mesh, preset), ids, 6, adapter_names=names)
        np.testing.assert_array_equal(got, want_mixed, err_msg=preset)
        got = peftx.generate(shard(llama, mesh, preset), ids, 6)
        np.testing.assert_array_equal(got, want_plain, err_msg=preset)

    # the compiled program holds each device's share of the cache (layers, rows, slots,
    # kv heads, head dim): rows over data x fsdp = 4, the 2 kv heads over tensor = 2
    # (the last generation ran on the 2x2x2 mesh)
    (last,) = sorted(dump.glob("*generate*after_optimizations.txt"), key=os.path.getmtime)[-1:]
    hlo = last.read_text()
    assert "f32[2,2,11,1,8]" in hlo and "f32[2,8,11,2,8]" not in hlo, last.name
    print("OK")
    """
)


def test_mixed_adapter_batches_train_and_generate_on_meshes(tmp_path):
    run_script(tmp_path / "sharding_generate.py", SCRIPT, tmp_path / "xla")
