"""`peftx.sharding` on the zoo: meshes, presets and placement, and one training step on 8
simulated devices equal to the step on one, for LoRA, DoRA, IA3 and QLoRA on Llama
(grouped-query attention) and BERT.

Runs in child processes with `--xla_force_host_platform_device_count=8`, so this suite
keeps one device."""

import textwrap

import pytest
from helpers import run_script

pytestmark = pytest.mark.simulated_devices

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import warnings

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import peftx
    from peftx.models import (
        BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,
    )
    from peftx.sharding import make_mesh, shard

    # -- meshes ------------------------------------------------------------------------
    assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(make_mesh(data=2, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    for sizes, words in (
        (dict(data=3, fsdp=1), "make 3 devices, but there are 8"),
        (dict(data=3), "8 / 3 devices"),
        (dict(data=-1, fsdp=-1), "only one mesh size may be -1"),
        (dict(tensor=0), "tensor=0 must be a positive integer"),
    ):
        try:
            make_mesh(**sizes)
        except ValueError as e:
            assert words in str(e), (sizes, e)
        else:
            raise AssertionError(sizes)

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    bert = BertForSequenceClassification(
        BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64, num_labels=3),
        key=jax.random.key(1),
    )

    # -- placement by the presets ------------------------------------------------------
    lora = peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peftx.get_peft_model(llama, lora, key=jax.random.key(2))
    layer = lambda m: m.base_model.model.layers["0-1"]
    want = {  # preset: (q_proj W, its lora_A, its lora_B, down_proj W, embed table)
        "dp": (P(), P(), P(), P(), P()),
        "fsdp": (P(None, None, "fsdp"), P(None, None, "fsdp"), P(), P(None, "fsdp"),
                 P(None, "fsdp")),
        "tp": (P(None, "tensor"), P(), P(None, "tensor"), P(None, None, "tensor"), P("tensor")),
        "fsdp_tp": (P(None, "tensor", "fsdp"), P(None, None, "fsdp"), P(None, "tensor"),
                    P(None, "fsdp", "tensor"), P("tensor", "fsdp")),
    }
    meshes = {"dp": make_mesh(data=8, fsdp=1), "fsdp": make_mesh(),
              "tp": make_mesh(fsdp=4, tensor=2), "fsdp_tp": make_mesh(fsdp=4, tensor=2)}
    for preset, specs in want.items():
        placed = shard(model, meshes[preset], preset)
        q = layer(placed).self_attn.q_proj.weight
        got = (q.weight.sharding.spec, q.adapters["default"].lora_A.sharding.spec,
               q.adapters["default"].lora_B.sharding.spec,
               layer(placed).mlp.down_proj.weight.weight.sharding.spec,
               placed.base_model.model.embed_tokens.weight.sharding.spec)
        assert got == specs, (preset, got)
        # a norm's scale runs along the model width
        norm = {"fsdp": P(None, "fsdp"), "fsdp_tp": P(None, "fsdp")}.get(preset, P())
        assert layer(placed).input_layernorm.weight.sharding.spec == norm, preset

    # under fsdp=8 each device holds an eighth of the base weights' bytes
    placed = shard(model, make_mesh(), "fsdp")
    base = jax.tree.leaves(placed.disable_adapters())
    per_device = {}
    for x in base:
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    assert set(per_device.values()) == {sum(x.nbytes for x in base) // 8}, per_device

    # a dimension the mesh does not divide stays whole, named in one warning
    odd = LlamaForCausalLM(
        LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        odd = shard(odd, make_mesh(fsdp=1, tensor=8), "tp")
    (warning,) = [w for w in caught if "not divided" in str(w.message)]
    message = str(warning.message)
    assert "model.embed_tokens.weight (axis of 60 over tensor=8)" in message, message
    assert "lm_head.weight" in message and "q_proj" not in message, message
    assert odd.model.embed_tokens.weight.sharding.spec == P()
    for bad, words in ((("nope",), "unknown sharding preset 'nope'"),
                       (([(peftx.path_glob("*"), P("model"))],), "names mesh axis 'model'"),
                       ((8,), "must be a preset (dp, fsdp, tp, fsdp_tp) or a list of")):
        try:
            shard(model, make_mesh(), *bad)
        except (ValueError, TypeError) as e:
            assert words in str(e), e
        else:
            raise AssertionError(bad)

    # adapters added to, saved from and loaded onto a sharded model: placed by the rules,
    # the same files as on one device
    import pathlib, tempfile
    mesh = make_mesh(fsdp=4, tensor=2)
    placed = shard(model, mesh, "fsdp_tp").add_adapter("b", lora, key=jax.random.key(7))
    plain = model.add_adapter("b", lora, key=jax.random.key(7))
    want_specs = shard(plain, mesh, "fsdp_tp")
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(want_specs), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        placed.save_pretrained(tmp / "sharded")
        plain.save_pretrained(tmp / "plain")
        for f in sorted((tmp / "plain").rglob("*.*")):
            twin = tmp / "sharded" / f.relative_to(tmp / "plain")
            assert f.read_bytes() == twin.read_bytes(), f
        loaded = shard(model, mesh, "fsdp_tp").load_adapter(tmp / "plain" / "b", "b")
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(want_specs), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # an NF4 block may not straddle two shards; a batch must split over data x fsdp
    tiny = eqx.nn.Linear(8, 8, key=jax.random.key(6))
    tiny = eqx.tree_at(lambda m: m.weight, tiny, peftx.adapters.quantize_nf4(tiny.weight))
    try:
        shard(tiny, make_mesh(), [(peftx.path_glob("weight"), P("fsdp"))])
    except ValueError as e:
        assert "NF4 weight weight" in str(e) and "blocksize=64" in str(e), e
    else:
        raise AssertionError("an NF4 block straddling shards was placed")

    # -- one step, sharded against one device ------------------------------------------
    def batch_for(model, n=8, length=6):
        ids = jax.random.randint(jax.random.key(5), (n, length), 1, 64)
        batch = {"input_ids": ids, "attention_mask": jnp.ones((n, length), jnp.int32)}
        if isinstance(model.base_model, BertForSequenceClassification):
            return batch | {"labels": jnp.arange(n) % 3}, peftx.train.classification_loss
        return batch | {"labels": ids}, peftx.train.causal_lm_loss

    def one_step(model, mesh, preset):
        optimizer = optax.adamw(1e-2)
        batch, loss = batch_for(model)
        state, frozen = peftx.train.init_state(
            model, optimizer, key=jax.random.key(3), mesh=mesh, rules=preset
        )
        step = peftx.train.make_train_step(loss, optimizer, mesh=mesh)
        if mesh is not None:
            before = jax.tree.map(lambda x: x.sharding, state)
            # optimizer state takes its parameter's sharding
            mu = state.opt_state[0].mu
            for p_, m_ in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(mu), strict=True):
                assert m_.sharding == p_.sharding
        if mesh is not None and dict(mesh.shape)["data"] == 2:
            odd = jax.tree.map(lambda x: x[:6], batch)
            try:
                step(state, frozen, odd)
            except ValueError as e:
                assert "a batch of [6] rows cannot be split over data x fsdp" in str(e), e
            else:
                raise AssertionError("a batch of 6 rows was split over 4 devices")
        state, metrics = step(state, frozen, batch)
        if mesh is not None:  # the step returns the state placed as it came: no resharding
            after = jax.tree.map(lambda x: x.sharding, state)
            assert jax.tree.all(jax.tree.map(lambda a, b: a == b, before, after)), preset
        return state, metrics

    configs = {
        "lora": peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
        "dora": peftx.LoraConfig(r=4, target_modules="all-linear", use_dora=True,
                                 init_lora_weights=False),
        "ia3": peftx.IA3Config(target_modules="all-linear", init_ia3_weights=False),
    }
    steps = [("dp", make_mesh(data=8, fsdp=1)), ("fsdp", make_mesh()),
             ("fsdp_tp", make_mesh(fsdp=4, tensor=2)),
             ("fsdp_tp", make_mesh(data=2, fsdp=2, tensor=2))]
    # every mesh meets Llama, every kind Llama and BERT (the whole product took 6 minutes
    # here; BERT's LoRA is DoRA's without the magnitude)
    nf4 = peftx.quantize_model(llama, peftx.QuantizationConfig(load_in_4bit=True))
    runs = [
        ("llama", llama, "lora", [steps[1]]),
        ("llama", llama, "dora", [steps[3]]),
        ("llama", llama, "ia3", [steps[0]]),
        ("llama nf4", nf4, "lora", [steps[2]]),  # QLoRA: whole 64-value blocks per shard
        ("bert", bert, "dora", [steps[3]]),
        ("bert", bert, "ia3", [steps[0]]),
    ]
    for name, base, kind, meshes_here in runs:
        config = configs[kind]
        model = peftx.get_peft_model(base, config, key=jax.random.key(4))
        want_state, want_metrics = one_step(model, None, None)
        for preset, mesh in meshes_here:
            got_state, got_metrics = one_step(model, mesh, preset)
            where = (name, kind, preset, dict(mesh.shape))
            np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"],
                                       rtol=1e-5, err_msg=str(where))
            for a, b in zip(jax.tree.leaves((got_state.trainable, got_state.opt_state)),
                            jax.tree.leaves((want_state.trainable, want_state.opt_state)),
                            strict=True):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=str(where))
            # the updated adapter has the placement the rules give it
            placed, _ = peftx.partition(shard(model, mesh, preset))
            for x, y in zip(jax.tree.leaves(got_state.trainable), jax.tree.leaves(placed),
                            strict=True):
                assert x.sharding.is_equivalent_to(y.sharding, x.ndim), where
    print("OK")
    """
)


# two child processes, which the suite's workers run side by side: the meshes and the
# placement, and the steps
_HEAD, _REST = SCRIPT.split("# -- meshes", 1)
_MESHES, _REST = ("# -- meshes" + _REST).split("llama = LlamaForCausalLM(", 1)
_MODELS, _REST = ("llama = LlamaForCausalLM(" + _REST).split("# -- placement", 1)
_PLACEMENT, _STEPS = ("# -- placement" + _REST).split("# -- one step", 1)
_STEPS = "# -- one step" + _STEPS


def test_meshes_and_the_presets_placement(tmp_path):
    run_script(tmp_path / "presets.py", _HEAD + _MESHES + _MODELS + _PLACEMENT + 'print("OK")\n')


def test_a_step_on_every_mesh_equals_one_device(tmp_path):
    run_script(tmp_path / "presets.py", _HEAD + _MODELS + _STEPS)
