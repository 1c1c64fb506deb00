"""`get_peft_model`: placement by PEFT configs, partition, training, merge and unload."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from test_select import CausalLM

import peftx
from peftx import IA3Config, LoraConfig, get_peft_model, partition
from peftx.adapters import DoraArray, IA3Array, LoraArray
from peftx.implicit import strict


def _adapted_paths(peft_model, cls=LoraArray):
    sel = peftx.select(peft_model.base_model).at(peftx.of_type(eqx.nn.Linear))
    return [p for p, n in zip(sel.paths(), sel.get()) if isinstance(n.weight, cls)]


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
        return peftx.use_implicit_args(body)(model.base_model, x)
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
    assert all(isinstance(n.weight, IA3Array) and n.weight.is_feedforward for n in ia3_layers)


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
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with strict(), jax.numpy_dtype_promotion("standard"):
        for _ in range(50):
            trainable, opt_state, loss = step(trainable, opt_state)
            losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    trained = eqx.combine(trainable, frozen)
    base = jax.tree.leaves(eqx.filter(trained.unload(), eqx.is_array))
    original = jax.tree.leaves(eqx.filter(lm, eqx.is_array))
    assert all(jnp.array_equal(a, b) for a, b in zip(base, original, strict=True))
    grads = eqx.filter_grad(loss_fn)(trainable)
    leaves = jax.tree.leaves(grads)
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
    assert trainable.base_model.lm_head.weight.shape == (11, 4)
    assert trainable.base_model.model.layers[0].mlp["up_proj"].bias.shape == (8,)
    assert trainable.base_model.model.layers[0].mlp["down_proj"].bias is None


def test_print_trainable_parameters_matches_peft(capsys):
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model

    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(16, 16)
            self.v_proj = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 4)

    class Eqx(eqx.Module):
        q_proj: eqx.nn.Linear
        v_proj: eqx.nn.Linear
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.q_proj, self.v_proj = eqx.nn.Linear(16, 16, key=k1), eqx.nn.Linear(16, 16, key=k2)
            self.out = eqx.nn.Linear(16, 4, key=k3)

    torch_get_peft_model(
        Torch(), TorchLoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    ).print_trainable_parameters()
    want = capsys.readouterr().out.strip()
    get_peft_model(
        Eqx(jax.random.key(0)),
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
        match=r"'model.embed_tokens' is a Embedding; LORA adapts eqx.nn.Linear",
    ):
        get_peft_model(lm, LoraConfig(target_modules=["embed_tokens"]), key=jax.random.key(0))
