"""Every field of every config does something. Changing it changes the adapter that
`get_peft_model` builds (its arrays and static settings, what trains, the modules it
copies) or the weights it saves; or it is refused where it does not apply (an error, or,
for `fan_in_fan_out` on `(out, in)` weights, PEFT's warning that it is ignored). PEFT's
bookkeeping fields change only the `adapter_config.json` PEFT reads, and the test checks
that; AdaLoRA's schedule fields change what a few steps of `peftx.train` leave. A field
without a case below fails the test, so no field can be accepted and then ignored (as
`IA3Config.init_ia3_weights` once was)."""

import dataclasses
import functools
import json
import pathlib
import tempfile
import warnings

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
import safetensors.numpy

import peftx


class Experts(eqx.Module):
    gate_up_proj: jax.Array  # a stack of 2 experts' (out, in) weights


class Block(eqx.Module):
    q: eqx.nn.Linear
    v: eqx.nn.Linear
    fc: eqx.nn.Linear
    experts: Experts


class Group(eqx.Module):
    layers: list[Block]


class Body(eqx.Module):
    groups: list[Group]


class Tiny(eqx.Module):
    """Paths `body.groups.{0,1}.layers.{0,1}.{q,v,fc}` and `classifier`. Two numbered
    segments: PEFT's layer index is the first (`groups`) unless `layers_pattern` names
    the other (`layers`)."""

    body: Body
    classifier: eqx.nn.Linear

    def __init__(self, key):
        k = iter(jax.random.split(key, 13))

        def block():
            linears = (eqx.nn.Linear(4, 4, key=next(k)) for _ in range(3))
            return Block(*linears, Experts(jax.numpy.ones((2, 6, 4))))

        self.body = Body([Group([block(), block()]) for _ in range(2)])
        self.classifier = eqx.nn.Linear(4, 2, key=next(k))

    def __call__(self, x):
        for group in self.body.groups:
            for b in group.layers:
                x = jax.numpy.tanh(b.fc(b.v(b.q(x))))
        return self.classifier(x)


COMMON = {  # field: (changed value, what it does)
    "task_type": ("SEQ_CLS", "builds"),  # the classifier joins modules_to_save
    "base_model_name_or_path": ("org/base", "file"),
    "revision": ("v1", "file"),
    "peft_version": ("0.1.0", "file"),
    "inference_mode": (True, "builds"),  # nothing trains
    "target_modules": (("q",), "builds"),
    "exclude_modules": (("fc",), "builds"),
    "fan_in_fan_out": (True, "warns"),
    "modules_to_save": (("classifier",), "builds"),
    "layers_to_transform": ((1,), "builds"),
    "layers_pattern": ("layers", "builds"),
}
# each case's own starting point, where the field needs another field to act
STARTS = {
    "layers_to_transform": {"layers_to_transform": (0, 1)},
    "layers_pattern": {"layers_to_transform": (0,)},  # group 0 vs layer 0 of each group
    "eps": {"coft": True},  # COFT's radius
    "decompose_both": {"decompose_factor": 4},
    # LoftQ's rounds, from one to two
    "loftq_config": {"init_lora_weights": "loftq", "loftq_config": {"loftq_iter": 1}},
    "mini_r": {
        "init_weights": "mini"
    },  # MiSS's block width, used by "mini" only  # 4 = 4·1: w1 (4, 4), w2 (1, 1)
}
CASES = {
    peftx.LoraConfig: (
        {"r": 2, "lora_alpha": 4, "target_modules": ("q", "v", "fc"), "init_lora_weights": False},
        {
            **COMMON,
            "peft_type": ("IA3", "refused"),
            "r": (3, "builds"),
            "lora_alpha": (8, "builds"),
            "lora_dropout": (0.1, "builds"),
            "bias": ("all", "builds"),
            "use_rslora": (True, "builds"),
            "init_lora_weights": ("gaussian", "builds"),
            "rank_pattern": ({"q": 3}, "builds"),
            "alpha_pattern": ({"q": 8}, "builds"),
            "use_dora": (True, "builds"),
            "loftq_config": ({"loftq_iter": 2}, "builds"),
            # read by `peftx.initialize_lora` (tests/test_lora_data_inits.py), not by building
            "eva_config": (dataclasses.asdict(peftx.EvaConfig(rho=1.5)), "file"),
            "corda_config": (dataclasses.asdict(peftx.CordaConfig(corda_method="kpm")), "file"),
            "lora_ga_config": (dataclasses.asdict(peftx.LoraGAConfig(scale="unit")), "file"),
            "target_parameters": (("experts.gate_up_proj",), "builds"),
        },
    ),
    peftx.LoHaConfig: (
        {"r": 2, "alpha": 4, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LOKR", "refused"),
            "r": (3, "builds"),
            "alpha": (8, "builds"),
            "rank_dropout": (0.1, "builds"),
            "module_dropout": (0.1, "builds"),
            "use_effective_conv2d": (True, "refused"),
            "init_weights": (True, "builds"),
            "rank_pattern": ({"q": 3}, "builds"),
            "alpha_pattern": ({"q": 8}, "builds"),
        },
    ),
    peftx.LoKrConfig: (
        {"r": 1, "alpha": 4, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LOHA", "refused"),
            "r": (3, "builds"),
            "alpha": (8, "builds"),
            "rank_dropout": (0.1, "builds"),
            "module_dropout": (0.1, "builds"),
            "use_effective_conv2d": (True, "refused"),
            "decompose_both": (True, "builds"),  # w1 (4, 4) factored at rank 1
            "decompose_factor": (1, "builds"),  # (1, 4): w2 (4, 4) instead of (2, 2)
            "rank_dropout_scale": (True, "builds"),
            "init_weights": ("lycoris", "builds"),
            "rank_pattern": ({"q": 3}, "builds"),
            "alpha_pattern": ({"q": 8}, "builds"),
        },
    ),
    peftx.IA3Config: (
        {"target_modules": ("q", "v", "fc"), "feedforward_modules": ("fc",)},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "target_modules": (("q", "fc"), "builds"),  # a superset of feedforward_modules
            "feedforward_modules": (("v",), "builds"),
            "init_ia3_weights": (False, "builds"),
        },
    ),
    peftx.OFTConfig: (
        {"oft_block_size": 2, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "r": (2, "refused"),  # only with oft_block_size=0: r x oft_block_size = in
            "oft_block_size": (4, "builds"),
            # PEFT 0.21.2 never applies it, and says nothing; peftx warns
            "module_dropout": (0.1, "warns"),
            "bias": ("all", "builds"),
            "init_weights": (True, "builds"),
            "coft": (True, "builds"),
            "eps": (1e-3, "builds"),
            "block_share": (True, "builds"),
            "use_cayley_neumann": (False, "builds"),
            "num_cayley_neumann_terms": (3, "builds"),
        },
    ),
    peftx.VeraConfig: (
        {"r": 2, "target_modules": ("q", "v", "fc")},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "r": (3, "builds"),
            "projection_prng_key": (1, "builds"),
            "save_projection": (False, "builds"),  # the projections leave the file
            "vera_dropout": (0.1, "builds"),
            "d_initial": (0.5, "builds"),
            "bias": ("all", "builds"),
            "init_weights": (False, "builds"),
        },
    ),
    peftx.MissConfig: (
        {"r": 2, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            # PEFT's MissConfig has no fan_in_fan_out; peftx's base field warns it is ignored
            "peft_type": ("LORA", "refused"),
            "r": (3, "builds"),
            "miss_dropout": (0.1, "builds"),
            "mini_r": (4, "builds"),  # with init_weights="mini" (STARTS)
            "init_weights": ("bat", "builds"),
            "bias": ("all", "builds"),
        },
    ),
    peftx.ShiraConfig: (
        # r·(4 + 4) entries of each 4x4 weight: r = 1 or 2
        {"r": 1, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "r": (2, "builds"),
            "mask_type": ("mine", "refused"),  # PEFT's own masks are Python functions
            "random_seed": (1, "builds"),  # another index set
            "init_weights": (True, "builds"),
        },
    ),
    peftx.GraloraConfig: (
        {"r": 2, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "r": (4, "builds"),
            "hybrid_r": (1, "builds"),
            "alpha": (32, "builds"),
            "gralora_dropout": (0.1, "builds"),
            "gralora_k": (1, "builds"),
            "init_weights": (True, "builds"),
            "bias": ("all", "builds"),
        },
    ),
    peftx.HiraConfig: (
        {"r": 2, "target_modules": ("q", "v", "fc"), "init_weights": False},
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "r": (3, "builds"),
            "hira_dropout": (0.1, "builds"),
            "init_weights": ("gaussian", "builds"),
            # PEFT 0.21.2's HiRA never reads it; peftx warns
            "rank_pattern": ({"q": 3}, "warns"),
        },
    ),
    peftx.AdaLoraConfig: (
        {
            "init_r": 3,
            "target_r": 1,
            "total_step": 6,
            "tinit": 1,
            "tfinal": 1,
            "target_modules": ("q", "v", "fc"),
            "init_lora_weights": False,
        },
        {
            **COMMON,
            "peft_type": ("LORA", "refused"),
            "init_r": (4, "builds"),
            "lora_alpha": (4, "builds"),
            "lora_dropout": (0.1, "builds"),
            "bias": ("all", "builds"),
            "init_lora_weights": (True, "builds"),
            "rank_pattern": ({"body.groups.0.layers.0.q.lora_E": (True, False, True)}, "builds"),
            # the rest steer the rank allocator while training
            "target_r": (2, "trains"),
            "tinit": (2, "trains"),
            "tfinal": (2, "trains"),
            "deltaT": (2, "trains"),
            "beta1": (0.5, "trains"),
            "beta2": (0.5, "trains"),
            "orth_reg_weight": (0.0, "trains"),
            "total_step": (8, "trains"),
        },
    ),
}


@functools.cache  # the unchanged start trains once for all the cases
def _trained(config):
    """The model and allocator state after a few SGD steps of `peftx.train` on `Tiny`."""
    model = peftx.get_peft_model(Tiny(jax.random.key(0)), config, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8, 4))

    def loss_fn(model, batch, key):
        out = jax.vmap(model)(batch["x"])
        return jax.numpy.sum(out**2), {"count": jax.numpy.float32(out.shape[0])}

    optimizer = optax.sgd(0.1)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(3))
    step = peftx.train.make_train_step(loss_fn, optimizer)
    for _ in range(5):
        state, _ = step(state, frozen, {"x": x})
    trained = peftx.train.trained_model(state, frozen)
    leaves = jax.tree.leaves((state.trainable, state.hooks))
    return [np.asarray(v) for v in leaves], trained.peft_config["default"].rank_pattern


@functools.cache  # the unchanged start builds once for all the cases of its class
def _built_start(config):
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("error")
        return _built(config, pathlib.Path(tmp))


def _built(config, tmp_path):
    """What `get_peft_model` made (arrays, static settings, trainable flags, copied
    modules) and the weights `save_pretrained` writes."""
    model = peftx.get_peft_model(Tiny(jax.random.key(0)), config, key=jax.random.key(1))
    spec = model.trainable_spec()
    leaves, tree = jax.tree.flatten(
        (model.base_model, model.saved_modules, spec.base_model, spec.saved_modules)
    )
    model.save_pretrained(tmp_path)
    weights = safetensors.numpy.load_file(tmp_path / "adapter_model.safetensors")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    return (tree, [np.asarray(x) for x in leaves], weights), saved


def _same(a, b) -> bool:
    (tree_a, leaves_a, weights_a), (tree_b, leaves_b, weights_b) = a, b
    return (
        tree_a == tree_b
        and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
        and weights_a.keys() == weights_b.keys()
        and all(np.array_equal(weights_a[k], weights_b[k]) for k in weights_a)
    )


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_every_config_field_has_a_case(cls):
    _, cases = CASES[cls]
    assert {f.name for f in dataclasses.fields(cls)} == set(cases)


@pytest.mark.parametrize(
    "cls, field",
    [
        # the base config's COMMON fields act alike in every kind: the fast tier checks
        # LoRA's, the whole suite every kind's (a kind's own value for one stays); the
        # fields that steer AdaLoRA's training act through one allocator: the fast tier
        # trains with target_r changed, the whole suite with each
        pytest.param(cls, field, marks=pytest.mark.variant_sweep)
        if (cls is not peftx.LoraConfig and cases[field] is COMMON.get(field))
        or (cases[field][1] == "trains" and field != "target_r")
        else (cls, field)
        for cls, (_, cases) in CASES.items()
        for field in cases
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_changing_a_field_changes_the_adapter_or_its_file(cls, field, tmp_path):
    start, cases = CASES[cls]
    value, effect = cases[field]
    start = {**start, **STARTS.get(field, {})}
    if effect == "refused":
        with pytest.raises((ValueError, TypeError), match=field):
            cls(**{**start, field: value})
        return
    if effect == "trains":
        (before, pattern_before), (after, pattern_after) = (
            _trained(cls(**start)),
            _trained(cls(**{**start, field: value})),
        )
        assert pattern_before is not None  # the allocator pruned
        changed = pattern_before != pattern_after or any(
            a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(before, after)
        )
        assert changed, f"{cls.__name__}.{field}={value!r} changed nothing in training"
        return
    before, saved_before = _built_start(cls(**start))
    changed = cls(**{**start, field: value})
    if effect == "warns":
        with pytest.warns(UserWarning, match=field):
            after, saved_after = _built(changed, tmp_path / "after")
        assert _same(before, after)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after, saved_after = _built(changed, tmp_path / "after")
    if effect == "file":
        assert _same(before, after)
        assert saved_before[field] != saved_after[field] == value
    else:
        assert not _same(before, after), f"{cls.__name__}.{field}={value!r} changed nothing"
