"""A `PeftModel` under JAX's SPMD: sharded base weights and batch, on meshes whose axes are
`Auto` (shardings propagated by XLA) or `Explicit` (shardings part of the types).

Runs in a subprocess, since the number of (fake CPU) devices is fixed when JAX starts."""

import textwrap

import pytest
from helpers import run_script

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import peftx
    from peftx.implicit import strict


    class MLP(eqx.Module):
        up_proj: eqx.nn.Linear
        down_proj: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up_proj = eqx.nn.Linear(16, 64, key=k1)
            self.down_proj = eqx.nn.Linear(64, 16, key=k2)

        def __call__(self, x):
            return self.down_proj(jax.nn.gelu(self.up_proj(x)))


    config = peftx.LoraConfig(r=4, target_modules=["up_proj", "down_proj"], init_lora_weights=False)
    model = peftx.get_peft_model(MLP(jax.random.key(0)), config, key=jax.random.key(1))
    model = model.add_adapter("b", config, key=jax.random.key(2))
    axis_type = getattr(AxisType, sys.argv[1])
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    arrays, static = eqx.partition(model, eqx.is_array)
    # the 64-wide side of every weight and factor is split over "model"
    specs = jax.tree.map(lambda x: P("model") if x.shape[0] == 64 else P(), arrays)
    sharded = eqx.combine(
        jax.device_put(arrays, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), static
    )
    data = NamedSharding(mesh, P("data"))
    xs = jax.random.normal(jax.random.key(3), (8, 16))
    ids = model.adapter_ids(["default", "b", "__base__", "b"] * 2)


    @eqx.filter_jit
    def forward(m, xs, ids):
        return jax.vmap(lambda x, i: m(x, adapter_names=i))(xs, ids)


    def loss(trainable, frozen, xs, ids):
        return (forward(eqx.combine(trainable, frozen), xs, ids) ** 2).mean()


    with strict():
        got = forward(sharded, jax.device_put(xs, data), jax.device_put(ids, data))
        want = forward(model, xs, ids)
        grad = eqx.filter_jit(eqx.filter_grad(loss))
        g_sharded = grad(*peftx.partition(sharded, ["default", "b"]), jax.device_put(xs, data),
                         jax.device_put(ids, data))
        g_plain = grad(*peftx.partition(model, ["default", "b"]), xs, ids)
    assert got.sharding.spec in (P("data"), P("data", None)), got.sharding
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sharded), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    up = g_sharded.base_model.up_proj.weight.adapters["b"].lora_B
    assert up.sharding.spec in (P("model"), P("model", None)), up.sharding

    # other adapters, one at a time, with the same shardings
    for other in (
        peftx.LoraConfig(r=4, target_modules=["up_proj"], use_dora=True, init_lora_weights=False),
        peftx.IA3Config(target_modules=["up_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ):
        plain = peftx.get_peft_model(MLP(jax.random.key(0)), other, key=jax.random.key(1))
        arrays, static = eqx.partition(plain, eqx.is_array)
        specs = jax.tree.map(lambda x: P("model") if x.shape[0] == 64 else P(), arrays)
        placed = jax.device_put(arrays, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        with strict():
            got = eqx.filter_jit(jax.vmap(eqx.combine(placed, static)))(jax.device_put(xs, data))
            want = eqx.filter_jit(jax.vmap(plain))(xs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("OK", len(jax.devices()))
    """
)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_mixed_batch_forward_and_gradients(tmp_path, axis_type):
    run_script(tmp_path / "sharded.py", SCRIPT, axis_type, ending="OK 4", timeout=600)
