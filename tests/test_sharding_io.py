"""`peftx.sharding` from and to files: a sharded load equal to the one-device load with
each device holding only its slice, merge and save from a sharded model giving the
single-device files, and training checkpoints restored across meshes.

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
    import pathlib
    import sys
    import warnings

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import torch
    import transformers

    sys.path.insert(0, os.getcwd())  # the tests' helpers
    from helpers import tiny_bert_config, tiny_llama_config
    import peftx
    from peftx import CheckpointError
    from peftx.sharding import make_mesh, shard

    root = pathlib.Path(sys.argv[1])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(64)).save_pretrained(root / "llama")
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    ).save_pretrained(root / "gpt2")
    transformers.BertModel(tiny_bert_config(64)).save_pretrained(root / "bert")

    def files(path):
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}

    def same_arrays(a, b, where):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(  # float64 holds bfloat16 values exactly
                np.asarray(x).astype(np.float64), np.asarray(y).astype(np.float64),
                err_msg=str(where),
            )

    def device_bytes(model, device):
        return sum(s.data.nbytes for x in jax.tree.leaves(model) if eqx_array(x)
                   for s in x.addressable_shards if s.device == device)

    eqx_array = lambda x: isinstance(x, jax.Array)

    # -- loading -----------------------------------------------------------------------
    meshes = {"dp": make_mesh(data=8, fsdp=1), "fsdp": make_mesh(),
              "tp": make_mesh(fsdp=4, tensor=2), "fsdp_tp": make_mesh(data=2, fsdp=2, tensor=2)}
    loads = [  # GPT-2's Conv1D weights are stored transposed; BERT's classifier is new
        ("llama", {}), ("gpt2", {}),
        ("bert", {"model_class": "BertForSequenceClassification", "num_labels": 8}),
    ]
    for name, kwargs in loads:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fresh classifier's warning
            one = peftx.from_pretrained(root / name, **kwargs)
            for preset, mesh in meshes.items():
                got = peftx.from_pretrained(root / name, mesh=mesh, rules=preset, **kwargs)
                want = shard(one, mesh, preset)
                same_arrays(got, want, (name, preset))
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (name, preset)
                    for s in x.addressable_shards:  # each device holds only its slice
                        assert s.data.shape == x.sharding.shard_shape(x.shape), (name, preset)
                if preset == "fsdp":
                    total = sum(x.nbytes for x in jax.tree.leaves(got))
                    per = device_bytes(got, jax.devices()[0])
                    assert per < total / 7, (name, per, total)  # norms stay whole
    # a float32 file read as bfloat16: each slice is cast on the way in
    half = peftx.from_pretrained(root / "gpt2", dtype="bfloat16")
    got = peftx.from_pretrained(root / "gpt2", dtype="bfloat16", mesh=meshes["fsdp_tp"],
                                rules="fsdp_tp")
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype("bfloat16")}
    same_arrays(got, shard(half, meshes["fsdp_tp"], "fsdp_tp"), "bfloat16")
    try:
        peftx.from_pretrained(root / "llama", mesh=meshes["tp"], rules="tensors")
    except ValueError as e:
        assert "unknown sharding preset 'tensors'" in str(e), e
    else:
        raise AssertionError("an unknown preset loaded")

    # -- merge and save from a sharded model ---------------------------------------------
    llama = peftx.from_pretrained(root / "llama")
    config = peftx.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peftx.get_peft_model(llama, config, key=jax.random.key(0))
    model.save_pretrained(root / "one" / "adapter")
    merged = model.merge_and_unload()
    peftx.save_pretrained(merged, root / "one" / "merged")
    for preset in ("fsdp", "fsdp_tp"):
        mesh = meshes[preset]
        placed = shard(model, mesh, preset)
        placed.save_pretrained(root / preset / "adapter")
        assert files(root / preset / "adapter") == files(root / "one" / "adapter"), preset
        got = placed.merge_and_unload()
        # shard by shard: each merged weight keeps its base weight's placement
        q = got.model.layers["0-1"].self_attn.q_proj.weight
        base_q = placed.base_model.model.layers["0-1"].self_attn.q_proj.weight.weight
        assert q.sharding.is_equivalent_to(base_q.sharding, q.ndim), (preset, q.sharding)
        np.testing.assert_allclose(q, merged.model.layers["0-1"].self_attn.q_proj.weight,
                                   rtol=1e-6, atol=1e-7)
        # compiled, the merge moves nothing between devices: no all-gather at all
        merge = eqx.filter_jit(lambda m: m.merge_and_unload())
        assert "all-gather" not in merge.lower(placed).lowered.compile().as_text(), preset
        peftx.save_pretrained(got, root / preset / "merged")
        want = files(root / "one" / "merged")
        assert files(root / preset / "merged").keys() == want.keys()
        reloaded = peftx.from_pretrained(root / preset / "merged")
        for x, y in zip(jax.tree.leaves(reloaded), jax.tree.leaves(merged)):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
        # the base model itself, saved from its shards, gives the same bytes
        peftx.save_pretrained(shard(llama, mesh, preset), root / preset / "base")
        peftx.save_pretrained(llama, root / "one" / "base")
        assert files(root / preset / "base") == files(root / "one" / "base"), preset
        # an adapter file loaded onto the sharded model lands as the rules place it
        loaded = peftx.PeftModel.from_pretrained(shard(llama, mesh, preset),
                                                 root / "one" / "adapter")
        same_arrays(loaded, placed, preset)
        for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(placed)):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), preset

    # -- training checkpoints across meshes ----------------------------------------------
    optimizer = optax.adamw(1e-2)
    ids = jax.random.randint(jax.random.key(5), (8, 6), 1, 64)
    batch = {"input_ids": ids, "attention_mask": jnp.ones((8, 6), jnp.int32), "labels": ids}

    def run(mesh, preset, steps, restore=None, save=None):
        state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(3),
                                               mesh=mesh, rules=preset)
        if restore is not None:
            state, _ = peftx.train.restore_checkpoint(restore, state)
            fresh, _ = peftx.train.init_state(model, optimizer, key=jax.random.key(3),
                                              mesh=mesh, rules=preset)
            for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(fresh)):
                assert x.sharding == y.sharding  # restored where this run places it
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=mesh)
        for _ in range(steps):
            state, _ = step(state, frozen, batch)
        if save is not None:
            peftx.train.save_checkpoint(save, state, frozen)
        return state

    whole = run(None, None, 2)
    for name, (first, second) in {
        "8 to 1": ((meshes["fsdp"], "fsdp"), (None, None)),
        "1 to 8": ((None, None), (meshes["fsdp"], "fsdp")),
        "fsdp to tp": ((meshes["fsdp"], "fsdp"), (meshes["tp"], "tp")),
    }.items():
        run(*first, 1, save=root / name)
        (path,) = peftx.train.checkpoints(root / name)
        resumed = run(*second, 1, restore=path)
        arrays = lambda s: (s.trainable, s.opt_state, s.step, jax.random.key_data(s.key))
        for x, y in zip(jax.tree.leaves(arrays(resumed)), jax.tree.leaves(arrays(whole)),
                        strict=True):
            np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6, err_msg=name)
    info = path / "train_state.json"
    info.write_text(info.read_text().replace('"processes": 1', '"processes": 2'))
    try:
        run(None, None, 0, restore=path)
    except CheckpointError as e:
        assert "written by 2 process(es); this run has 1" in str(e), e
    else:
        raise AssertionError("a checkpoint of two processes restored in one")
    print("OK")
    """
)


def test_sharded_load_save_merge_and_checkpoints(tmp_path):
    run_script(tmp_path / "sharding_io.py", SCRIPT, tmp_path)
