"""`peftx generate`: it feeds the model exactly `tokenizer(prompt)` (a Llama tokenizer's
BOS included), as `encode_causal_lm` starts a training row; its continuation is
transformers' (with PyTorch PEFT) on those ids; `--quantize` runs a QLoRA adapter over an
NF4 base; `--max-new-tokens` and the sampling options are bounded with one line, exit 2;
compiled programs go to a persistent cache, so a second run compiles nothing.

The checkpoint is a tiny random Llama saved by transformers, with transformers' own
`LlamaTokenizer` built offline over single letters, with its BOS and without.
"""

import shutil
import string
import subprocess
import sys

import jax
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import as_users_run, run_cli, tiny_llama_config, transformers_greedy
from jax.experimental.compilation_cache import compilation_cache

import peftx
import peftx.cli._generate as generate_command
from peftx import train
from peftx.adapters import Int8Array, NF4Array
from peftx.cli import _generate
from peftx.implicit import materialize

# whole `peftx generate` commands
pytestmark = pytest.mark.command_run

LETTERS = string.ascii_lowercase
POSITIONS = 64
# 5, 13 and 30 tokens with BOS: prompts padded inside to 16 and to 32 columns
PROMPTS = ["a b", "the cat sat", "a quick brown fox jumps over"]


def _tokenizer(bos: bool) -> transformers.PreTrainedTokenizerBase:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    vocab |= {c: len(vocab) + i for i, c in enumerate(LETTERS)}
    vocab |= {"▁" + c: len(vocab) + i for i, c in enumerate(LETTERS)}
    return transformers.LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=bos)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """`root`: `bos/` and `plain/` (one tiny random Llama; a tokenizer that adds BOS, and
    one that does not) and `adapter/`, a PEFT LoRA adapter with non-zero factors."""
    root = tmp_path_factory.mktemp("llama")
    tok = _tokenizer(bos=True)
    config = tiny_llama_config(
        len(tok),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        max_position_embeddings=POSITIONS,
        initializer_range=0.3,  # logits far apart: greedy choices are not near-ties
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "bos")
    tok.save_pretrained(root / "bos")
    shutil.copytree(root / "bos", root / "plain")
    _tokenizer(bos=False).save_pretrained(root / "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "bos")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    adapted = peft.get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    adapted.save_pretrained(root / "adapter")
    return root


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Compiled programs go under this test's directory: not the user's cache, nor the
    suite's own (conftest), which this process leaves for the test's duration."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    suites = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield tmp_path / "cache"
    jax.config.update("jax_compilation_cache_dir", suites)
    compilation_cache.reset_cache()


def _auto_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _error(capsys, *argv):
    """The one error line of a command that exits 2."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    return err.removeprefix("peftx: error: ").rstrip("\n")


# -- the BOS contract -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bos", "plain"])
def test_generate_feeds_exactly_tokenizer_prompt(llama, kind, capsys, monkeypatch):
    """The ids under the attention mask are `tokenizer(prompt)["input_ids"]`, and a
    training row of `encode_causal_lm` for that prompt starts with the same ids."""
    fed = []
    real = peftx.models.generate

    def spy(model, input_ids, *args, attention_mask=None, **kwargs):
        ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
        fed.append(ids[mask == 1].tolist())
        assert (np.diff(mask, axis=-1) >= 0).all()  # left padding only
        return real(model, input_ids, *args, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(generate_command, "generate", spy)  # the name it calls
    tok = _auto_tokenizer(llama / kind)
    for prompt in PROMPTS:
        code, _, _ = run_cli(capsys, "generate", llama / kind, prompt, "--max-new-tokens", 2)
        assert code == 0
        want = tok(prompt)["input_ids"]
        assert fed[-1] == want
        assert (want[0] == tok.bos_token_id) == (kind == "bos")
        row = train.encode_causal_lm(tok, ["z"], [prompt], max_length=64)["input_ids"][0]
        assert row[: len(want)].tolist() == want
    assert len(fed) == len(PROMPTS)


@pytest.mark.parametrize("kind", ["bos", "plain"])
def test_generate_matches_transformers_on_the_tokenizers_ids(llama, kind, capsys):
    """Each prompt continues as transformers continues `tokenizer(prompt)`, with the
    adapter (the left padding inside changes no token)."""
    for prompt in PROMPTS:
        want = transformers_greedy(llama / kind, llama / "adapter", prompt, 8)
        args = ("generate", llama / kind, prompt, "--adapter", llama / "adapter")
        code, out, _ = run_cli(capsys, *args, "--max-new-tokens", 8)
        assert code == 0 and out == want + "\n"
        assert len(want.replace(" ", "")) > 1  # the continuation has letters


def test_with_and_without_bos_the_continuations_differ(llama):
    """The arms differ: the model sees another sequence (what a user saw as a changed answer)."""
    a = transformers_greedy(llama / "bos", None, PROMPTS[1], 8)
    b = transformers_greedy(llama / "plain", None, PROMPTS[1], 8)
    assert a != b


# -- --max-new-tokens and the sampling options ----------------------------------------------


def test_max_new_tokens_is_bounded_by_the_positions(llama, capsys):
    prompt = "a b"
    n = len(_auto_tokenizer(llama / "bos")(prompt)["input_ids"])
    room = POSITIONS - n
    err = _error(capsys, "generate", llama / "bos", prompt, "--max-new-tokens", 10**9)
    assert err == (
        f"--max-new-tokens 1000000000 with a prompt of {n} tokens exceeds the model's "
        f"{POSITIONS} positions (max_position_embeddings): give at most {room}"
    )
    assert f"give at most {room}" in _error(
        capsys, "generate", llama / "bos", prompt, "--max-new-tokens", room + 1
    )
    code, out, _ = run_cli(capsys, "generate", llama / "bos", prompt, "--max-new-tokens", room)
    assert code == 0 and out.strip()
    long = " ".join(LETTERS[:20] * 2)
    err = _error(capsys, "generate", llama / "bos", long)
    assert err.endswith(
        f"which leave none of the model's {POSITIONS} positions (max_position_embeddings) "
        "to generate in"
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-new-tokens", "0", "--max-new-tokens must be at least 1, got 0"),
        ("--temperature", "nan", "--temperature must be a finite number > 0, got nan"),
        ("--temperature", "inf", "--temperature must be a finite number > 0, got inf"),
        ("--temperature", "0", "--temperature must be a finite number > 0, got 0.0"),
        ("--top-k", "0", "--top-k must be at least 1, got 0"),
        ("--top-p", "nan", "--top-p must be in (0, 1], got nan"),
        ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
        ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
        ("--seed", "-1", "--seed must be in [0, 2**32), got -1"),
        ("--seed", str(2**32), f"--seed must be in [0, 2**32), got {2**32}"),
    ],
)
def test_sampling_options_are_checked(llama, capsys, option, value, message):
    argv = ("generate", llama / "bos", "a b", "--do-sample", option, value)
    assert _error(capsys, *argv) == message


# -- broken input: refused as `peftx merge` and `peftx finetune` refuse it -------------------

# a PEFT adapter of each kind on the tiny Llama
KINDS = {
    "lora": lambda: peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]),
    "ia3": lambda: peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]
    ),
    "lokr": lambda: peft.LoKrConfig(r=2, target_modules=["q_proj"]),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=["q_proj"]),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj"], save_projection=True),
}


def _all_nan(file):
    tensors = safetensors.numpy.load_file(str(file))
    nan = {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    safetensors.numpy.save_file(nan, str(file))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_all_nan_adapter_is_refused(llama, kind, tmp_path, capsys):
    """The repro: an all-NaN adapter printed an empty line and exited 0."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama / "bos")
    peft.get_peft_model(model, KINDS[kind]()).save_pretrained(tmp_path / kind)
    _all_nan(tmp_path / kind / "adapter_model.safetensors")
    capsys.readouterr()  # transformers' progress bars
    code, out, err = run_cli(capsys, "generate", llama / "bos", "a b", "--adapter", tmp_path / kind)
    assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"peftx: error: the adapter in {tmp_path / kind}: ")
    assert err.endswith(" holds NaN or infinite values; nothing was generated\n")


def test_a_base_with_a_nan_weight_is_refused(llama, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(llama / "bos", broken)
    file = broken / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    code, out, err = run_cli(capsys, "generate", broken, "a b")
    assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"peftx: error: the model in {broken}: ")
    assert err.endswith("down_proj.weight holds NaN or infinite values; nothing was generated\n")


def test_prompt_ids_past_the_vocabulary_are_refused(llama, tmp_path, capsys):
    """A tokenizer with tokens the model's embedding lacks (ids >= vocab_size), as
    `peftx finetune` refuses them in its rows."""
    bigger = tmp_path / "bigger"
    shutil.copytree(llama / "bos", bigger)
    tok = _auto_tokenizer(bigger)
    vocab_size = transformers.AutoConfig.from_pretrained(bigger).vocab_size
    assert len(tok) == vocab_size
    tok.add_tokens(["zebra"])
    tok.save_pretrained(bigger)
    assert _error(capsys, "generate", bigger, "a zebra") == (
        f"the prompt's token id {vocab_size} (row 1) is outside the model's vocab_size "
        f"{vocab_size} (the tokenizer has {vocab_size + 1} tokens); use the model's own tokenizer"
    )


# -- --quantize -----------------------------------------------------------------------------


QUANTIZED = (NF4Array, Int8Array)


def _quantized_leaves(model):
    """The quantized weights of `model` (a `PeftModel`'s included), dequantized, in order."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QUANTIZED))
    return [(type(w), np.asarray(materialize(w))) for w in leaves if isinstance(w, QUANTIZED)]


def test_quantize_runs_a_qlora_adapter_over_an_nf4_base(llama, tmp_path, capsys):
    """The continuation is transformers' over the dequantized NF4 weights (saved as a
    checkpoint), which differs from the dense base's: the base really was quantized."""
    model = peftx.models.from_pretrained(llama / "bos")
    quantized = peftx.quantize_model(model, peftx.QuantizationConfig(load_in_4bit=True))
    assert len(_quantized_leaves(quantized)) == 7  # every linear weight but the head
    dense = jax.tree.map(
        lambda w: materialize(w) if isinstance(w, QUANTIZED) else w,
        quantized,
        is_leaf=lambda x: isinstance(x, QUANTIZED),
    )
    peftx.models.save_pretrained(dense, tmp_path / "dequantized")
    _auto_tokenizer(llama / "bos").save_pretrained(tmp_path / "dequantized")
    prompt = PROMPTS[2]
    want = transformers_greedy(tmp_path / "dequantized", llama / "adapter", prompt, 12)
    assert want != transformers_greedy(llama / "bos", llama / "adapter", prompt, 12)
    args = ("generate", llama / "bos", prompt, "--adapter", llama / "adapter", "--quantize")
    code, out, _ = run_cli(capsys, *args, "--max-new-tokens", 12)
    assert code == 0 and out == want + "\n"


ARMS = {
    "nf4": (["--quantize"], peftx.QuantizationConfig(load_in_4bit=True)),
    "double-quant": (
        ["--quantization", "bnb_4bit_use_double_quant=true"],
        peftx.QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True),
    ),
    "int8": (
        ["--quantize", "--quantization", "load_in_8bit=true"],
        peftx.QuantizationConfig(load_in_8bit=True),
    ),
}


@pytest.mark.parametrize("arm", ARMS)
def test_quantization_fields_reach_the_model(llama, capsys, monkeypatch, arm):
    """The model `generate` gets holds the base quantized as the fields say, under the
    adapter; each arm's weights differ from the others'."""
    seen = []
    real = peftx.models.generate

    def spy(model, *args, **kwargs):
        seen.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(generate_command, "generate", spy)  # the name it calls
    options, config = ARMS[arm]
    args = ("generate", llama / "bos", "a b", "--adapter", llama / "adapter", *options)
    code, _, _ = run_cli(capsys, *args, "--max-new-tokens", 2)
    assert code == 0 and isinstance(seen[0], peftx.PeftModel)
    base = peftx.models.from_pretrained(llama / "bos")
    want = _quantized_leaves(peftx.quantize_model(base, config))
    got = _quantized_leaves(seen[0])
    assert len(got) == len(want) == 7
    for (got_type, got_w), (want_type, want_w) in zip(got, want, strict=True):
        assert got_type is want_type
        np.testing.assert_array_equal(got_w, want_w)
    for other, (_, other_config) in ARMS.items():
        if other != arm:
            theirs = _quantized_leaves(peftx.quantize_model(base, other_config))
            assert any((w != t).any() for (_, w), (_, t) in zip(want, theirs, strict=True))


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            "bnb_4bit_use_dobule_quant=true",
            (
                "unknown key 'bnb_4bit_use_dobule_quant' in --quantization (did you mean "
                "'bnb_4bit_use_double_quant'?); allowed: "
            ),
        ),
        ("load_in_4bit=yes", "--quantization load_in_4bit=yes: expected true or false"),
        ("load_in_4bit", "--quantization 'load_in_4bit': expected KEY=VALUE, e.g. "),
        ("bnb_4bit_quant_type=fp4", "--quantization: bnb_4bit_quant_type 'fp4' is not supported"),
        ("bnb_4bit_compute_dtype=bf16", "--quantization: bnb_4bit_compute_dtype must be one of"),
    ],
)
def test_quantization_fields_are_checked(llama, capsys, item, message):
    with as_users_run():
        err = _error(capsys, "generate", llama / "bos", "a b", "--quantization", item)
    assert err.startswith(message), err


# -- the persistent compilation cache -------------------------------------------------------


def test_in_process_runs_leave_the_jax_settings_as_they_were(llama, capsys, cache_home):
    """(`--max-new-tokens 3`, which no other test uses, so that generate compiles here.)"""
    assert jax.config.jax_compilation_cache_dir is None
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    code, _, _ = run_cli(capsys, "generate", llama / "bos", "a b c d", "--max-new-tokens", 3)
    assert code == 0
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold
    assert _generate.cache_dir() == cache_home / "peftx" / "jax"
    assert any((cache_home / "peftx" / "jax").iterdir())


@pytest.mark.command_run
def test_a_second_run_compiles_nothing(llama, cache_home):
    """Two processes: the first fills `$XDG_CACHE_HOME/peftx/jax`; the second finds every
    program there and adds no entry."""
    cache = cache_home / "peftx" / "jax"
    argv = [sys.executable, "-m", "peftx", "generate", str(llama / "bos"), "the cat"]
    argv += ["--max-new-tokens", "5"]

    def run():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout, {p.name for p in cache.iterdir()}

    first, entries = run()
    assert len(entries) >= 2  # generate's program and the loader's at least
    second, again = run()
    assert second == first and again == entries


def test_a_users_own_cache_directory_is_kept(llama, capsys, tmp_path, cache_home):
    """A cache directory set before (by `JAX_COMPILATION_CACHE_DIR`, say) is used as is.
    (`--max-new-tokens 7`, which no other test uses, so that generate compiles here.)"""
    ours = tmp_path / "mine"
    jax.config.update("jax_compilation_cache_dir", str(ours))
    try:
        code, _, _ = run_cli(capsys, "generate", llama / "bos", "a b c", "--max-new-tokens", 7)
        assert jax.config.jax_compilation_cache_dir == str(ours)
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()  # as cache_home left it
    assert code == 0 and any(ours.iterdir()) and not (cache_home / "peftx").exists()
