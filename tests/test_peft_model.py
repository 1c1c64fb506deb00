"""`get_peft_model`: placement by PEFT configs, partition, training, merge and unload."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_select import CausalLM

import peftx
from peftx import IA3Config, LoraConfig, get_peft_model, partition
from peftx.adapters import AdapterSet, DoraArray, IA3Array, LoraArray
from peftx.implicit import strict


def _adapted_paths(peft_model, cls=LoraArray, name="default"):
    sel = peftx.select(peft_model.base_model).at(peftx.of_type(eqx.nn.Linear))
    return [
        p
        for p, n in zip(sel.paths(), sel.get())
        if isinstance(n.weight, AdapterSet) and isinstance(n.weight.adapters.get(name), cls)
    ]


def _run(model, x):
    """Next-token logits of the toy LM for a token sequence (vmap inside the wrapper)."""

    def body(m, x):
        h = jax.vmap(m.model.embed_tokens)(x)
        for layer in m.model.layers:
            attn = layer.self_attn
            h = h + jax.vmap(
                lambda v: attn.o_proj(attn.v_proj(v) * jnp.tanh(attn.q_proj(v) + attn.k_proj(v)))
            )(h)
            h = h + jax.vmap(
                lambda v: layer.mlp["down_proj"](jax.nn.gelu(layer.mlp["up_proj"](v)))
            )(h)
        return jax.vmap(m.lm_head)(h)

    if isinstance(model, peftx.PeftModel):
        return peftx.use_implicit_args(body)(model.prepared(), x)
    return body(model, x)


def test_target_forms_place_adapters_where_peft_would():
    lm = CausalLM()
    key = jax.random.key(0)
    listed = get_peft_model(lm, LoraConfig(target_modules=["q_proj", "v_proj"], r=2), key=key)
    assert len(_adapted_paths(listed)) == 8
    regex = get_peft_model(lm, LoraConfig(target_modules=r".*layers\.1\..*_proj", r=2), key=key)
    assert _adapted_paths(regex) == [
        f"model.layers.1.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.down_proj",
            "mlp.up_proj",
        )
    ]
    every = get_peft_model(lm, LoraConfig(target_modules="all-linear", r=2), key=key)
    assert len(_adapted_paths(every)) == 24 and "lm_head" not in _adapted_paths(every)
    some = get_peft_model(
        lm, LoraConfig(target_modules=["q_proj"], layers_to_transform=[0, 2], r=2), key=key
    )
    assert _adapted_paths(some) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.2.self_attn.q_proj",
    ]
    dora = get_peft_model(lm, LoraConfig(target_modules=["q_proj"], r=2, use_dora=True), key=key)
    assert len(_adapted_paths(dora, DoraArray)) == 4
    ia3 = get_peft_model(
        lm,
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
        key=key,
    )
    ia3_layers = peftx.select(ia3.base_model).at(peftx.named("down_proj")).get()
    assert all(n.weight.adapters["default"].is_feedforward for n in ia3_layers)
    assert len(_adapted_paths(ia3, IA3Array)) == 8


def test_default_init_keeps_the_base_output():
    lm = CausalLM()
    x = jnp.array([1, 2, 3, 4])
    for config in (
        LoraConfig(target_modules="all-linear", r=2),
        IA3Config(target_modules=["k_proj", "v_proj"]),
    ):
        peft_model = get_peft_model(lm, config, key=jax.random.key(1))
        with strict():
            np.testing.assert_array_equal(_run(peft_model, x), _run(lm, x))


def test_training_moves_only_the_adapters_and_lowers_the_loss():
    lm = CausalLM()
    peft_model = get_peft_model(
        lm,
        LoraConfig(target_modules=["q_proj", "v_proj", "up_proj"], r=2, lora_alpha=4),
        key=jax.random.key(2),
    )
    trainable, frozen = partition(peft_model)
    x = jnp.array([1, 2, 3, 4, 5, 6])
    y = jnp.array([2, 3, 4, 5, 6, 7])
    optim = optax.adam(3e-2)
    opt_state = optim.init(trainable)

    def loss_fn(trainable):
        logits = _run(eqx.combine(trainable, frozen), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(trainable, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss, grads

    losses = []
    with strict(), jax.numpy_dtype_promotion("standard"):
        for _ in range(50):
            trainable, opt_state, loss, grads = step(trainable, opt_state)
            losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    trained = eqx.combine(trainable, frozen)
    base = jax.tree.leaves(eqx.filter(trained.disable_adapters(), eqx.is_array))
    original = jax.tree.leaves(eqx.filter(lm, eqx.is_array))
    assert all(jnp.array_equal(a, b) for a, b in zip(base, original, strict=True))
    leaves = jax.tree.leaves(grads)  # the last step's: a gradient for each adapter factor
    assert len(leaves) == 2 * 3 * 4 and all(leaf.shape[0] in (2, 4, 8) for leaf in leaves)

    merged = trained.merge_and_unload()
    assert type(merged) is CausalLM
    np.testing.assert_allclose(_run(merged, x), _run(trained, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_run(trained.disable_adapters(), x), _run(lm, x))


def test_modules_to_save_and_bias_train():
    lm = CausalLM()
    peft_model = get_peft_model(
        lm,
        LoraConfig(target_modules=["up_proj"], modules_to_save=["lm_head"], bias="lora_only", r=2),
        key=jax.random.key(0),
    )
    trainable, _ = partition(peft_model)
    assert trainable.saved_modules["default"]["lm_head"].weight.shape == (11, 4)
    assert trainable.base_model.lm_head.weight is None  # the original stays frozen
    assert trainable.base_model.model.layers[0].mlp["up_proj"].bias.shape == (8,)
    assert trainable.base_model.model.layers[0].mlp["down_proj"].bias is None


def test_print_trainable_parameters_matches_peft(capsys):
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model
    from test_multi_adapter import BatchedNet, TorchNet

    torch_get_peft_model(
        TorchNet(), TorchLoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    ).print_trainable_parameters()
    want = capsys.readouterr().out.strip()
    get_peft_model(
        BatchedNet(jax.random.key(0)),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        key=jax.random.key(0),
    ).print_trainable_parameters()
    assert capsys.readouterr().out.strip() == want


def test_errors():
    lm = CausalLM()
    with pytest.raises(peftx.TargetNotFoundError, match=r"Closest module names: \[.*'q_proj'"):
        get_peft_model(lm, LoraConfig(target_modules=["q_prj"]), key=jax.random.key(0))
    with pytest.raises(
        peftx.UnsupportedTargetError,
        match=r"DoRA \(use_dora=True\) adapts Linear .*'model.embed_tokens' is an eqx.nn.Embedding",
    ):
        get_peft_model(
            lm,
            LoraConfig(target_modules=["embed_tokens"], r=2, use_dora=True),
            key=jax.random.key(0),
        )
    with pytest.raises(
        peftx.UnsupportedTargetError, match=r"IA3 adapts Linear layers only; 'model.embed_tokens'"
    ):
        get_peft_model(lm, IA3Config(target_modules=["embed_tokens"]), key=jax.random.key(0))


def test_adapter_name_errors():
    lm = CausalLM()
    config = LoraConfig(target_modules=["q_proj"], r=2)
    model = get_peft_model(lm, config, key=jax.random.key(0))
    for call in (
        lambda: model.set_adapter("defualt"),
        lambda: model.delete_adapter("defualt"),
        lambda: model.add_weighted_adapter(["defualt"], [1.0], "mix", "linear"),
        lambda: model.adapter_ids(["default", "defualt"]),
        lambda: model.merge_and_unload(["defualt"]),
        lambda: partition(model, ["defualt"]),
    ):
        with pytest.raises(
            peftx.UnknownAdapterError, match=r"no adapter named 'defualt'.*Did you mean 'default'"
        ):
            call()
    with pytest.raises(ValueError, match=r"an adapter named 'default' exists already"):
        model.add_adapter("default", config, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"'__base__' cannot name an adapter"):
        model.add_adapter(peftx.BASE, config, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"adapters are LORA; a IA3 adapter cannot join"):
        model.add_adapter("ia3", IA3Config(target_modules=["k_proj"]), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"'default' is the only adapter.*unload"):
        model.delete_adapter("default")
    with pytest.raises(TypeError, match=r"already; add another adapter with"):
        get_peft_model(model, config, key=jax.random.key(1))
    two = model.add_adapter("b", LoraConfig(target_modules=["q_proj"], r=3), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"'linear' needs adapters of one rank, got r=\[2, 3\]"):
        two.add_weighted_adapter(["default", "b"], [1.0, 1.0], "mix", "linear")
    with pytest.raises(ValueError, match=r"one weight per adapter, got 2 adapters and 1 weights"):
        two.add_weighted_adapter(["default", "b"], [1.0], "mix", "cat")
    heads = two.add_adapter(
        "c", LoraConfig(target_modules=["q_proj"], r=2, modules_to_save=["lm_head"]), key=key0()
    ).add_adapter(
        "d", LoraConfig(target_modules=["q_proj"], r=2, modules_to_save=["lm_head"]), key=key0()
    )
    with pytest.raises(ValueError, match=r"each have their own copy of \['lm_head'\]"):
        heads.add_weighted_adapter(["c", "d"], [1.0, 1.0], "mix", "cat")
    with pytest.raises(peftx.TargetNotFoundError, match=r"Closest module names"):
        two.add_adapter(
            "e", LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_haed"]), key=key0()
        )


def key0():
    return jax.random.key(0)


def test_layers_to_transform_out_of_range():
    with pytest.raises(ValueError, match=r"names layer\(s\) \[4, 7\] .* are 0\.\.3"):
        get_peft_model(
            CausalLM(),
            LoraConfig(target_modules=["q_proj"], layers_to_transform=[1, 4, 7]),
            key=key0(),
        )
    with pytest.raises(ValueError, match=r"names layer\(s\) \[0\] .* after 'blocks' are none"):
        get_peft_model(
            CausalLM(),
            LoraConfig(target_modules=["q_proj"], layers_to_transform=0, layers_pattern="blocks"),
            key=key0(),
        )


class _Config(eqx.Module):
    model_type: str = eqx.field(static=True)


class HFStyleLM(eqx.Module):
    """A transformers-like model carrying `config.model_type`."""

    lm: CausalLM
    config: _Config


def test_default_target_modules_follow_peft():
    from peft.utils import constants

    from peftx.adapters import _ia3
    from peftx.adapters._lora import LORA_TARGET_MODULES

    for ours, theirs in (
        (
            LORA_TARGET_MODULES,
            constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
        ),
        (_ia3.IA3_TARGET_MODULES, constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING),
        (
            _ia3.IA3_FEEDFORWARD_MODULES,
            constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING,
        ),
    ):
        assert {k: list(v) for k, v in ours.items()} == {k: theirs[k] for k in ours}
    model = HFStyleLM(CausalLM(), _Config("llama"))
    lora_model = get_peft_model(model, LoraConfig(r=2), key=key0())
    sel = peftx.select(lora_model.base_model).at(peftx.of_type(eqx.nn.Linear))
    adapted = [p for p, n in zip(sel.paths(), sel.get()) if isinstance(n.weight, AdapterSet)]
    assert adapted == [
        f"lm.model.layers.{i}.self_attn.{m}" for i in range(4) for m in ("q_proj", "v_proj")
    ]
    assert lora_model.peft_config["default"].target_modules == ("q_proj", "v_proj")
    ia3_model = get_peft_model(CausalLM(), IA3Config(), key=key0(), model_type="llama")
    down = ia3_model.base_model.model.layers[0].mlp["down_proj"].weight.adapters["default"]
    assert down.is_feedforward
    with pytest.raises(ValueError, match=r"no LORA default for model type 'mamba'.*bert"):
        get_peft_model(CausalLM(), LoraConfig(), key=key0(), model_type="mamba")
    with pytest.raises(ValueError, match=r"model type None"):
        get_peft_model(CausalLM(), LoraConfig(), key=key0())


class Classifier(eqx.Module):
    encoder: eqx.nn.MLP
    classifier: eqx.nn.Linear
    pooler: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.MLP(4, 4, 8, 2, key=k1)
        self.classifier = eqx.nn.Linear(4, 2, key=k2)
        self.pooler = eqx.nn.Linear(4, 4, key=k3)


class Plain(eqx.Module):
    encoder: eqx.nn.MLP
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.MLP(4, 4, 8, 2, key=k1)
        self.out = eqx.nn.Linear(4, 2, key=k2)


def test_all_linear_skips_the_output_head():
    def adapted(model):
        peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=2), key=key0())
        sel = peftx.select(peft_model.base_model).at(peftx.of_type(eqx.nn.Linear))
        return [p for p, n in zip(sel.paths(), sel.get()) if isinstance(n.weight, AdapterSet)]

    encoder = [f"encoder.layers.{i}" for i in range(3)]
    # a head found by its name, even when it is not the last Linear
    assert adapted(Classifier(key0())) == [*encoder, "pooler"]
    # no head name: the last Linear directly on the model
    assert adapted(Plain(key0())) == encoder
    # no head at all: an MLP's last layer is a hidden layer like the others
    assert adapted(eqx.nn.MLP(4, 4, 8, 2, key=key0())) == [f"layers.{i}" for i in range(3)]


def test_embedding_lora_through_get_peft_model():
    lm = CausalLM()
    config = LoraConfig(target_modules=["embed_tokens", "q_proj"], r=2, init_lora_weights=False)
    peft_model = get_peft_model(lm, config, key=key0())
    embed = peft_model.base_model.model.embed_tokens.weight
    assert isinstance(embed.adapters["default"], peftx.adapters.LoraEmbeddingArray)
    x = jnp.array([1, 5, 3, 10])
    with strict():
        out = _run(peft_model, x)
    merged = peft_model.merge_and_unload()
    np.testing.assert_allclose(out, _run(merged, x), rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, _run(lm, x), atol=1e-3)
    trainable, _ = partition(peft_model)
    factors = trainable.base_model.model.embed_tokens.weight.adapters["default"]
    assert factors.lora_embedding_A.shape == (2, 11) and factors.lora_embedding_B.shape == (4, 2)


def test_stacked_layers_under_scan():
    """Layers made by `eqx.filter_vmap` and run with `lax.scan` get one adapter each."""
    from test_select import Layer

    stacked = eqx.filter_vmap(lambda k: Layer(4, k))(jax.random.split(key0(), 3))

    def forward(layers, x):
        def body(h, layer):
            attn = layer.self_attn
            return h + jax.vmap(lambda v: attn.o_proj(jnp.tanh(attn.q_proj(v))))(h), None

        return jax.lax.scan(body, x, layers)[0]

    x = jax.random.normal(jax.random.key(1), (5, 4))
    for config in (
        LoraConfig(target_modules=["q_proj", "o_proj"], r=2, init_lora_weights=False),
        LoraConfig(target_modules=["q_proj"], r=2, init_lora_weights=False, use_dora=True),
        IA3Config(target_modules=["q_proj"]),
    ):
        peft_model = get_peft_model({"layers": stacked}, config, key=key0())
        q = peft_model.base_model["layers"].self_attn.q_proj.weight
        assert q.adapters["default"].weight.shape == (3, 4, 4)
        with strict():
            got = peftx.use_implicit_args(forward)(peft_model.prepared()["layers"], x)
            grads = jax.grad(
                lambda t: peftx.use_implicit_args(lambda m: forward(m, x).sum())(
                    eqx.combine(t, partition(peft_model)[1]).prepared()["layers"]
                )
            )(partition(peft_model)[0])
        merged = peft_model.merge_and_unload()["layers"]
        np.testing.assert_allclose(got, forward(merged, x), rtol=1e-5, atol=1e-5)
        assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


def test_a_target_that_cannot_be_adapted_names_path_and_type():
    class WithNorm(eqx.Module):
        norm: eqx.nn.LayerNorm
        proj: eqx.nn.Linear

    model = WithNorm(eqx.nn.LayerNorm(4), eqx.nn.Linear(4, 4, key=key0()))
    with pytest.raises(
        peftx.UnsupportedTargetError,
        match=r"target 'norm' is a LayerNorm; LORA adapts eqx.nn.Linear, eqx.nn.Conv and",
    ):
        get_peft_model(model, LoraConfig(target_modules=["norm", "proj"]), key=key0())


def test_fan_in_fan_out_is_ignored_with_a_warning_as_in_peft():
    config = LoraConfig(target_modules=["q_proj"], r=2, fan_in_fan_out=True)
    with pytest.warns(UserWarning, match=r"fan_in_fan_out=True, but eqx.nn.Linear.*ignored"):
        model = get_peft_model(CausalLM(), config, key=key0())
    assert model.base_model.model.layers[0].self_attn.q_proj.weight.adapters[
        "default"
    ].lora_A.shape == (2, 4)


def test_targets_is_the_dry_run_of_get_peft_model():
    lm = CausalLM()
    config = LoraConfig(target_modules=["q_proj", "mlp"], layers_to_transform=[1, 2], r=2)
    selection = peftx.targets(lm, config)
    # "mlp" names a container (a dict of layers); PEFT adapts the layers matched themselves
    assert selection.paths() == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.2.self_attn.q_proj",
    ]
    table = selection.table()
    assert "model.layers.2.self_attn.q_proj" in table and "Linear" in table
    sel = peftx.select(get_peft_model(lm, config, key=key0()).base_model)
    adapted = [p for p, n in zip(sel.paths(), sel.get()) if isinstance(n, AdapterSet)]
    assert [p.removesuffix(".weight") for p in adapted] == selection.paths()
    assert peftx.targets(HFStyleLM(lm, _Config("llama")), LoraConfig()).paths()[:2] == [
        "lm.model.layers.0.self_attn.q_proj",
        "lm.model.layers.0.self_attn.v_proj",
    ]
    with pytest.raises(peftx.TargetNotFoundError, match=r"Closest module names"):
        peftx.targets(lm, LoraConfig(target_modules=["q_prj"]))
