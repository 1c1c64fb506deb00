import gc
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

# The suite's models are tiny: LLVM's optimizations cost XLA more compile time than they
# save at run time (a quarter of the suite's time), and XLA:CPU's fusion emitters compile
# slower than its older code generation (a third of a file's time on 2 cores). Set before
# JAX starts, and inherited by the xdist workers and the child processes, whose scripts add
# to it. An XLA that no longer knows a flag aborts, so the emitters' flag is tried first.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
_OLDER_CODEGEN = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag):
    probe = "import jax; jax.devices()"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return done.returncode == 0


if "PEFTX_TESTS_XLA_FLAGS" not in os.environ:  # the first process: workers inherit it
    flags = _FAST_COMPILE + ((_OLDER_CODEGEN,) if _xla_knows(_OLDER_CODEGEN) else ())
    os.environ["PEFTX_TESTS_XLA_FLAGS"] = " ".join(flags)
    os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), *flags))

# One persistent compilation cache for the session, its xdist workers and their child
# processes, which compile many of the same programs (each `peftx finetune` run builds its
# step anew): made by the first process and removed by it at the end.
_MADE_CACHE = "PEFTX_TESTS_JAX_CACHE" not in os.environ
if _MADE_CACHE:
    os.environ["PEFTX_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="peftx-tests-jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["PEFTX_TESTS_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax
import numpy as np
import pytest
from helpers import (
    FILLER,
    WORDS,
    intents,
    tiny_bert_config,
    tiny_llama_config,
    word_tokenizer,
    write_jsonl,
)

from peftx.implicit import MaterializationWarning

# A materialization nobody asked about is a bug; tests that expect one use `pytest.warns`.
warnings.filterwarnings("error", category=MaterializationWarning)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(os.environ["PEFTX_TESTS_JAX_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _own_cache_dir(tmp_path_factory):
    """`peftx generate` keeps compiled programs under $XDG_CACHE_HOME: the tests' own, not
    the user's."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        yield


@pytest.fixture
def getkey():
    """A fresh PRNG key on each call."""
    counter = itertools.count()
    base = jax.random.key(0)
    return lambda: jax.random.fold_in(base, next(counter))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny random BERT encoder with a tokenizer, and a job on a synthetic dataset."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("bert")
    config = tiny_bert_config(
        len(WORDS),
        initializer_range=0.2,  # features large enough for a few steps to learn from
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(root / "base")
    word_tokenizer(WORDS, cls_sep=True).save_pretrained(root / "base")
    write_jsonl(root / "train.jsonl", intents(0, 96))
    write_jsonl(root / "eval.jsonl", intents(1, 48))
    (root / "job.toml").write_text(
        """
[model]
path = "base"
task = "classification"

[data]
train = "train.jsonl"
eval = "eval.jsonl"
text_column = "sentence"
label_column = "intent"
max_length = 16

[lora]
r = 4
lora_alpha = 8
lora_dropout = 0.1
target_modules = ["query", "value"]

[train]
seed = 3
batch_size = 16
eval_batch_size = 32
learning_rate = 2e-2
warmup_steps = 2
log_every = 5
eval_every = 10
"""
    )
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama with a tokenizer, and a causal-LM job whose examples are a
    prompt (left out of the loss) and a continuation that the prompt determines."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("llama")
    config = tiny_llama_config(
        len(WORDS),
        bos_token_id=None,
        eos_token_id=4,
        initializer_range=0.2,  # an output head that can express confident predictions
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    word_tokenizer(WORDS).save_pretrained(root / "base")
    rng = np.random.default_rng(0)

    def rows(n: int) -> list[dict]:
        out = []
        for _ in range(n):
            start = int(rng.integers(5, len(WORDS) - 8))
            prompt = " ".join(rng.choice(FILLER, 3)) + f" {WORDS[start]}"
            text = " ".join(WORDS[start + 1 : start + 6])  # counts on from the prompt
            out.append({"question": prompt, "answer": text})
        return out

    write_jsonl(root / "train.jsonl", rows(120))
    write_jsonl(root / "eval.jsonl", rows(30))
    (root / "job.toml").write_text(
        """
[model]
path = "base"
task = "causal-lm"

[data]
train = "train.jsonl"
eval = "eval.jsonl"
text_column = "answer"
prompt_column = "question"
max_length = 16
pack = true

[lora]
r = 4
lora_alpha = 8
lora_dropout = 0.05
target_modules = ["q_proj", "v_proj", "down_proj"]

[train]
batch_size = 8
learning_rate = 3e-2
log_every = 5

[output]
merged = true
"""
    )
    return root


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """test_peft_interop's tiny random Llama checkpoint, made once per test file: its
    directory and its peftx model by layout. q_proj (32, 32), v_proj (16, 32), down_proj
    (32, 64), up_proj (64, 32)."""
    import torch
    from test_peft_interop import BUILDERS, _randomize_torch_base

    import peftx.models as pm

    torch.manual_seed(0)
    model = _randomize_torch_base(BUILDERS["llama"]().eval(), seed=7)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    built = {}

    def get(layout="stacked"):
        if layout not in built:
            built[layout] = pm.from_pretrained(path, layout=layout)
        return built[layout]

    return path, get


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test file's compiled programs are dropped after it. XLA:CPU maps memory for
    every executable it keeps (a worker passed 10,000 mappings within two test files),
    and a worker that reached the kernel's `vm.max_map_count` (65,530) segfaulted in the
    next compile or cache write (`backend_compile_and_load`, `serialize`)."""
    yield
    jax.clear_caches()
    gc.collect()


# Files of long tests (child processes on 8 simulated devices, whole `peftx finetune`
# runs) go first: collected in name order they came last, and one worker ran them alone
# while the other idled.
_LONG_FIRST = (
    "test_sharding_generate.py",
    "test_sharding_presets.py",
    "test_sharding_cli.py",
    "test_sharding_io.py",
    "test_sharding_processes.py",
    "test_finetune_trust.py",
    "test_finetune.py",
    "test_sharding_memory.py",
    # the longest files of the fast tier, for `--dist loadfile`
    "test_bank.py",
    "test_peft_interop.py",
    "test_lora.py",
    "test_llama.py",
    "test_config_fields.py",
    "test_generate.py",
    "test_multi_adapter.py",
    "test_moe_lora.py",
    "test_serve.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)
    _mark_second_layouts(items)


def _mark_second_layouts(items):
    """`layout_sweep` on the unrolled case of a test run on both zoo layouts: the fast
    tier runs the stacked one (the zoo's default), the whole suite both."""
    stacked = {
        (item.function, _other_params(item))
        for item in items
        if getattr(item, "callspec", None) and item.callspec.params.get("layout") == "stacked"
    }
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if params and params.get("layout") == "unrolled":
            if (item.function, _other_params(item)) in stacked:
                item.add_marker(pytest.mark.layout_sweep)


def _other_params(item):
    return tuple(sorted((k, repr(v)) for k, v in item.callspec.params.items() if k != "layout"))
