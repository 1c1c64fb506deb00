"""PEFT's target rules on stacked models, applied layer by layer, and the condensed
`target_modules` list written to `adapter_config.json`, checked against PEFT's own
matching of module names."""

import jax
import peft
import pytest
import torch
import transformers
from helpers import example_count
from hypothesis import given, settings, strategies as st
from peft.tuners.tuners_utils import check_target_module_exists

import peftx
import peftx.models as pm
from peftx._peft_io import _condensed

LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def adapted_per_layer(peft_model):
    """The per-layer module names that carry an adapter, whatever the layout."""
    names = set()
    selection = peftx.select(peft_model.base_model).at(
        peftx.where(lambda n: isinstance(getattr(n, "weight", None), peftx.adapters.AdapterSet))
    )
    for path in selection.paths():
        span = peftx.layer_span(path)
        if span is None:
            names.add(path)
            continue
        first, last = span
        segment = f"{first}-{last}" if f".{first}-{last}." in path else str(first)
        for i in range(first, last + 1):
            names.add(path.replace(f".{segment}.", f".{i}.", 1))
    return names


def peft_adapted(checkpoint, config):
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    wrapped = peft.get_peft_model(model, config)
    return {
        name.removeprefix("base_model.model.")
        for name, module in wrapped.named_modules()
        if hasattr(module, "lora_A") and "default" in module.lora_A
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(target_modules=r"model\.layers\.[12]\.self_attn\.(q|v)_proj"),
        dict(target_modules=r".*\.(1|3)\.mlp\.down_proj"),
        dict(target_modules=["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.up_proj"]),
        dict(target_modules=["q_proj", "up_proj"], layers_to_transform=[0, 3]),
        dict(target_modules=["k_proj"], exclude_modules=r"model\.layers\.2\..*"),
    ],
    ids=["regex", "regex-every-other", "full-paths", "layers_to_transform", "exclude"],
)
def test_stacked_selects_what_peft_selects(checkpoint, kwargs):
    want = peft_adapted(checkpoint, peft.LoraConfig(r=2, **kwargs))
    for layout in ("stacked", "unrolled"):
        model = pm.from_pretrained(checkpoint, layout=layout)
        peft_model = peftx.get_peft_model(
            model, peftx.LoraConfig(r=2, **kwargs), key=jax.random.key(0)
        )
        assert adapted_per_layer(peft_model) == want, layout


def test_stacked_split_only_where_needed(checkpoint):
    model = pm.from_pretrained(checkpoint, layout="stacked")
    config = peftx.LoraConfig(r=2, target_modules=r"model\.layers\.[12]\.self_attn\.q_proj")
    split = peftx.targets(model, config).model
    assert split.model.layers.spans == [(0, 0), (1, 2), (3, 3)]


names = st.lists(st.sampled_from(["a", "b", "q_proj", "mlp", "attn", "0", "1"]), min_size=1)


@settings(max_examples=example_count(200), deadline=None)
@given(st.sets(names.map(".".join), min_size=2, max_size=30), st.data())
def test_condensed_targets_select_the_same_modules(modules, data):
    """`_condensed` suffixes, read by PEFT's own matcher, choose exactly the targets."""
    modules = sorted(modules)
    targets = data.draw(st.sets(st.sampled_from(modules), min_size=1))
    others = set(modules) - targets
    # PEFT condenses only when no other name ends in a target's name
    if any(o.endswith("." + t) for o in others for t in targets):
        return
    suffixes = _condensed(sorted(targets), others)
    config = peft.LoraConfig(target_modules=sorted(suffixes))
    for name in modules:
        assert bool(check_target_module_exists(config, name)) == (name in targets), name
    assert len(suffixes) <= len(targets)
