"""Adapters on zoo models whose blocks are stacked for `lax.scan`: PEFT's selection,
parameter counts, outputs and gradients, against PyTorch PEFT on the same weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers

import peftx
import peftx.models as pm
from peftx.adapters import AdapterSet

LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def torch_model(path):
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def ids_and_mask():
    ids = np.random.RandomState(1).randint(1, 97, (2, 7))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def randomized(peft_model, key, scale=0.3):
    """`peft_model` with every trainable leaf (the factors) drawn at random, so lora_B is
    not zero and a missing adapter cannot pass."""
    trainable, frozen = peftx.partition(peft_model)
    leaves, treedef = jax.tree.flatten(trainable)
    keys = jax.random.split(key, len(leaves))
    leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


def per_layer(peft_model, module, attr):
    """`{layer: array}` of an adapter's field across the stack's segments."""
    out = {}
    for (first, last), block in peft_model.base_model.model.layers.ordered():
        weight = getattr(block.self_attn, module).weight
        if not isinstance(weight, AdapterSet):
            continue
        value = np.asarray(getattr(weight.adapters["default"], attr))
        for i in range(first, last + 1):
            out[i] = value[i - first]
    return out


def copy_into_torch(ours, theirs, modules, fields):
    with torch.no_grad():
        for module in modules:
            for field in fields:
                for i, value in per_layer(ours, module, field).items():
                    layer = getattr(theirs.base_model.model.model.layers[i].self_attn, module)
                    target = getattr(layer, field)["default"]
                    target = target.weight if hasattr(target, "weight") else target
                    target.copy_(torch.from_numpy(value.reshape(target.shape)))


@pytest.mark.parametrize(
    "layers, pattern",
    [([0, 2], None), (1, None), ([1, 2, 3], "layers"), ([0, 1, 2, 3], None)],
)
def test_layers_to_transform_counts_match_peft(checkpoint, layers, pattern):
    config = dict(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=layers)
    if pattern:
        config["layers_pattern"] = pattern
    ours = peftx.get_peft_model(
        pm.from_pretrained(checkpoint), peftx.LoraConfig(**config), key=jax.random.PRNGKey(0)
    )
    theirs = peft.get_peft_model(torch_model(checkpoint), peft.LoraConfig(**config))
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    wanted = {layers} if isinstance(layers, int) else set(layers)
    for (first, last), block in ours.base_model.model.layers.ordered():
        adapted = isinstance(block.self_attn.q_proj.weight, AdapterSet)
        # a segment is wholly inside or outside the transformed layers
        assert all((i in wanted) == adapted for i in range(first, last + 1))
        assert not isinstance(block.self_attn.k_proj.weight, AdapterSet)


def test_targets_lists_segments(checkpoint):
    model = pm.from_pretrained(checkpoint)
    config = peftx.LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[1, 2])
    assert peftx.targets(model, config).paths() == ["model.layers.1-2.self_attn.q_proj"]
    whole = peftx.targets(model, peftx.LoraConfig(r=4, target_modules=["q_proj"]))
    assert whole.paths() == [f"model.layers.0-{LAYERS - 1}.self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\]"):
        peftx.targets(
            model, peftx.LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[7])
        )


@pytest.mark.torch_round_trip  # test_peft_interop's layer-pattern case covers it in part
def test_stacked_lora_matches_peft(checkpoint):
    """Outputs and factor gradients of a LoRA on some layers of a stack, against PEFT."""
    config = dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 2, 3]
    )
    ours = peftx.get_peft_model(
        pm.from_pretrained(checkpoint), peftx.LoraConfig(**config), key=jax.random.PRNGKey(0)
    )
    ours = randomized(ours, jax.random.PRNGKey(1))
    theirs = peft.get_peft_model(torch_model(checkpoint), peft.LoraConfig(**config))
    copy_into_torch(ours, theirs, ["q_proj", "v_proj"], ["lora_A", "lora_B"])
    ids, mask = ids_and_mask()
    position_ids = np.maximum(mask.cumsum(-1) - 1, 0)
    weights = np.random.RandomState(2).randn(*ids.shape, 97).astype(np.float32) * mask[..., None]

    logits = theirs(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(position_ids),
    ).logits
    (logits * torch.from_numpy(weights)).sum().backward()

    def loss(trainable, frozen):
        model = eqx.combine(trainable, frozen)
        out = model(jnp.asarray(ids), jnp.asarray(mask)).logits
        return jnp.sum(out * weights), out

    trainable, frozen = peftx.partition(ours)
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(trainable, frozen)
    np.testing.assert_allclose(
        np.asarray(out) * mask[..., None], logits.detach().numpy() * mask[..., None], atol=1e-4
    )
    grads = eqx.combine(grads, frozen)
    for module in ["q_proj", "v_proj"]:
        for field in ["lora_A", "lora_B"]:
            got = per_layer(grads, module, field)
            assert sorted(got) == [0, 2, 3]
            for i, g in got.items():
                layer = getattr(theirs.base_model.model.model.layers[i].self_attn, module)
                want = getattr(layer, field)["default"].weight.grad.numpy()
                scale = np.abs(want).max()
                np.testing.assert_allclose(g, want, atol=1e-4 * max(scale, 1), err_msg=f"{i}")


def test_stacked_equals_unrolled_training(checkpoint):
    """One optax step on the stacked layout equals the same step on the unrolled one."""
    config = peftx.LoraConfig(
        r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 2]
    )
    stacked = randomized(
        peftx.get_peft_model(pm.from_pretrained(checkpoint), config, key=jax.random.PRNGKey(0)),
        jax.random.PRNGKey(1),
    )
    unrolled = peftx.get_peft_model(
        pm.from_pretrained(checkpoint, layout="unrolled"), config, key=jax.random.PRNGKey(5)
    )
    # the unrolled model gets the stacked one's factors, layer by layer
    for (first, last), block in stacked.base_model.model.layers.ordered():
        for i in range(first, last + 1):
            for get in (lambda b: b.self_attn.q_proj.weight, lambda b: b.mlp.down_proj.weight):
                if not isinstance(get(block), AdapterSet):
                    continue
                source = get(block).adapters["default"]
                unrolled = eqx.tree_at(
                    lambda m, get=get: (
                        get(m.base_model.model.layers[i]).adapters["default"].lora_A,
                        get(m.base_model.model.layers[i]).adapters["default"].lora_B,
                    ),
                    unrolled,
                    (source.lora_A[i - first], source.lora_B[i - first]),
                )
    models = {"stacked": stacked, "unrolled": unrolled}
    ids, mask = ids_and_mask()
    optimizer = optax.sgd(0.5)  # adam would magnify rounding in near-zero gradients

    def step(peft_model):
        trainable, frozen = peftx.partition(peft_model)

        def loss(t):
            out = eqx.combine(t, frozen)(jnp.asarray(ids), jnp.asarray(mask)).logits
            return jnp.mean(jnp.square(out))

        grads = jax.grad(loss)(trainable)
        with jax.numpy_dtype_promotion("standard"):
            updates, _ = optimizer.update(grads, optimizer.init(trainable), trainable)
        return eqx.combine(eqx.apply_updates(trainable, updates), frozen)

    stacked, unrolled = step(models["stacked"]), step(models["unrolled"])
    for (first, last), block in stacked.base_model.model.layers.ordered():
        for i in range(first, last + 1):
            other = unrolled.base_model.model.layers[i]
            for get in (lambda b: b.self_attn.q_proj.weight, lambda b: b.mlp.down_proj.weight):
                a, b = get(block), get(other)
                assert isinstance(a, AdapterSet) == isinstance(b, AdapterSet) == (i in (1, 2))
                if isinstance(a, AdapterSet):
                    for field in ("lora_A", "lora_B"):
                        np.testing.assert_allclose(
                            np.asarray(getattr(a.adapters["default"], field))[i - first],
                            np.asarray(getattr(b.adapters["default"], field)),
                            atol=1e-6,
                        )


def test_stacked_merge_matches_peft(checkpoint):
    config = dict(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 3])
    ours = randomized(
        peftx.get_peft_model(
            pm.from_pretrained(checkpoint), peftx.LoraConfig(**config), key=jax.random.PRNGKey(0)
        ),
        jax.random.PRNGKey(3),
    )
    theirs = peft.get_peft_model(torch_model(checkpoint), peft.LoraConfig(**config))
    copy_into_torch(ours, theirs, ["q_proj", "v_proj"], ["lora_A", "lora_B"])
    merged = ours.merge_and_unload()
    assert type(merged) is pm.LlamaForCausalLM
    theirs = theirs.merge_and_unload()
    ids, mask = ids_and_mask()
    want = theirs(input_ids=torch.tensor(ids[1:])).logits.detach().numpy()
    np.testing.assert_allclose(np.asarray(merged(jnp.asarray(ids[1:])).logits), want, atol=1e-4)
    for (first, last), block in merged.model.layers.ordered():
        w = np.asarray(block.self_attn.q_proj.weight)
        for i in range(first, last + 1):
            ref = theirs.model.layers[i].self_attn.q_proj.weight.detach().numpy()
            np.testing.assert_allclose(w[i - first], ref, atol=1e-6)


def test_stacked_ia3_matches_peft(checkpoint):
    config = dict(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    ours = randomized(
        peftx.get_peft_model(
            pm.from_pretrained(checkpoint), peftx.IA3Config(**config), key=jax.random.PRNGKey(0)
        ),
        jax.random.PRNGKey(4),
    )
    theirs = peft.get_peft_model(torch_model(checkpoint), peft.IA3Config(**config))
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    with torch.no_grad():
        for (first, last), block in ours.base_model.model.layers.ordered():
            for name, layer in [
                ("k_proj", block.self_attn.k_proj),
                ("v_proj", block.self_attn.v_proj),
                ("down_proj", block.mlp.down_proj),
            ]:
                values = np.asarray(layer.weight.adapters["default"].ia3_l)
                for i in range(first, last + 1):
                    parent = theirs.base_model.model.model.layers[i]
                    parent = parent.mlp if name == "down_proj" else parent.self_attn
                    target = getattr(parent, name).ia3_l["default"]
                    target.copy_(torch.from_numpy(values[i - first].reshape(target.shape)))
    ids, _ = ids_and_mask()
    want = theirs(input_ids=torch.tensor(ids)).logits.detach().numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids)).logits), want, atol=1e-4)


@pytest.mark.layout_sweep  # test_stacked_equals_unrolled_training cross-checks the layouts
def test_quantized_stack_equals_unrolled(checkpoint):
    """NF4 on a stack quantizes each layer on its own: the same codes and outputs as the
    unrolled model's per-layer quantization; QLoRA on top trains."""
    quant = peftx.QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)
    stacked = peftx.quantize_model(pm.from_pretrained(checkpoint), quant)
    unrolled = peftx.quantize_model(pm.from_pretrained(checkpoint, layout="unrolled"), quant)
    ids, mask = ids_and_mask()
    run = peftx.use_implicit_args(lambda m: m(jnp.asarray(ids), jnp.asarray(mask)).logits)
    np.testing.assert_allclose(np.asarray(run(stacked)), np.asarray(run(unrolled)), atol=1e-5)
    dense = pm.from_pretrained(checkpoint)(jnp.asarray(ids), jnp.asarray(mask)).logits
    assert np.abs(np.asarray(run(stacked)) - np.asarray(dense)).max() > 1e-4  # really quantized

    qlora = peftx.get_peft_model(
        stacked,
        peftx.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        key=jax.random.PRNGKey(0),
    )
    trainable, frozen = peftx.partition(qlora)

    def loss(t):
        return jnp.mean(jnp.square(eqx.combine(t, frozen)(jnp.asarray(ids)).logits))

    grads = jax.grad(loss)(trainable)
    b_grads = [g for g in jax.tree.leaves(grads) if g.shape[-1] == 4]  # lora_B: (layers, out, r)
    assert b_grads and all(np.abs(np.asarray(g)).max() > 0 for g in b_grads)


@pytest.mark.layout_sweep  # test_stacked_equals_unrolled_training cross-checks the layouts
def test_unstacked_adapter_set_serves_the_same_mixed_batch(checkpoint):
    """`unstack` (and `split_stack`, by `layers_to_transform`) of blocks holding several
    adapters (an `AdapterSet`, whose adapters' base is a `Slot` of static shape): each
    layer's adapters keep their rank and scaling, and the unrolled model serves a mixed
    batch as the stacked one does."""
    base = pm.from_pretrained(checkpoint)
    first = peftx.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    second = peftx.LoraConfig(
        r=2, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[1, 2]
    )
    model = peftx.get_peft_model(base, first, key=jax.random.key(0))
    model = model.add_adapter("b", second, key=jax.random.key(1))
    factors = lambda m: eqx.is_inexact_array(m) and m.ndim > 1 and m.shape[-1] in (2, 4)  # noqa: E731
    model = jax.tree.map(lambda x: x + 0.1 if factors(x) else x, model)  # B away from zero

    blocks = pm.unstack(model.base_model.model.layers)
    assert len(blocks) == LAYERS
    for i, block in enumerate(blocks):
        q = block.self_attn.q_proj.weight
        assert isinstance(q, AdapterSet)
        expected = {"default": (4, 2.0)} | ({"b": (2, 4.0)} if i in (1, 2) else {})
        assert {k: (a.r, a.scaling) for k, a in q.adapters.items()} == expected
    unrolled = eqx.tree_at(lambda m: m.base_model.model.layers, model, blocks)

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (3, 7)))
    names = ["b", peftx.BASE, "default"]
    got = unrolled(ids, adapter_names=names).logits
    want = model(ids, adapter_names=names).logits
    np.testing.assert_allclose(got, want, atol=16 * np.finfo(np.float32).eps * np.abs(want).max())
    alone = model.set_adapter("b")(ids[:1]).logits
    np.testing.assert_allclose(
        got[:1], alone, atol=16 * np.finfo(np.float32).eps * np.abs(want).max()
    )


def test_scan_saves_matmul_outputs_but_rank_r_expansions():
    """The stacked layout's remat policy: matmul outputs are saved (base products, `x·Aᵀ`,
    attention scores), an adapter's rank-r expansion `(x·Aᵀ)·Bᵀ` is recomputed, other
    primitives are recomputed."""
    from jax.extend.core import primitives

    from peftx.models._stack import _dots_but_low_rank_expansions as policy

    def dot(lhs, rhs, contracted, batch=((), ())):
        avals = [jax.core.ShapedArray(s, jnp.float32) for s in (lhs, rhs)]
        dims = ((contracted[0], contracted[1]), batch)
        return policy(primitives.dot_general_p, *avals, dimension_numbers=dims)

    tokens, d, r = 1024, 512, 8
    assert dot((tokens, d), (d, d), ((1,), (0,)))  # the base product
    assert dot((tokens, d), (r, d), ((1,), (1,)))  # x·Aᵀ
    assert not dot((tokens, r), (d, r), ((1,), (1,)))  # the expansion, as large as the output
    assert dot((8, 128, 4, 64), (8, 128, 4, 64), ((3,), (3,)), ((0, 2), (0, 2)))  # q·kᵀ
    sin = jax.core.ShapedArray((tokens, d), jnp.float32)
    assert not policy(primitives.sin_p, sin)
