"""Clear errors for bad input (issue 22): configs, config files and the Python API each
refuse a bad value early, in one line that names the file, key or argument at fault."""

import json
import math
import re
from pathlib import Path

import pytest
from helpers import as_users_run, example_count, run_cli, word_tokenizer
from hypothesis import given, settings, strategies as st

from peftx import IA3Config, LoraConfig, QuantizationConfig, from_toml, load_config
from peftx._errors import ConfigFileError

FLOAT32_MAX = 3.4028234663852886e38


# --- adapter and quantization configs: every number finite and in range --------------------


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v):
    return isinstance(v, int | float) and not isinstance(v, bool)


def _ints(check):
    """None, an int, or a list of ints, each passing `check`."""
    return lambda v: (
        v is None
        or (
            (_int(v) and check(v)) or (isinstance(v, list) and all(_int(x) and check(x) for x in v))
        )
    )


# (class, field, how a drawn value is put into the field, whether the drawn value is valid
# there): the oracle is written from the documented ranges, independently of peftx's checks.
NUMERIC_FIELDS = [
    (LoraConfig, "r", lambda v: v, lambda v: _int(v) and 1 <= v <= 2**31 - 1),
    (LoraConfig, "lora_alpha", lambda v: v, lambda v: _number(v) and abs(v) <= FLOAT32_MAX),
    (LoraConfig, "lora_dropout", lambda v: v, lambda v: _number(v) and 0 <= v < 1),
    (LoraConfig, "layers_to_transform", lambda v: v, _ints(lambda x: x >= 0)),
    (IA3Config, "layers_to_transform", lambda v: v, _ints(lambda x: x >= 0)),
    (
        LoraConfig,
        "rank_pattern",
        lambda v: {"q_proj": v},
        lambda v: _int(v) and 1 <= v <= 2**31 - 1,
    ),
    (
        LoraConfig,
        "alpha_pattern",
        lambda v: {"q_proj": v},
        lambda v: _number(v) and abs(v) <= FLOAT32_MAX,
    ),
]

EDGES = [0, 1, -1, 2, 2**31 - 1, 2**31, 10**400, -(10**400), 0.5, 1.0, 0.999999, -0.0]
EDGES += [FLOAT32_MAX, 3.5e38, 1e308, float("nan"), float("inf"), float("-inf"), True, False]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def test_numeric_field_cases_differ():
    # each arm's oracle tells apart values that another arm's would not
    assert NUMERIC_FIELDS[1][3](-5) and not NUMERIC_FIELDS[2][3](-5)
    assert NUMERIC_FIELDS[0][3](5) and not NUMERIC_FIELDS[2][3](5)
    assert NUMERIC_FIELDS[3][3]([0, 3]) and not NUMERIC_FIELDS[0][3]([0, 3])


@pytest.mark.parametrize(
    "cls, field, wrap, valid",
    NUMERIC_FIELDS,
    ids=[f"{cls.__name__}.{field}" for cls, field, *_ in NUMERIC_FIELDS],
)
@settings(max_examples=example_count(150), deadline=None)
@given(value=VALUES)
def test_numeric_fields_are_valid_or_refused_by_name(cls, field, wrap, valid, value):
    """Property: any value of a numeric field (NaN, inf, huge, negative, a string, a list,
    a bool) gives either a `ValueError`/`TypeError` naming the field, or a config whose
    value is finite and in range, which writes as strict JSON and reads back equal."""
    builds = {"constructor": lambda: cls(**{field: wrap(value)})}
    builds["from_dict"] = lambda: cls.from_dict({field: wrap(value)})
    for how, build in builds.items():
        with as_users_run():
            try:
                config = build()
            except (TypeError, ValueError) as e:
                assert f"`{field}`" in str(e), (how, str(e))
                assert not valid(value), (how, value, str(e))
                continue
        assert valid(value), (how, value)
        text = json.dumps(config.to_dict(), allow_nan=False)  # raises on NaN or inf
        assert cls.from_dict(json.loads(text)) == config


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39, 10**400])
def test_lora_alpha_must_be_finite(value):
    # `lora_alpha` had no check at all: NaN and inf made every output NaN
    with pytest.raises(ValueError, match=r"`lora_alpha` must be a finite number"):
        LoraConfig(lora_alpha=value)
    with pytest.raises(ValueError, match=r"`alpha_pattern` values must be finite numbers"):
        LoraConfig(alpha_pattern={"q_proj": value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_lora_dropout_nan_is_refused(value):
    with pytest.raises(ValueError, match=r"`lora_dropout` must be a probability in \[0, 1\)"):
        LoraConfig(lora_dropout=value)


def test_huge_rank_is_refused():
    with pytest.raises(ValueError, match=r"`r` \(the LoRA rank\) must be a positive integer"):
        LoraConfig(r=2**31)
    with pytest.raises(ValueError, match=r"`rank_pattern` ranks .* got \{'q': 10000000000\}"):
        LoraConfig.from_dict({"rank_pattern": {"q": 10**10}})


def test_nan_in_adapter_config_json_is_refused(tmp_path):
    # Python's json reads the non-JSON tokens NaN and Infinity; the config refuses them
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "lora_alpha": NaN}')
    with pytest.raises(ValueError, match=r"`lora_alpha` must be a finite number .*; got nan"):
        load_config(tmp_path)


QUANTIZATION_TYPES = [
    (dict(load_in_4bit="yes"), r"`load_in_4bit` must be a bool; got 'yes'"),
    (dict(load_in_8bit=1), r"`load_in_8bit` must be a bool; got 1 of type int"),
    (dict(load_in_4bit=True, bnb_4bit_use_double_quant="no"), r"`bnb_4bit_use_double_quant`"),
    (dict(load_in_4bit=True, bnb_4bit_compute_dtype=16), r"`bnb_4bit_compute_dtype` must be"),
    (dict(load_in_4bit=True, llm_int8_skip_modules="lm_head"), r"`llm_int8_skip_modules` must"),
    (dict(load_in_4bit=True, bnb_4bit_quant_type=4), r"`bnb_4bit_quant_type` must be a string"),
]


@pytest.mark.parametrize("kwargs, match", QUANTIZATION_TYPES)
def test_quantization_config_types(kwargs, match):
    # "yes" used to pass as true, and `load_in_8bit=1` compared equal to True
    with as_users_run(), pytest.raises(TypeError, match=match):
        QuantizationConfig(**kwargs)
    with as_users_run(), pytest.raises(TypeError, match=match):
        QuantizationConfig.from_dict(kwargs)


@pytest.mark.parametrize(
    "field, valid",
    [
        ("bnb_4bit_use_double_quant", lambda v: isinstance(v, bool)),
        ("bnb_4bit_compute_dtype", lambda v: v in (None, "float32", "bfloat16", "float16")),
        (
            "llm_int8_skip_modules",
            lambda v: v is None or isinstance(v, list) and all(isinstance(x, str) for x in v),
        ),
    ],
)
@settings(max_examples=example_count(100), deadline=None)
@given(value=VALUES)
def test_quantization_fields_are_valid_or_refused_by_name(field, valid, value):
    """The same property for `QuantizationConfig`, which has no numeric field: any value
    is refused naming the field, or gives a config that round-trips through strict JSON."""
    with as_users_run():
        try:
            config = QuantizationConfig.from_dict({"load_in_4bit": True, field: value})
        except (TypeError, ValueError) as e:
            assert field in str(e), str(e)
            assert not valid(value), (value, str(e))
            return
    assert valid(value), value
    text = json.dumps(config.to_dict(), allow_nan=False)
    assert QuantizationConfig.from_dict(json.loads(text)) == config


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_quantization_settings_must_be_finite(value):
    # llm_int8_threshold is ignored by peftx, but a NaN there is still a mistake
    with pytest.raises(ValueError, match=r"`llm_int8_threshold` must be finite; got (nan|inf)"):
        QuantizationConfig.from_dict({"load_in_8bit": True, "llm_int8_threshold": value})


# --- TOML and JSON files: one line that names the file ------------------------------------


def _bad_files(tmp_path):
    """(path, what the error must say) for each way a config file can be unreadable."""
    non_utf8 = tmp_path / "latin1.toml"
    text = '[lora]\ntarget_modules = ["caf\xe9"]\n'
    non_utf8.write_bytes(text.encode("latin-1"))
    offset = text.index("\xe9")
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    deep_table = tmp_path / "deep_table.toml"
    deep_table.write_text("a = " + "{b = " * 100_000 + "1" + "}" * 100_000 + "\n")
    directory = tmp_path / "job.toml"
    directory.mkdir()
    return [
        (non_utf8, rf"latin1\.toml is not UTF-8 text \(byte 0xe9 at offset {offset}\)"),
        (deep, r"deep\.toml: invalid TOML: arrays or tables nested too deep"),
        (deep_table, r"deep_table\.toml: invalid TOML: arrays or tables nested too deep"),
        (directory, r"job\.toml is a directory, not a TOML file"),
        ("/dev/null", r"/dev/null is not a regular file"),
    ]


def test_toml_file_errors_name_the_file(tmp_path):
    for path, match in _bad_files(tmp_path):
        with pytest.raises(ConfigFileError, match=match):
            from_toml(path)
        with pytest.raises(ConfigFileError, match=match):
            QuantizationConfig.from_toml(path)
    with pytest.raises(FileNotFoundError, match=r"No such file: '.*missing\.toml'"):
        from_toml(tmp_path / "missing.toml")


def test_quantization_table_must_be_a_table(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text("quantization = 4\n")
    with pytest.raises(TypeError, match=r"`quantization` in .*q\.toml must be a table, got 4"):
        QuantizationConfig.from_toml(path)


@pytest.mark.parametrize("command", [["finetune"], ["inspect", "all-MiniLM-L6-v2"]])
def test_cli_job_file_errors_are_one_line(tmp_path, capsys, command):
    # each used to be a traceback (UnicodeDecodeError, RecursionError) or "no such config file"
    for path, match in _bad_files(tmp_path):
        code, out, err = run_cli(capsys, *command, path)
        assert code == 2, (path, err)
        assert err.count("\n") == 1 and err.startswith("peftx: error: "), err
        assert re.search(match, err), (match, err)


def test_cli_model_that_is_not_a_directory(tmp_path, capsys):
    # was "model directory '/dev/null' has no config.json"
    for model in ["/dev/null", tmp_path / "config.json"]:
        Path(tmp_path / "config.json").write_text("{}")
        code, out, err = run_cli(capsys, "inspect", model)
        assert code == 2 and err.count("\n") == 1, err
        assert f"model '{model}' is not a directory: name a transformers checkpoint" in err


def test_json_file_errors_name_the_file(tmp_path):
    (tmp_path / "adapter_config.json").write_bytes(b'{"peft_type": "LORA", "r": 8\xff}')
    with pytest.raises(ConfigFileError, match=r"adapter_config\.json is not UTF-8 text"):
        load_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigFileError, match=r"is not valid JSON: arrays or objects nested too"):
        load_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": ' + "1" * 5000 + "}")
    with pytest.raises(ConfigFileError, match=r"is not valid JSON: Exceeds the limit"):
        load_config(tmp_path)


# --- a checkpoint's config.json: the file and key named, before anything is built ----------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM checkpoint (config.json, model.safetensors and a word-level
    tokenizer), saved by peftx."""
    import jax

    import peftx.models as pm

    config = pm.LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("llama")
    pm.save_pretrained(pm.LlamaForCausalLM(config, key=jax.random.key(0)), path)
    words = ["[UNK]", "[PAD]", "</s>", "once", "upon", "a", "time"]
    word_tokenizer(words).save_pretrained(path)  # `peftx finetune` reads it
    return path


def _with_config(llama_dir, tmp_path, text):
    """A copy of the tiny checkpoint whose config.json holds `text` (str or bytes)."""
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    config = path / "config.json"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _edited(llama_dir, **changes):
    return json.dumps({**json.loads((llama_dir / "config.json").read_text()), **changes})


CONFIG_JSON_ERRORS = [
    # (the config.json text, from a function of the good one; what the error says)
    (lambda good: b"\xff\xfe garbage", r"config\.json is not UTF-8 text \(byte 0xff at offset 0\)"),
    (lambda good: "{not json", r"config\.json is not valid JSON"),
    (lambda good: "null", r"config\.json holds null, not a JSON object"),
    (lambda good: "[1, 2]", r"config\.json holds \[1, 2\], not a JSON object"),
    (lambda good: "[" * 100_000, r"config\.json is not valid JSON: arrays or objects nested too"),
    (
        lambda good: {**good, "model_type": ["llama"]},
        r'config\.json: model_type must be a string such as "llama"; got \["llama"\]',
    ),
    (
        lambda good: {**good, "hidden_size": -16},
        r"config\.json: hidden_size must be an integer from 1 to 1048576; got -16\.",
    ),
    (
        lambda good: {**good, "num_hidden_layers": 0},
        r"config\.json: num_hidden_layers must be an integer from 1 to 4096; got 0\.",
    ),
    (
        lambda good: {**good, "num_hidden_layers": 10**9},
        r"; got 1000000000 \(far above any released model; such a model would not fit in",
    ),
    (
        lambda good: {**good, "num_hidden_layers": "2"},
        r'num_hidden_layers must be an integer from 1 to 4096; got "2"',
    ),
    (lambda good: {**good, "vocab_size": 61.0}, r"vocab_size must be an integer .*; got 61\.0"),
    (lambda good: {**good, "tie_word_embeddings": "no"}, r"tie_word_embeddings must be true, fa"),
    (lambda good: {**good, "rms_norm_eps": math.nan}, r"rms_norm_eps must be a finite number >= 0"),
    (
        lambda good: {**good, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
        r"config\.json: rope_parameters of rope type 'linear' needs factor",
    ),
    (
        lambda good: {**good, "rope_parameters": {"rope_theta": -1}},
        r"config\.json: rope_parameters\.rope_theta must be a finite number > 0; got -1",
    ),
    (
        lambda good: {**good, "num_key_value_heads": 3},
        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
    ),
    (
        lambda good: {**good, "head_dim": 5},
        r"head_dim \(5\) times partial_rotary_factor gives 5 rotary features; .* even",
    ),
    (lambda good: {**good, "architectures": "LlamaForCausalLM"}, r"architectures must be null or"),
    (lambda good: {**good, "hidden_act": "mish"}, r"activation 'mish' is not supported"),
]


@pytest.mark.parametrize("edit, match", CONFIG_JSON_ERRORS)
def test_config_json_errors_name_file_and_key(llama_dir, tmp_path, edit, match):
    import time

    import peftx.models as pm
    from peftx import CheckpointError

    good = json.loads((llama_dir / "config.json").read_text())
    text = edit(good)
    text = text if isinstance(text, str | bytes) else json.dumps(text)
    path = _with_config(llama_dir, tmp_path, text)
    start = time.monotonic()
    with as_users_run(), pytest.raises(CheckpointError, match=match) as info:
        pm.from_pretrained(path)
    assert "\n" not in str(info.value)
    assert str(path / "config.json") in str(info.value)
    assert time.monotonic() - start < 20  # num_hidden_layers=10**9 used to hang


def test_config_json_errors_in_the_cli(llama_dir, tmp_path, capsys):
    """`peftx inspect` and `peftx finetune` read config.json through the same checks."""
    path = _with_config(llama_dir, tmp_path, _edited(llama_dir, num_hidden_layers=10**9))
    job = Path(__file__).parents[1] / "configs" / "lora_llama_causal.toml"
    runs = [
        ("inspect", path),
        ("finetune", job, "--set", f"model.path={path}", "--set", f"output.dir={tmp_path / 'o'}"),
    ]
    for argv in runs:
        code, out, err = run_cli(capsys, *argv)
        assert code != 0 and err.count("\n") == 1, err
        assert f"{path / 'config.json'}: num_hidden_layers must be an integer from 1 to 4096" in err
        assert not (tmp_path / "o").exists()


def test_config_json_that_the_weights_do_not_hold(llama_dir, tmp_path):
    # valid values that describe another model: refused by the weights' shapes, naming both
    import peftx.models as pm
    from peftx import CheckpointError

    path = _with_config(llama_dir, tmp_path, _edited(llama_dir, num_hidden_layers=4096))
    with pytest.raises(
        CheckpointError,
        match=r"ckpt/config\.json describes 4096 layers, but the weights hold 2 "
        r"\('model\.layers\.2\.[a-z_.]+' is missing\)",
    ):
        pm.from_pretrained(path)
    path.joinpath("config.json").write_text(_edited(llama_dir, hidden_size=1024))
    with pytest.raises(CheckpointError, match=r"has shape \(61, 16\); .* expects \(61, 1024\)"):
        pm.from_pretrained(path)


def _size(v):
    return _int(v) and 1 <= v <= 2**31 - 1


def _size_or_null(v):  # null: the default (e.g. head_dim = hidden_size // heads)
    return v is None or _size(v)


def _nonnegative(v):
    return _number(v) and math.isfinite(v) and v >= 0


def _std(v):  # of fresh weights (0.02 in practice); peftx's bound is 1000
    return _nonnegative(v) and v <= 1000


def _probability(v):
    return _number(v) and 0 <= v < 1


TINY = dict(vocab_size=61, num_hidden_layers=2, max_position_embeddings=64)
TINY_LLAMA = dict(TINY, hidden_size=16, intermediate_size=32, num_attention_heads=4)
TINY_BERT = dict(TINY_LLAMA, type_vocab_size=2)
TINY_GPT2 = dict(vocab_size=61, n_layer=2, n_positions=64, n_embd=16, n_head=4)
# (model_type, the rest of a tiny config.json, {numeric key: what a valid value is}): the
# oracle is the documented meaning (sizes are positive ints, epsilons finite and >= 0,
# dropouts probabilities), written independently of peftx's checks
CONFIG_KEYS = [
    (
        "llama",
        dict(TINY_LLAMA, num_key_value_heads=2),
        {
            **{k: _size for k in ["vocab_size", "num_labels", "hidden_size", "intermediate_size"]},
            **{k: _size for k in ["num_hidden_layers", "num_attention_heads"]},
            "max_position_embeddings": _size,
            "num_key_value_heads": _size_or_null,
            "head_dim": _size_or_null,
            "rms_norm_eps": _nonnegative,
            "rope_theta": lambda v: _nonnegative(v) and v > 0,
            "initializer_range": _std,
            "pad_token_id": lambda v: v is None or _int(v),
        },
    ),
    (
        "qwen2",
        dict(TINY_LLAMA, num_key_value_heads=2, use_sliding_window=True, sliding_window=8),
        {
            "max_window_layers": lambda v: _int(v) and v >= 0,
            "sliding_window": lambda v: v is None or _int(v) and v >= 0,  # 0 or null: none
        },
    ),
    (
        "gpt2",
        TINY_GPT2,
        {
            **{k: _size for k in ["vocab_size", "num_labels", "n_positions", "n_embd"]},
            **{k: _size for k in ["n_layer", "n_head"]},
            "n_inner": _size_or_null,
            "layer_norm_epsilon": _nonnegative,
            "initializer_range": _std,
        },
    ),
    (
        "bert",
        TINY_BERT,
        {
            **{k: _size for k in ["vocab_size", "num_labels", "hidden_size", "intermediate_size"]},
            **{k: _size for k in ["num_hidden_layers", "num_attention_heads", "type_vocab_size"]},
            "max_position_embeddings": _size,
            "layer_norm_eps": _nonnegative,
            "hidden_dropout_prob": _probability,
            "attention_probs_dropout_prob": _probability,
            "classifier_dropout": lambda v: v is None or _probability(v),
            "initializer_range": _std,
        },
    ),
]
CONFIG_KEY_CASES = [
    (model_type, base, key, valid)
    for model_type, base, keys in CONFIG_KEYS
    for key, valid in keys.items()
]


@pytest.mark.parametrize(
    "model_type, base, key, valid",
    CONFIG_KEY_CASES,
    ids=[f"{t}.{key}" for t, _, key, _ in CONFIG_KEY_CASES],
)
@settings(max_examples=example_count(60), deadline=None)
@given(value=VALUES)
def test_config_json_values_are_valid_or_refused_by_name(model_type, base, key, valid, value):
    """Property: any value of a numeric config.json key gives a `ValueError` naming the key,
    or a config that is valid: the value in range, and the model builds (abstractly)."""
    import equinox as eqx
    import jax

    from peftx.models._checkpoint import ARCHITECTURES

    arch = ARCHITECTURES[model_type]
    d = {**base, "model_type": model_type, key: value}
    with as_users_run():
        try:
            config = arch.config_class.from_hf_config(d)
        except ValueError as e:
            assert key in str(e), str(e)
            assert "\n" not in str(e)
            return
    assert valid(value), value
    model = arch.classes[arch.default]
    eqx.filter_eval_shape(lambda k: model(config, key=k), jax.random.key(0))


# --- the Python API: what a model, a dtype argument, a quantized model expect -------------


def _tiny_models():
    """A tiny model of each architecture (as built in code), by name."""
    import equinox as eqx

    import peftx.models as pm

    llama = pm.LlamaConfig.from_hf_config({**TINY_LLAMA, "num_key_value_heads": 2})
    gpt2 = pm.GPT2Config.from_hf_config(TINY_GPT2)
    bert = pm.BertConfig.from_hf_config(TINY_BERT)
    made = {
        "llama": (pm.LlamaForCausalLM, llama),
        "gpt2": (pm.GPT2LMHeadModel, gpt2),
        "bert": (pm.BertForSequenceClassification, bert),
    }
    # built in one compiled program each: eager initialization runs op by op, slowly
    return {
        name: eqx.filter_jit(lambda k, cls=cls, config=config: cls(config, key=k))(_key())
        for name, (cls, config) in made.items()
    }


@pytest.fixture(scope="module")
def tiny_models():
    return _tiny_models()


BAD_INPUTS = [
    # (arguments, error, what it says, whether the repro also goes through a
    # PeftModel); each was a traceback from inside the model
    (
        lambda jnp: ([[1, 2, 3]],),
        TypeError,
        r"must be an integer array of shape \(batch, seq\), e\.g\. jnp\.asarray\(\[\[1, 2, 3",
        True,
    ),
    (
        lambda jnp: (jnp.asarray([1, 2, 3]),),
        ValueError,
        r"got shape \(3,\)\. For one sequence, add a batch axis: input_ids\[None\]",
        True,
    ),
    (
        lambda jnp: (jnp.ones((1, 3)),),
        TypeError,
        r"input_ids must be integer token ids .*; got dtype float32",
        False,
    ),
    (
        lambda jnp: (jnp.ones((1, 3), jnp.int32), [[1, 1, 1]]),
        TypeError,
        r"attention_mask must be None or an array of input_ids' shape \(1, 3\); got a list",
        False,
    ),
    (
        lambda jnp: (jnp.ones((1, 3), jnp.int32), jnp.ones((1, 4), jnp.int32)),
        ValueError,
        r"attention_mask has shape \(1, 4\); it must match input_ids \(1, 3\)",
        False,
    ),
]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("args, error, match, via_peft", BAD_INPUTS)
def test_model_inputs_say_what_is_expected(tiny_models, name, args, error, match, via_peft):
    """Each used to be an AttributeError ('list' has no 'shape') or an unpacking error."""
    import jax
    import jax.numpy as jnp

    import peftx

    model = tiny_models[name]
    calls = [model]
    if via_peft:
        targets = {"llama": ["q_proj"], "gpt2": ["c_attn"], "bert": ["query"]}[name]
        config = LoraConfig(target_modules=targets)
        calls.append(peftx.get_peft_model(model, config, key=jax.random.key(1)))
    for call in calls:
        with as_users_run(), pytest.raises(error, match=match):
            call(*args(jnp))


def test_numpy_ids_are_still_accepted(tiny_models):
    import jax.numpy as jnp
    import numpy as np

    ids = np.asarray([[3, 4, 5]])
    for model in tiny_models.values():
        with as_users_run():  # the annotations say jax arrays; numpy ones have always run
            ours = model(ids, np.ones_like(ids)).logits
        np.testing.assert_array_equal(ours, model(jnp.asarray(ids)).logits)


@pytest.mark.parametrize(
    "make",
    [
        lambda pm, config, path: pm.from_pretrained(path, dtype="bf16"),
        lambda pm, config, path: pm.LlamaForCausalLM(config, key=_key(), dtype="bf16"),
        lambda pm, config, path: pm.LlamaModel(config, key=_key(), dtype="bf16"),
        lambda pm, config, path: pm.GPT2Model(pm.GPT2Config(n_layer=1), key=_key(), dtype="bf16"),
        lambda pm, config, path: pm.BertModel(pm.BertConfig(), key=_key(), dtype="bf16"),
    ],
    ids=["from_pretrained", "LlamaForCausalLM", "LlamaModel", "GPT2Model", "BertModel"],
)
def test_dtype_names_are_listed(llama_dir, make):
    import peftx.models as pm

    config = pm.LlamaConfig.from_hf_config({**TINY_LLAMA, "num_key_value_heads": 2})
    with (
        as_users_run(),
        pytest.raises(
            TypeError,
            match=r"`dtype` must be a floating dtype, got 'bf16'; valid names: 'float32', "
            r"'bfloat16', 'float16', 'float64' \(or jnp\.float32 and the like\)\. Did you mean "
            r"'bfloat16'\?",
        ),
    ):
        make(pm, config, llama_dir)


def _key():
    import jax

    return jax.random.key(0)


def test_dtype_names_in_quantization_and_loading(llama_dir):
    import jax.numpy as jnp

    import peftx.models as pm
    from peftx.adapters import Int8Array, NF4Array, quantize_int8, quantize_nf4

    w = jnp.ones((4, 64))
    with as_users_run():
        with pytest.raises(TypeError, match=r"`dtype` .*got 'fp16'.*Did you mean 'float16'"):
            quantize_nf4(w, dtype="fp16")
        with pytest.raises(TypeError, match=r"`dtype` .*got 'fp32'.*Did you mean 'float32'"):
            quantize_int8(w, dtype="fp32")
        with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype, got 'fp8'"):
            Int8Array(jnp.zeros((4, 3), jnp.int8), jnp.ones(4), dtype="fp8")
        q = quantize_nf4(w)
        with pytest.raises(TypeError, match=r"`stored_dtype` must be .*, got 'bf'; valid names"):
            NF4Array(q.packed, q.absmax, shape=(4, 64), dtype="float32", stored_dtype="bf")
        # a real dtype that is not floating: the name of the dtype, not a bad-name hint
        with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype, got int8; valid"):
            pm.from_pretrained(llama_dir, dtype="int8")
    assert pm.from_pretrained(llama_dir, dtype="bfloat16").lm_head.weight.dtype == jnp.bfloat16


def test_compute_dtype_names_are_listed():
    import jax.numpy as jnp

    from peftx.adapters import LoraArray

    w, a, b = jnp.ones((4, 3)), jnp.ones((2, 3)), jnp.zeros((4, 2))
    with as_users_run():
        with pytest.raises(TypeError, match=r"`compute_dtype` .*got 'bf16'.*Did you mean"):
            LoraArray(w, a, b, lora_alpha=2, compute_dtype="bf16")
    assert LoraArray(w, a, b, lora_alpha=2, compute_dtype="bfloat16").compute_dtype == jnp.bfloat16


@pytest.mark.parametrize("quantization", [dict(load_in_4bit=True), dict(load_in_8bit=True)])
@pytest.mark.parametrize(  # every model's layers share the check: the fast tier runs Llama's
    "name",
    ["llama", *(pytest.param(n, marks=pytest.mark.variant_sweep) for n in ("gpt2", "bert"))],
)
def test_quantized_model_outside_use_implicit_args(tiny_models, name, quantization):
    """A `quantize_model` result called directly used to fail with JAX's 'Error
    interpreting argument to dot_general as a JAX value', which does not say why."""
    import jax.numpy as jnp

    import peftx
    from peftx.implicit import use_implicit_args

    model = peftx.quantize_model(tiny_models[name], QuantizationConfig(**quantization))
    ids = jnp.ones((1, 3), jnp.int32)
    kind = "NF4Array" if "load_in_4bit" in quantization else "Int8Array"
    with (
        as_users_run(),
        pytest.raises(
            TypeError,
            match=rf"a layer's weight is an implicit array \({kind}: a quantized weight or an "
            r"adapter\), and the model was called outside `use_implicit_args`\. Call it as "
            r"`peftx\.implicit\.use_implicit_args\(model\)\(input_ids\)`",
        ),
    ):
        model(ids)
    use_implicit_args(model)(ids)  # the call the error names runs


def test_adapted_base_model_outside_use_implicit_args(tiny_models):
    import jax
    import jax.numpy as jnp

    import peftx

    config = LoraConfig(target_modules=["lm_head"])  # the head only: past the backbone
    peft_model = peftx.get_peft_model(tiny_models["llama"], config, key=jax.random.key(1))
    ids = jnp.ones((1, 3), jnp.int32)
    with as_users_run(), pytest.raises(TypeError, match=r"implicit array \(\w+: a quantized"):
        peft_model.base_model(ids)
    peft_model(ids)
