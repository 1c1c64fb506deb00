"""A new adapter kind is one module, written as a library kind is (`scaled_identity.py`: a
scaled-identity adapter, `(s·I)·W`, one learned scalar per layer): it goes through
`get_peft_model`, `partition`, training, save and load in PEFT's layout, merge, its field
checks, default targets and TOML table, with no edit to any shared module of peftx. It is
checked against the dense formula `s·W`, written out here."""

import dataclasses
import json
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from helpers import close

import peftx
from peftx._config import CONFIG_CLASSES, TOML_TABLES, table_names


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
def kind():
    """The kind's module, its config class registered (by its `peft_type` and TOML table)
    for one test and then taken out of the registry, so that other tests see peftx's own
    kinds only."""
    import scaled_identity

    cls = scaled_identity.ScaledIdentityConfig
    CONFIG_CLASSES[cls._PEFT_TYPE], TOML_TABLES[cls.toml_table] = cls, cls
    yield scaled_identity
    del CONFIG_CLASSES[cls._PEFT_TYPE], TOML_TABLES[cls.toml_table]


@pytest.fixture
def config(kind):
    return kind.ScaledIdentityConfig(
        init_scale=1.5, target_modules=["q", "v"], layers_to_transform=[1]
    )


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


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(init_scale=math.inf), ValueError, r"`init_scale` must be a finite number .*got inf"),
        (dict(init_scale="2"), TypeError, r"`init_scale` must be a number; got '2' of type str"),
        (
            dict(init="rand"),
            ValueError,
            r"'constant', 'random'; got 'rand'\. Did you mean 'random'",
        ),
    ],
)
def test_new_kind_fields_are_checked_by_their_declarations(kind, fields, error, match):
    with pytest.raises(error, match=match):
        kind.ScaledIdentityConfig(**fields)
    with pytest.raises(error, match=match):
        peftx.load_config({"peft_type": "SCALED_IDENTITY", **fields})


def test_new_kind_default_targets_and_toml_table(getkey, kind, tmp_path):
    cls = kind.ScaledIdentityConfig
    found = peftx.targets(Tiny(getkey()), cls(init="random"), model_type="tiny")
    assert found.paths() == [f"body.layers.{i}.{n}" for i in range(2) for n in ("q", "v")]
    assert "[scaled_identity]" in table_names()
    path = tmp_path / "kind.toml"
    path.write_text('[scaled_identity]\ninit_scale = 2.0\ntarget_modules = ["q"]\n')
    assert peftx.from_toml(path) == cls(init_scale=2.0, target_modules=["q"])


def test_a_kind_without_build_is_refused_when_defined():
    with pytest.raises(TypeError, match="NoBuild must implement build"):

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class NoBuild(peftx.AbstractAdapterConfig):
            peft_type: Literal["NO_BUILD"] = "NO_BUILD"
