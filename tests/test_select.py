"""The selection DSL, and PEFT's `target_modules` semantics checked against PEFT itself."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import peftx
from peftx import (
    TargetNotFoundError,
    in_layers,
    named,
    of_type,
    path_glob,
    path_regex,
    peft_targets,
    require_matches,
    select,
    where,
    with_shape,
)


class Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, d, key):
        ks = jax.random.split(key, 4)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            eqx.nn.Linear(d, d, use_bias=False, key=k) for k in ks
        )


class Layer(eqx.Module):
    self_attn: Attention
    mlp: dict

    def __init__(self, d, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.self_attn = Attention(d, k1)
        self.mlp = {
            "up_proj": eqx.nn.Linear(d, 2 * d, key=k2),
            "down_proj": eqx.nn.Linear(2 * d, d, key=k3),
        }


class Decoder(eqx.Module):
    embed_tokens: eqx.nn.Embedding
    layers: list

    def __init__(self, d, n, key):
        k1, k2 = jax.random.split(key)
        self.embed_tokens = eqx.nn.Embedding(11, d, key=k1)
        self.layers = [Layer(d, k) for k in jax.random.split(k2, n)]


class CausalLM(eqx.Module):
    model: Decoder
    lm_head: eqx.nn.Linear

    def __init__(self, d=4, n=4, key=jax.random.key(0)):
        k1, k2 = jax.random.split(key)
        self.model = Decoder(d, n, k1)
        self.lm_head = eqx.nn.Linear(d, 11, use_bias=False, key=k2)


@pytest.fixture(scope="module")
def lm():
    return CausalLM()


def linear_paths(lm):
    return select(lm).at(of_type(eqx.nn.Linear)).paths()


def test_paths_are_transformers_names(lm):
    paths = linear_paths(lm)
    assert "model.layers.3.self_attn.q_proj" in paths
    assert "model.layers.0.mlp.down_proj" in paths
    assert "lm_head" in paths
    assert len(paths) == 4 * 6 + 1
    assert "model.layers.0.self_attn.q_proj.weight" in select(lm).paths()


def test_predicates_and_combinators(lm):
    sel = select(lm)
    q = sel.at(named("q_proj")).paths()
    assert q == [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    attn = sel.at(of_type(eqx.nn.Linear) & path_glob("*.self_attn.*"))
    assert len(attn) == 16
    not_attn = sel.at(of_type(eqx.nn.Linear) & ~path_glob("*.self_attn.*"))
    assert len(not_attn) == 9
    either = sel.at(named("q_proj") | named("v_proj"))
    assert len(either) == 8
    assert (
        sel.at(path_regex(r"model\.layers\.[01]\..*_proj")).paths()[0].startswith("model.layers.0")
    )
    assert len(sel.at(path_regex(r"model\.layers\.[01]\..*_proj"))) == 12
    assert len(sel.at(of_type(eqx.nn.Linear) & in_layers(range(1, 3)))) == 12
    assert sel.at(of_type(eqx.nn.Linear) & with_shape(8, None)).paths() == [
        f"model.layers.{i}.mlp.up_proj" for i in range(4)
    ]
    big = sel.at(where(lambda n: isinstance(n, eqx.nn.Linear) and n.weight.size > 16))
    assert len(big) == 4 * 2 + 1
    keyed = sel.at(where(lambda p, n: p.endswith("lm_head"), with_keypath=True))
    assert keyed.get() == [lm.lm_head]


def test_selection_where_takes_a_function_or_a_predicate(lm):
    """`select(m).where(...)` as penzai's: `fn(node)`, `fn(path, node)` with
    `with_keypath=True`, or a predicate; a function of the wrong arity fails at once."""
    sel = select(lm)
    linears = [p for p, n in zip(sel.paths(), sel.get()) if isinstance(n, eqx.nn.Linear)]
    assert sel.where(lambda n: isinstance(n, eqx.nn.Linear)).paths() == linears
    heads = sel.where(lambda p, n: p.endswith("_head"), with_keypath=True)
    assert heads.get() == [lm.lm_head]
    assert sel.where(named("q_proj")).paths() == [
        f"model.layers.{i}.self_attn.q_proj" for i in range(4)
    ]
    with pytest.raises(TypeError, match=r"must take \(node\).*pass with_keypath=True"):
        sel.where(lambda p, n: True)
    with pytest.raises(TypeError, match=r"must take \(path, node\) with with_keypath=True"):
        sel.where(lambda n: True, with_keypath=True)


def test_apply_set_and_tree_at(lm):
    sel = select(lm).at(named("v_proj"))
    doubled = sel.apply(lambda lin: eqx.tree_at(lambda m: m.weight, lin, 2 * lin.weight))
    assert jnp.array_equal(
        doubled.model.layers[2].self_attn.v_proj.weight,
        2 * lm.model.layers[2].self_attn.v_proj.weight,
    )
    assert jnp.array_equal(
        doubled.model.layers[2].self_attn.q_proj.weight, lm.model.layers[2].self_attn.q_proj.weight
    )
    via_tree_at = eqx.tree_at(sel.where_fn(), lm, replace_fn=lambda lin: eqx.nn.Identity())
    assert isinstance(via_tree_at.model.layers[0].self_attn.v_proj, eqx.nn.Identity)
    with pytest.raises(ValueError, match="got 1 values for 4 selected nodes"):
        sel.set([None])


def test_table(lm):
    table = select(lm).at(named("q_proj", "lm_head")).table()
    assert re.search(r"model\.layers\.0\.self_attn\.q_proj\s+Linear\s+\(4, 4\)\s+16\n", table)
    assert "lm_head" in table and "5 selected" in table and "108" in table


def test_stacked_layers_are_found(getkey):
    stacked = eqx.filter_vmap(lambda k: Layer(4, k))(jax.random.split(getkey(), 3))
    sel = select({"layers": stacked}).at(of_type(eqx.nn.Linear))
    assert "layers.self_attn.q_proj" in sel.paths()
    assert sel.at(named("q_proj")).get()[0].weight.shape == (3, 4, 4)


CONFIGS = [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["self_attn.q_proj"]},
    {"target_modules": ["proj"]},  # suffix rule: no module is named just "proj"
    {"target_modules": r".*\.(q|k)_proj"},
    {"target_modules": r"model\.layers\.1\..*"},
    {
        "target_modules": ["q_proj", "up_proj"],
        "exclude_modules": ["model.layers.0.self_attn.q_proj"],
    },
    {"target_modules": ["q_proj", "down_proj"], "exclude_modules": r".*layers\.[23]\..*"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1, 3]},
    {"target_modules": ["q_proj"], "layers_to_transform": 2, "layers_pattern": "layers"},
    {"target_modules": ["lm_head"]},
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_peft_target_modules_semantics_match_peft(lm, config):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists

    reference = LoraConfig(**config)
    paths = linear_paths(lm)
    matched = {p: check_target_module_exists(reference, p) for p in paths}
    want = [p for p, m in matched.items() if m and not isinstance(m, _ExcludedModule)]
    predicate = peft_targets(
        config["target_modules"],
        exclude_modules=config.get("exclude_modules"),
        layers_to_transform=config.get("layers_to_transform"),
        layers_pattern=config.get("layers_pattern"),
    )
    got = select(lm).at(of_type(eqx.nn.Linear) & predicate).paths()
    assert got == want


def test_no_match_lists_the_closest_names(lm):
    with pytest.raises(TargetNotFoundError, match=r"Closest module names: \[.*'q_proj'.*\]"):
        require_matches(select(lm), peft_targets(["q_prj"]), wanted=["q_prj"])
    assert peftx.layer_index("model.layers.12.mlp.up_proj") == 12


@pytest.fixture(scope="module")
def stacked_lm(lm):
    """`lm` with its layers in one `LayerStack` segment (paths `model.layers.0-3.…`)."""
    return eqx.tree_at(lambda m: m.model.layers, lm, peftx.models.stack_layers(lm.model.layers))


LAYER_NAMES = [
    "down_proj",
    "embed_tokens",
    "k_proj",
    "lm_head",
    "o_proj",
    "q_proj",
    "up_proj",
    "v_proj",
]


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_suggestions_are_module_names_never_layer_indices(lm, stacked_lm, stacked):
    """The issue's repro: with no close name, a target that matches nothing listed the
    first ten names alphabetically, stack spans like '0-1' first and q_proj left out."""
    model = stacked_lm if stacked else lm
    assert "model.layers.0-3.self_attn.q_proj" in select(model).paths() or not stacked
    with pytest.raises(TargetNotFoundError) as info:
        peftx.targets(model, peftx.LoraConfig(target_modules=["qkv"]))
    message = str(info.value)
    assert f"No module name is close; the layers are named {LAYER_NAMES}." in message
    with pytest.raises(TargetNotFoundError, match=r"Closest module names: \[.*'self_attn\.q_proj'"):
        peftx.targets(model, peftx.LoraConfig(target_modules=["self_atn.q_proj"]))
    for target in (["q_porj"], ["layer"], ["attn"]):
        with pytest.raises(TargetNotFoundError) as info:
            peftx.targets(model, peftx.LoraConfig(target_modules=target))
        assert not re.search(r"'\d+(-\d+)?'", str(info.value)), str(info.value)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_an_entry_that_matches_nothing_warns(lm, stacked_lm, stacked):
    """PEFT ignores `"q_porj"` in `["q_porj", "v_proj"]` silently (the same layers are
    chosen here); peftx warns, naming it and the closest names."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    model = stacked_lm if stacked else lm
    config = peftx.LoraConfig(target_modules=["q_porj", "v_proj"])
    with pytest.warns(UserWarning, match=r"entry 'q_porj' matches no module") as record:
        chosen = peftx.targets(model, config)
    assert len(record) == 1
    assert "Closest module names: ['o_proj', 'q_proj', 'v_proj']" in str(record[0].message)
    reference = LoraConfig(target_modules=["q_porj", "v_proj"])
    want = [p for p in linear_paths(lm) if check_target_module_exists(reference, p)]
    assert [q for p in chosen.paths() for q in peftx._targets.layer_paths(p)] == want


def test_entries_that_all_match_do_not_warn(lm, stacked_lm):
    """Also PEFT's expanded per-layer names on a stacked model, and container names."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peftx.targets(lm, peftx.LoraConfig(target_modules=["q_proj", "mlp.up_proj"]))
        peftx.targets(
            stacked_lm,
            peftx.LoraConfig(
                target_modules=["model.layers.0.self_attn.q_proj", "layers.2.self_attn.v_proj"]
            ),
        )
