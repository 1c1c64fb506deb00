"""A new adapter kind is one config class and one array class: a scaled-identity adapter
(`(s·I)·W`, one learned scalar per layer) written only here goes through `get_peft_model`,
`partition`, training, save and load in PEFT's layout, and merge, with no library edit.
It is checked against the dense formula `s·W`, written out here."""

import dataclasses
import json
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from helpers import close

import peftx
from peftx._config import CONFIG_CLASSES
from peftx.adapters import AbstractAdapter
from peftx.implicit import primitive_handler, use_implicit_args


class ScaledIdentity(AbstractAdapter):
    """`(s·I)·W = s·W`: the layer's output scaled by one learned number."""

    weight: Any
    scale: jax.Array  # (1,)

    peft_keys: ClassVar[dict[str, str]] = {"scale": "scale_s"}
    weight_axes: ClassVar[dict[str, tuple[int | None, ...]]] = {"scale": (None,)}

    def merged(self, weight: jax.Array) -> jax.Array:
        return weight * self.scale[0].astype(weight.dtype)


def _scaled_product(w: ScaledIdentity, x: jax.Array, w_is_lhs: bool, params: dict) -> jax.Array:
    operands = (w.weight, x) if w_is_lhs else (x, w.weight)
    out = use_implicit_args(lambda a, b: jax.lax.dot_general_p.bind(a, b, **params))(*operands)
    return out * w.scale[0].astype(out.dtype)


@primitive_handler("dot_general")
def _scaled_lhs(primitive, w: ScaledIdentity, x: jax.Array, **params):
    return _scaled_product(w, x, True, params)


@primitive_handler("dot_general")
def _scaled_rhs(primitive, x: jax.Array, w: ScaledIdentity, **params):
    return _scaled_product(w, x, False, params)


class Block(eqx.Module):
    q: eqx.nn.Linear
    v: eqx.nn.Linear

    def __call__(self, x):
        return x + jnp.tanh(self.v(self.q(x)))


class Body(eqx.Module):
    layers: list[Block]


class Tiny(eqx.Module):
    body: Body
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.body = Body(
            [
                Block(
                    eqx.nn.Linear(4, 4, key=keys[2 * i]), eqx.nn.Linear(4, 4, key=keys[2 * i + 1])
                )
                for i in range(2)
            ]
        )
        self.head = eqx.nn.Linear(4, 3, key=keys[4])

    def __call__(self, x):
        for block in self.body.layers:
            x = block(x)
        return self.head(x)


def _linear(model, i: int, name: str) -> eqx.nn.Linear:
    return getattr(model.body.layers[i], name)


def _dense(model: Tiny, scales: dict[str, float], x):
    """The model with `s·W` written into each adapted weight, run plainly."""
    for path, s in scales.items():
        i, name = int(path.split(".")[2]), path.split(".")[3]
        model = eqx.tree_at(
            lambda m, i=i, name=name: _linear(m, i, name).weight,
            model,
            s * _linear(model, i, name).weight,
        )
    return jax.vmap(model)(x)


@pytest.fixture
def config():
    """The kind's config class, defined (so registered by its `peft_type`) for one test
    and then taken out of the registry, so that other tests see peftx's own kinds only."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ScaledIdentityConfig(peftx.AbstractAdapterConfig):
        peft_type: Literal["SCALED_IDENTITY"] = "SCALED_IDENTITY"
        init_scale: float = 1.0

        def build(self, base, layer, *, key):
            return ScaledIdentity(base, jnp.full((1,), self.init_scale, jnp.float32))

    yield ScaledIdentityConfig(init_scale=1.5, target_modules=["q", "v"], layers_to_transform=[1])
    del CONFIG_CLASSES["SCALED_IDENTITY"]


def test_new_kind_through_get_peft_model_partition_and_training(getkey, config):
    base = Tiny(getkey())
    x = jax.random.normal(getkey(), (5, 4))
    model = peftx.get_peft_model(base, config, key=getkey())
    close(jax.vmap(model)(x), _dense(base, {"body.layers.1.q": 1.5, "body.layers.1.v": 1.5}, x))
    assert peftx.targets(base, config).paths() == ["body.layers.1.q", "body.layers.1.v"]
    assert [t.path for t in peftx.targets(base, config).layers] == [
        "body.layers.1.q",
        "body.layers.1.v",
    ]

    trainable, frozen = peftx.partition(model)
    leaves = jax.tree.leaves(trainable)
    assert [leaf.shape for leaf in leaves] == [(1,), (1,)]  # only the two scales train
    assert model.get_nb_trainable_parameters() == (
        2,
        sum(a.size for a in jax.tree.leaves(base)) + 2,
    )

    def loss(trainable, x):
        out = jax.vmap(eqx.combine(trainable, frozen))(x)
        return jnp.mean((out - 1.0) ** 2)

    optimizer = optax.sgd(0.5)
    state = optimizer.init(trainable)

    @eqx.filter_jit
    def step(trainable, state, x):
        grads = jax.grad(loss)(trainable, x)
        updates, state = optimizer.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state

    before = loss(trainable, x)
    for _ in range(20):
        trainable, state = step(trainable, state, x)
    assert loss(trainable, x) < before
    trained = eqx.combine(trainable, frozen)
    scales = {
        f"body.layers.1.{n}": float(
            _linear(trained.base_model, 1, n).weight.adapters["default"].scale[0]
        )
        for n in ("q", "v")
    }
    assert all(s != 1.5 for s in scales.values())
    close(jax.vmap(trained)(x), _dense(base, scales, x))


def test_new_kind_saves_and_loads_in_peft_layout_and_merges(getkey, tmp_path, config):
    base = Tiny(getkey())
    x = jax.random.normal(getkey(), (5, 4))
    model = peftx.get_peft_model(base, config, key=getkey())
    model = eqx.tree_at(
        lambda m: _linear(m.base_model, 1, "v").weight.adapters["default"].scale,
        model,
        jnp.asarray([-0.5]),
    )
    model.save_pretrained(tmp_path)

    stored = safetensors.numpy.load_file(tmp_path / "adapter_model.safetensors")
    assert {k: v.tolist() for k, v in stored.items()} == {
        "base_model.model.body.layers.1.q.scale_s": [1.5],
        "base_model.model.body.layers.1.v.scale_s": [-0.5],
    }
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "SCALED_IDENTITY" and saved["init_scale"] == 1.5
    assert saved["target_modules"] == ["q", "v"] and saved["layers_to_transform"] == [1]

    loaded = peftx.PeftModel.from_pretrained(base, tmp_path, is_trainable=True)
    assert loaded.peft_config["default"] == dataclasses.replace(
        config, inference_mode=False, base_model_name_or_path=None
    )
    want = _dense(base, {"body.layers.1.q": 1.5, "body.layers.1.v": -0.5}, x)
    close(jax.vmap(loaded)(x), want)
    merged = loaded.merge_and_unload()
    assert type(merged) is Tiny
    np.testing.assert_allclose(
        np.asarray(_linear(merged, 1, "v").weight), -0.5 * np.asarray(_linear(base, 1, "v").weight)
    )
    close(jax.vmap(merged)(x), want)

    # PEFT's strictness holds for the new kind too: a wrong shape names the key
    safetensors.numpy.save_file(
        {**stored, "base_model.model.body.layers.1.v.scale_s": np.ones(2, np.float32)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    with pytest.raises(peftx.CheckpointError, match=r"body\.layers\.1\.v\.scale_s.*shape \(2,\)"):
        peftx.PeftModel.from_pretrained(base, tmp_path)


def test_new_kind_is_loaded_by_peft_type(config):
    assert peftx.load_config(config.to_dict()) == config


def test_a_kind_without_build_is_refused_when_defined():
    with pytest.raises(TypeError, match="NoBuild must implement build"):

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class NoBuild(peftx.AbstractAdapterConfig):
            peft_type: Literal["NO_BUILD"] = "NO_BUILD"
