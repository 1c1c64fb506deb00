"""Several adapters on one model: add/set/delete, weighted combinations, mixed batches,
checked against running each adapter alone and against HF PEFT in torch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import example_count
from hypothesis import given, settings, strategies as st
from test_lora import _random_lora, weight_product
from test_select import CausalLM

import peftx
from peftx import IA3Config, LoraConfig, get_peft_model, partition
from peftx.adapters import AdapterSet, adapter_set
from peftx.implicit import materialize, strict, use_implicit_args


def _body(m, x):
    """Logits of the toy LM for one token sequence (`eqx.nn.Linear` layers, vmapped)."""
    h = jax.vmap(m.model.embed_tokens)(x)
    for layer in m.model.layers:
        attn = layer.self_attn
        h = h + jax.vmap(
            lambda v: attn.o_proj(attn.v_proj(v) * jnp.tanh(attn.q_proj(v) + attn.k_proj(v)))
        )(h)
        h = h + jax.vmap(lambda v: layer.mlp["down_proj"](jax.nn.gelu(layer.mlp["up_proj"](v))))(h)
    return jax.vmap(m.lm_head)(h)


def _run(model, x, adapter_names=None):
    if isinstance(model, peftx.PeftModel):
        return peftx.use_implicit_args(_body)(model.prepared(adapter_names), x)
    return _body(model, x)


CONFIG_A = LoraConfig(target_modules=["q_proj", "v_proj"], r=2, init_lora_weights=False)
CONFIG_B = LoraConfig(
    target_modules=["v_proj", "up_proj"], r=3, lora_alpha=6, init_lora_weights=False
)
KEY_A, KEY_B = jax.random.split(jax.random.key(0))


@pytest.fixture(scope="module")
def lm():
    return CausalLM()


@pytest.fixture(scope="module")
def two(lm):
    return get_peft_model(lm, CONFIG_A, key=KEY_A).add_adapter("b", CONFIG_B, key=KEY_B)


def test_each_adapter_alone_equals_a_model_with_only_it(lm, two):
    only_a = get_peft_model(lm, CONFIG_A, key=KEY_A)
    only_b = get_peft_model(lm, CONFIG_B, key=KEY_B, adapter_name="b")
    x = jnp.array([1, 2, 3, 4, 5])
    assert two.adapter_names == ("default", "b") and two.active_adapter == "default"
    assert two.set_adapter("b").active_adapters == ["b"]
    assert two.peft_config["b"] == CONFIG_B
    with strict():
        np.testing.assert_array_equal(_run(two, x), _run(only_a, x))
        np.testing.assert_array_equal(_run(two.set_adapter("b"), x), _run(only_b, x))
        assert not np.allclose(_run(only_a, x), _run(only_b, x))
        # `v_proj` carries both adapters, `q_proj` only the first, `up_proj` only the second
        v = two.base_model.model.layers[0].self_attn.v_proj.weight
        q = two.base_model.model.layers[0].self_attn.q_proj.weight
        assert set(v.adapters) == {"default", "b"} and set(q.adapters) == {"default"}
        deleted = two.delete_adapter("default")
        assert deleted.adapter_names == ("b",) and deleted.active_adapter == "b"
        np.testing.assert_array_equal(_run(deleted, x), _run(only_b, x))
        assert not isinstance(
            deleted.base_model.model.layers[0].self_attn.q_proj.weight, AdapterSet
        )
        kept = two.set_adapter("b").delete_adapter("default").set_adapter("b")
        np.testing.assert_array_equal(_run(kept, x), _run(only_b, x))
        np.testing.assert_array_equal(_run(two.unload(), x), _run(lm, x))


def test_partition_trains_the_active_adapter_or_the_named_ones(two):
    def trained_names(trainable):
        names = set()
        for s in jax.tree.leaves(trainable, is_leaf=lambda x: isinstance(x, AdapterSet)):
            if isinstance(s, AdapterSet):
                names |= {n for n, a in s.adapters.items() if jax.tree.leaves(a)}
        return names

    assert trained_names(partition(two)[0]) == {"default"}
    assert trained_names(partition(two.set_adapter("b"))[0]) == {"b"}
    assert trained_names(partition(two, ["default", "b"])[0]) == {"default", "b"}
    trainable, total = two.get_nb_trainable_parameters()
    a_params = 4 * 2 * (2 * 4 + 4 * 2)  # 4 layers, q and v, r=2 on 4x4
    b_params = 4 * (3 * 4 + 4 * 3) + 4 * (3 * 4 + 8 * 3)  # v_proj and up_proj (4 -> 8), r=3
    assert trainable == a_params
    assert total == sum(x.size for x in jax.tree.leaves(two.unload())) + a_params + b_params


def test_mixed_batch_equals_each_example_alone(lm, two):
    xs = jnp.array([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8], [2, 2, 2, 2]])
    names = ["b", peftx.BASE, "default", "b"]
    alone = {"default": two, "b": two.set_adapter("b"), peftx.BASE: lm}
    want = jnp.stack([_run(alone[n], x) for n, x in zip(names, xs)])
    ids = two.adapter_ids(names)
    np.testing.assert_array_equal(ids, [1, 2, 0, 1])
    mixed = jax.jit(jax.vmap(lambda x, i: _run(two, x, i)))
    with strict():
        np.testing.assert_allclose(mixed(xs, ids), want, rtol=1e-6, atol=1e-6)


class BatchedNet(eqx.Module):
    """A model that takes a whole batch and uses its weights directly."""

    q_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.q_proj = eqx.nn.Linear(8, 8, key=k1)
        self.v_proj = eqx.nn.Linear(8, 8, key=k2)
        self.out = eqx.nn.Linear(8, 3, key=k3)

    def __call__(self, x):
        def linear(layer, x):
            return x @ layer.weight.T + layer.bias[None, :]

        return linear(self.out, jnp.tanh(linear(self.q_proj, x)) * linear(self.v_proj, x))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.v_proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.q_proj(x)) * self.v_proj(x))


def _t2j(t):
    return jnp.asarray(t.detach().numpy())


def _load_torch(peft_model, torch_peft):
    """Copy base weights and every adapter's parameters from a PEFT torch model."""
    net = peft_model.base_model
    for name in ("q_proj", "v_proj", "out"):
        module = getattr(torch_peft.base_model.model, name)
        layer = module.base_layer if hasattr(module, "base_layer") else module
        weight = getattr(net, name).weight
        new_base = _t2j(layer.weight)
        if isinstance(weight, AdapterSet):
            adapters = {}
            for adapter_name, a in weight.adapters.items():
                if hasattr(a, "ia3_l"):
                    value = _t2j(module.ia3_l[adapter_name])
                    adapters[adapter_name] = eqx.tree_at(lambda a: a.ia3_l, a, value)
                else:
                    values = (
                        _t2j(module.lora_A[adapter_name].weight),
                        _t2j(module.lora_B[adapter_name].weight),
                    )
                    adapters[adapter_name] = eqx.tree_at(lambda a: (a.lora_A, a.lora_B), a, values)
            new_weight = AdapterSet(new_base, adapters, None, weight.active)
        else:
            new_weight = new_base
        net = eqx.tree_at(
            lambda n, name=name: (getattr(n, name).weight, getattr(n, name).bias),
            net,
            (new_weight, _t2j(layer.bias)),
        )
    return eqx.tree_at(lambda m: m.base_model, peft_model, net)


def _two_lora_torch():
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model

    torch.manual_seed(0)
    model = torch_get_peft_model(
        TorchNet(),
        TorchLoraConfig(target_modules=["q_proj", "v_proj"], r=2, init_lora_weights=False),
    )
    model.add_adapter(
        "b",
        TorchLoraConfig(
            target_modules=["v_proj", "out"], r=3, lora_alpha=5, init_lora_weights=False
        ),
    )
    ours = get_peft_model(
        BatchedNet(jax.random.key(0)),
        LoraConfig(target_modules=["q_proj", "v_proj"], r=2, init_lora_weights=False),
        key=KEY_A,
    ).add_adapter(
        "b",
        LoraConfig(target_modules=["v_proj", "out"], r=3, lora_alpha=5, init_lora_weights=False),
        key=KEY_B,
    )
    return model.eval(), _load_torch(ours, model)


def test_mixed_batch_matches_peft_adapter_names():
    torch_model, ours = _two_lora_torch()
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    names = ["default", "b", peftx.BASE, "b", "default"]
    with torch.no_grad():
        want = torch_model(torch.from_numpy(x), adapter_names=names).numpy()
    with strict():
        got = ours(jnp.asarray(x), adapter_names=names)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        only_b = ours(jnp.asarray(x), adapter_names=["b"] * 5)
        np.testing.assert_allclose(only_b, ours.set_adapter("b")(jnp.asarray(x)), atol=1e-6)


@pytest.mark.parametrize("combination_type", ["linear", "cat", "svd"])
def test_add_weighted_adapter_matches_peft(combination_type):
    torch_model, ours = _two_lora_torch()
    adapters, weights = ["default", "b"], [0.7, -0.4]
    if combination_type == "linear":  # needs equal ranks: combine an adapter with itself
        adapters, weights = ["default", "default"], [0.7, 0.5]
    torch_model.add_weighted_adapter(adapters, weights, "mix", combination_type=combination_type)
    torch_model.set_adapter("mix")
    combined = ours.add_weighted_adapter(adapters, weights, "mix", combination_type)
    assert combined.active_adapter == "default"
    config = combined.peft_config["mix"]
    assert (config.r, config.lora_alpha) == (torch_model.peft_config["mix"].r,) * 2
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    with torch.no_grad():
        want = torch_model(torch.from_numpy(x)).numpy()
    with strict():
        got = combined.set_adapter("mix")(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cat_and_svd_combine_the_weight_deltas(two):
    # "cat" is exact; "svd" at full rank is exact too
    for combination_type, rank in (("cat", None), ("svd", 4)):
        combined = two.add_weighted_adapter(
            ["default", "b"], [0.5, 2.0], "mix", combination_type, svd_rank=rank
        )
        s = combined.base_model.model.layers[1].self_attn.v_proj.weight
        delta = {n: materialize(s.adapter(n)) - s.weight for n in ("default", "b", "mix")}
        np.testing.assert_allclose(
            delta["mix"], 0.5 * delta["default"] + 2.0 * delta["b"], rtol=1e-5, atol=1e-5
        )


def test_mixed_batch_gradients_equal_each_adapters_own(lm, two):
    """One mixed batch trains both adapters: its gradient is the sum of each adapter's
    gradient on its own examples."""
    xs = jnp.array([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8]])
    ys = jnp.roll(xs, -1, axis=1)
    names = ["default", "b", "default"]
    trainable, frozen = partition(two, ["default", "b"])

    def loss(trainable, xs, ys, ids):
        model = eqx.combine(trainable, frozen)

        def one(x, y, i):
            logits = _run(model, x, i)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

        return jax.vmap(one)(xs, ys, ids).sum()

    ids = two.adapter_ids(names)
    with jax.numpy_dtype_promotion("standard"), strict():
        mixed = eqx.filter_jit(jax.grad(loss))(trainable, xs, ys, ids)

    def alone_loss(trainable, name, xs, ys):
        model = eqx.combine(trainable, frozen).set_adapter(name)
        logits = jax.vmap(lambda x: _run(model, x))(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).sum()

    with jax.numpy_dtype_promotion("standard"), strict():
        rows = jnp.array([0, 2])
        alone_grad = eqx.filter_jit(jax.grad(alone_loss))
        g_a = alone_grad(trainable, "default", xs[rows], ys[rows])
        g_b = alone_grad(trainable, "b", xs[1:2], ys[1:2])
    want = jax.tree.map(lambda a, b: a + b, g_a, g_b)
    got_leaves, want_leaves = jax.tree.leaves(mixed), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_b))


def test_ia3_scales_the_bias_like_peft():
    from peft import IA3Config as TorchIA3Config, get_peft_model as torch_get_peft_model

    torch.manual_seed(1)
    config = dict(target_modules=["q_proj", "v_proj", "out"], feedforward_modules=["out"])
    torch_model = torch_get_peft_model(TorchNet(), TorchIA3Config(**config)).eval()
    with torch.no_grad():
        for name in config["target_modules"]:
            ia3_l = getattr(torch_model.base_model.model, name).ia3_l["default"]
            ia3_l.copy_(1 + 0.5 * torch.randn_like(ia3_l))
    ours = _load_torch(
        get_peft_model(BatchedNet(jax.random.key(0)), IA3Config(**config), key=KEY_A), torch_model
    )
    x = np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32)
    with torch.no_grad():
        want = torch_model(torch.from_numpy(x)).numpy()
    with strict():
        got = ours(jnp.asarray(x))
        merged = ours.merge_and_unload()(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-5)
    # without the bias scale the outputs differ: the test sees the bias
    unscaled = peftx.use_implicit_args(lambda m, x: m(x))(ours.base_model, jnp.asarray(x))
    assert not np.allclose(unscaled, want, atol=1e-3)


def _two_ia3_torch(second):
    """PEFT's IA3 on `TorchNet` with two adapters (random scales), and ours on the same
    weights; the first adapter scales q_proj's outputs and out's inputs."""
    from peft import IA3Config as TorchIA3Config, get_peft_model as torch_get_peft_model

    torch.manual_seed(2)
    first = dict(target_modules=["q_proj", "out"], feedforward_modules=["out"])
    torch_model = torch_get_peft_model(TorchNet(), TorchIA3Config(**first))
    torch_model.add_adapter("b", TorchIA3Config(**second))
    with torch.no_grad():
        for name in ("q_proj", "v_proj", "out"):
            for ia3_l in getattr(torch_model.base_model.model, name).ia3_l.values():
                ia3_l.copy_(1 + 0.5 * torch.randn_like(ia3_l))
    ours = get_peft_model(BatchedNet(jax.random.key(0)), IA3Config(**first), key=KEY_A)
    ours = _load_torch(ours.add_adapter("b", IA3Config(**second), key=KEY_B), torch_model)
    return torch_model.eval(), ours


def test_ia3_weighted_adapter_matches_peft():
    torch_model, ours = _two_ia3_torch(
        dict(target_modules=["v_proj", "out"], feedforward_modules=["out"])
    )
    torch_model.add_weighted_adapter(["default", "b"], [0.3, 0.9], "mix")
    torch_model.set_adapter("mix")
    combined = ours.add_weighted_adapter(["default", "b"], [0.3, 0.9], "mix").set_adapter("mix")
    assert combined.peft_config["mix"].target_modules == ("out", "q_proj", "v_proj")
    x = np.random.default_rng(3).normal(size=(4, 8)).astype(np.float32)
    with torch.no_grad():
        want = torch_model.eval()(torch.from_numpy(x)).numpy()
    with strict():
        np.testing.assert_allclose(combined(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"IA3 adapters combine linearly only; got .*'cat'"):
        ours.add_weighted_adapter(["default", "b"], [0.3, 0.9], "mix", "cat")


def test_mixed_batch_with_embedding_adapters(lm):
    """Embedding lookups (gather) of a mixed batch, one gate row per example under vmap."""
    config = LoraConfig(target_modules=["embed_tokens", "q_proj"], r=2, init_lora_weights=False)
    two = get_peft_model(lm, config, key=KEY_A).add_adapter("b", config, key=KEY_B)
    xs = jnp.array([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8]])
    names = ["b", "default", peftx.BASE]
    alone = {"default": two, "b": two.set_adapter("b"), peftx.BASE: lm}
    want = jnp.stack([_run(alone[n], x) for n, x in zip(names, xs)])
    with strict():
        got = jax.vmap(lambda x, i: _run(two, x, i))(xs, two.adapter_ids(names))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"batch-wide adapter gate \(shape \(3, 2\)\).*`gather`"):
        _run(two, xs[0], two.adapter_ids(names))


@pytest.mark.parametrize(
    "config_a,config_b",
    [
        (  # IA3: output scales (with biases) and input scales
            IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
            IA3Config(target_modules=["k_proj", "v_proj"]),
        ),
        (  # DoRA next to plain LoRA on the same layer: the per-adapter path
            LoraConfig(target_modules=["q_proj", "v_proj"], r=2, use_dora=True),
            CONFIG_B,
        ),
    ],
    ids=["ia3", "dora"],
)
def test_mixed_batch_of_other_adapter_types(lm, config_a, config_b):
    two = get_peft_model(lm, config_a, key=KEY_A).add_adapter("b", config_b, key=KEY_B)
    # move every adapter away from its identity init, so each example's output differs
    leaves, treedef = jax.tree.flatten(partition(two, ["default", "b"])[0])
    keys = jax.random.split(jax.random.key(3), len(leaves))
    moved = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    two = eqx.combine(jax.tree.unflatten(treedef, moved), partition(two, ["default", "b"])[1])
    xs = jnp.array([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8]])
    names = ["b", "default", peftx.BASE]
    alone = {"default": two, "b": two.set_adapter("b"), peftx.BASE: lm}
    want = jnp.stack([_run(alone[n], x) for n, x in zip(names, xs)])
    assert not np.allclose(want[0], _run(two, xs[0]), atol=1e-3)
    with strict():
        got = jax.vmap(lambda x, i: _run(two, x, i))(xs, two.adapter_ids(names))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_adapter_names_as_ids_and_bad_ids():
    _, ours = _two_lora_torch()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))
    names = ["b", peftx.BASE, "default"]
    ids = ours.adapter_ids(names)
    with strict():
        by_name = ours(x, adapter_names=names)
        np.testing.assert_allclose(ours(x, adapter_names=ids), by_name, rtol=1e-6, atol=1e-6)
        by_numpy = ours(x, adapter_names=np.asarray(ids))
        np.testing.assert_allclose(by_numpy, by_name, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(by_name[2], ours(x)[2], rtol=1e-6, atol=1e-6)
    assert not np.allclose(by_name[0], ours(x)[0], atol=1e-4)
    with pytest.raises(TypeError, match=r"integer ids from `adapter_ids`, got an array of dtype"):
        ours.prepared(jnp.array([0.0, 1.0]))


@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_merging_several_adapters_matches_peft(kind):
    if kind == "lora":
        torch_model, ours = _two_lora_torch()
    else:
        both = dict(target_modules=["v_proj", "q_proj"], feedforward_modules=[])
        torch_model, ours = _two_ia3_torch(both)
    x = np.random.default_rng(4).normal(size=(4, 8)).astype(np.float32)
    merged = ours.merge_and_unload(["default", "b"])
    assert type(merged) is BatchedNet
    with torch.no_grad():
        want = torch_model.merge_and_unload(adapter_names=["default", "b"])(torch.from_numpy(x))
    np.testing.assert_allclose(merged(jnp.asarray(x)), want.numpy(), rtol=1e-5, atol=1e-5)


@settings(max_examples=example_count(6), deadline=None)
@given(case=weight_product(), seed=st.integers(0, 2**16))
def test_gated_set_any_layout(case, seed):
    """Two LoRAs of different ranks on one base, weighted by a soft gate row, in any
    `dot_general` layout: values and the gradients of the factors and of the gate equal
    those of the dense mixture `W + g_0·ΔW_0 + g_1·ΔW_1`, written out here."""
    w_shape, x_shape, dims, w_first = case
    ka, kb, kx, kg = jax.random.split(jax.random.key(seed), 4)
    a = _random_lora(ka, w_shape, r=2)
    b = eqx.tree_at(lambda m: m.weight, _random_lora(kb, w_shape, r=3), a.weight)
    gate = jax.random.uniform(kg, (2,), minval=0.2, maxval=0.8)
    s = AdapterSet(a.weight, adapter_set(a.weight, {"a": a, "b": b}).adapters, gate, ("a", "b"))
    x = jax.random.normal(kx, x_shape)

    def fn(w, x):
        return jax.lax.dot_general(w, x, dims) if w_first else jax.lax.dot_general(x, w, dims)

    def leaves(s):
        return [s.gate, *(f for m in s.adapters.values() for f in (m.lora_A, m.lora_B))]

    def dense(s):
        deltas = [
            (m.lora_alpha / m.lora_A.shape[-2]) * (m.lora_B @ m.lora_A) for m in s.adapters.values()
        ]
        return s.weight + s.gate[0] * deltas[0] + s.gate[1] * deltas[1]

    def loss(fs, run):
        t = eqx.tree_at(leaves, s, fs)
        return jnp.sum(jnp.sin(run(t, x)))

    # jitted, both sides: one compile each, not one per operation
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    with strict():
        got = jax.jit(use_implicit_args(fn))(s, x)
        grads = grad(leaves(s), use_implicit_args(fn))
    np.testing.assert_allclose(got, jax.jit(lambda s: fn(dense(s), x))(s), rtol=1e-4, atol=1e-4)
    want = grad(leaves(s), lambda t, x: fn(dense(t), x))
    assert np.all(np.abs(want[0]) > 0)  # the gate's gradient is not trivially zero
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)


def test_each_adapter_has_its_own_modules_to_save(lm):
    """Two adapters, each with its own copy of the output head (PEFT's per-adapter
    `modules_to_save`): calls, mixed batches, training and unloading use the right copy."""
    config = LoraConfig(target_modules=["q_proj"], r=2, modules_to_save=["lm_head"])
    two = get_peft_model(lm, config, key=KEY_A).add_adapter("b", config, key=KEY_B)
    assert set(two.saved_modules) == {"default", "b"}
    # give each adapter's head copy its own values, as if each had been trained
    heads = {
        n: lm.lm_head.weight + 0.5 * jax.random.normal(jax.random.key(i), lm.lm_head.weight.shape)
        for i, n in enumerate(("default", "b"))
    }
    two = eqx.tree_at(
        lambda m: [m.saved_modules[n]["lm_head"].weight for n in ("default", "b")],
        two,
        [heads["default"], heads["b"]],
    )
    x = jnp.array([1, 2, 3, 4])
    with_head = {n: eqx.tree_at(lambda m: m.lm_head.weight, lm, heads[n]) for n in heads}
    # LoRA factors start with B = 0, so each adapter alone is the base model with its head
    for name in ("default", "b"):
        with strict():
            np.testing.assert_allclose(
                _run(two.set_adapter(name), x), _run(with_head[name], x), rtol=1e-6, atol=1e-6
            )
    np.testing.assert_array_equal(_run(two.disable_adapters(), x), _run(lm, x))
    np.testing.assert_array_equal(two.unload().lm_head.weight, heads["default"])
    np.testing.assert_array_equal(
        two.set_adapter("b").merge_and_unload().lm_head.weight, heads["b"]
    )
    xs = jnp.stack([x, x[::-1], x + 1])
    names = ["b", peftx.BASE, "default"]
    want = jnp.stack([_run({**with_head, peftx.BASE: lm}[n], xi) for n, xi in zip(names, xs)])
    with strict():
        got = jax.vmap(lambda xi, i: _run(two, xi, i))(xs, two.adapter_ids(names))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # training "b" moves only b's head copy
    trainable, frozen = partition(two.set_adapter("b"))
    grads = eqx.filter_grad(lambda t: _run(eqx.combine(t, frozen), x).sum())(trainable)
    assert grads.saved_modules["default"]["lm_head"].weight is None
    assert float(jnp.abs(grads.saved_modules["b"]["lm_head"].weight).max()) > 0
    assert grads.base_model.lm_head.weight is None


def test_modules_to_save_parameter_counts_match_peft(capsys):
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model

    # (PEFT matches modules_to_save by a plain suffix, so "out" would also hit "lora_dropout")
    kwargs = dict(r=4, target_modules=["q_proj"], modules_to_save=["v_proj"])
    torch_model = torch_get_peft_model(TorchNet(), TorchLoraConfig(**kwargs))
    torch_model.add_adapter("b", TorchLoraConfig(**kwargs))
    torch_model.print_trainable_parameters()
    want = capsys.readouterr().out.strip()
    ours = get_peft_model(BatchedNet(jax.random.key(0)), LoraConfig(**kwargs), key=KEY_A)
    ours = ours.add_adapter("b", LoraConfig(**kwargs), key=KEY_B)
    ours.print_trainable_parameters()
    assert capsys.readouterr().out.strip() == want
    with pytest.raises(ValueError, match=r"\['v_proj'\] cannot follow a batch-wide adapter gate"):
        ours(jnp.ones((2, 8)), adapter_names=["b", "default"])
