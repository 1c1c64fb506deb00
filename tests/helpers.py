"""Helpers shared by the tests: comparing pytrees, walking traced programs."""

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.extend.core as jexc
import jax.numpy as jnp
import jaxtyping
import numpy as np

from peftx.implicit import strict, use_implicit_args


def close(a, b, tol=1e-5):
    """Assert two pytrees have the same leaves, each equal within `tol`."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def assert_matches_dense_formula(adapter, fields, delta, fn, x, key):
    """`fn(adapter, x)` under `use_implicit_args` against `fn(W + delta(adapter), x)`, with
    `delta` the update written out in the test: the values, the gradients of the factors
    `fields` and of `x`, and a jvp along random factor tangents drawn from `key`; `merged`
    is the same formula, and the update moves the output."""
    weight = adapter.weight
    close(adapter.merged(weight), weight + delta(adapter), tol=1e-5)
    factors = [getattr(adapter, f) for f in fields]

    def loss(factors, x, implicit):
        a = eqx.tree_at(lambda a: [getattr(a, f) for f in fields], adapter, factors)
        if implicit:
            return jnp.sum(jnp.sin(use_implicit_args(fn)(a, x)))
        return jnp.sum(jnp.sin(fn(weight + delta(a), x)))

    grad = jax.grad(loss, argnums=(0, 1))
    with strict():
        got = jax.jit(use_implicit_args(fn))(adapter, x)
        grads = jax.jit(grad, static_argnums=2)(factors, x, True)
        keys = jax.random.split(key, len(factors))
        tangent = [jax.random.normal(k, f.shape) for k, f in zip(keys, factors)]
        _, jvp = jax.jit(lambda b, t: jax.jvp(lambda b: loss(b, x, True), (b,), (t,)))(
            factors, tangent
        )
    close(got, fn(weight + delta(adapter), x), tol=1e-4)
    assert not np.allclose(got, fn(weight, x), atol=1e-2)  # the update matters
    close(grads, jax.jit(grad, static_argnums=2)(factors, x, False), tol=1e-4)
    _, dense_jvp = jax.jvp(lambda b: loss(b, x, False), (factors,), (tangent,))
    close(jvp, dense_jvp, tol=1e-4)


def close_in_scale(got, want, ulps):
    """Assert each leaf of `got` is within `ulps` machine epsilons (of `want`'s dtype) of
    `want`'s, relative to the largest magnitude in `want`'s leaf: the bound for sums whose
    terms cancel, where an element-wise relative tolerance means nothing."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        bound = ulps * float(jnp.finfo(y.dtype).eps) * float(jnp.abs(y).max())
        error = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
        assert error.max() <= bound, f"error {error.max():.3g} over the bound {bound:.3g}"


def all_eqns(jaxpr):
    """Every equation of `jaxpr`, including those of the jaxprs nested in its params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jexc.ClosedJaxpr):
                    yield from all_eqns(sub.jaxpr)
                elif isinstance(sub, jexc.Jaxpr):
                    yield from all_eqns(sub)


def word_tokenizer(words, *, cls_sep=False):
    """A word-level tokenizer over `words` (which hold its special tokens), built offline:
    `[UNK]`, `[PAD]`, and `</s>` as EOS; with `cls_sep`, BERT's `[CLS] ... [SEP]` instead
    of an EOS."""
    import tokenizers
    import transformers

    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if cls_sep:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        specials = {"cls_token": "[CLS]", "sep_token": "[SEP]"}
    else:
        specials = {"eos_token": "</s>"}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", **specials
    )


def tiny_llama_config(vocab_size, **overrides):
    """transformers' `LlamaConfig` of a 2-layer, hidden-32 model with grouped-query
    attention (4 heads, 2 key/value heads) and pad id 0; `overrides` change any field."""
    import transformers

    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return transformers.LlamaConfig(vocab_size=vocab_size, **{**fields, **overrides})


def phi3_longrope():
    """A fresh LongRoPE `rope_parameters` for the tests' Phi-3s (head_dim 8, half of it
    rotary: two frequencies, each with its own short and long factor)."""
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        short_factor=[1.0, 1.7],
        long_factor=[3.0, 11.0],
    )


def tiny_bert_config(vocab_size, **overrides):
    """transformers' `BertConfig` of a 2-layer, hidden-32 encoder with 4 heads and 64
    positions; `overrides` change any field."""
    import transformers

    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    return transformers.BertConfig(vocab_size=vocab_size, **{**fields, **overrides})


@contextlib.contextmanager
def as_users_run():
    """Without the suite's runtime type checks (beartype on every annotated function), as
    peftx runs for its users: the errors seen are peftx's own."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def transformers_greedy(base_dir, adapter_dir, prompt, n):
    """transformers (+ PyTorch PEFT with `adapter_dir`) greedy decoding of `n` tokens after
    `tokenizer(prompt)`, decoded: the reference for `peftx generate`."""
    import peft
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def run_cli(capsys, *argv):
    """`peftx.cli.main(argv)` in process: `(exit status, stdout, stderr)`."""
    from peftx.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- the fine-tune jobs' data: words whose class a bag of words tells --------------------
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "</s>"]
WORDS = [*SPECIAL, *(f"w{i}" for i in range(59))]
CLASSES = {"red": WORDS[5:10], "green": WORDS[10:15], "blue": WORDS[15:20]}
FILLER = WORDS[20:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def intents(seed: int, n: int) -> list[dict]:
    """Texts of 2 filler words and 4 words of their class, shuffled: learnable from the
    bag of words."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = sorted(CLASSES)[i % 3]
        words = [*rng.choice(FILLER, 2), *rng.choice(CLASSES[label], 4)]
        rows.append({"sentence": " ".join(rng.permutation(words)), "intent": label})
    return rows


def run_script(path: Path, script: str, *args, ending: str = "OK", timeout: int = 900) -> str:
    """Run Python source `script` (written to `path`) as a child process from the tests'
    directory, with `args`: it must exit 0 and end by printing `ending`. Its stdout."""
    path.write_text(script)
    result = subprocess.run(
        [sys.executable, str(path), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip().endswith(ending), result.stdout[-2000:]
    return result.stdout


def start_processes(
    argv: list, *, processes: int = 1, devices: int = 8, started: int | None = None, **env: str
) -> list[subprocess.Popen]:
    """Start the first `started` (default: all) of a JAX run of `processes` child processes
    of `argv` on this machine (over the loopback address), with `devices` simulated CPU
    devices in all and `env` added to the environment; process 0's first."""
    env = dict(os.environ) | env
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices // processes}"
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": f"{processes}"}
    return [
        subprocess.Popen(
            [str(a) for a in argv],
            env=env | ({"JAX_PROCESS_ID": str(i)} if processes > 1 else {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent,
        )
        for i in range(processes if started is None else started)
    ]


def run_processes(argv: list, *, processes: int = 1, devices: int = 8, timeout: int = 600):
    """Run `argv` as a JAX run of `processes` child processes on this machine (over the
    loopback address), `devices` simulated CPU devices in all: each one's
    `(exit status, stdout, stderr)`, process 0's first."""
    children = start_processes(argv, processes=processes, devices=devices)
    results = []
    for child in children:
        out, err = child.communicate(timeout=timeout)
        results.append((child.returncode, out, err))
    return results


def unpacked(data):
    """The examples of packed `data`, each `(ids, labels)`, read back from the rows:
    an example starts where `position_ids` is 0 and counts up by one; each row ends in
    padding (masked, labelled -100, at position 0). Checks that layout as it goes."""
    examples = []
    for ids, mask, labels, positions in zip(
        *(data[k].tolist() for k in ("input_ids", "attention_mask", "labels", "position_ids"))
    ):
        real = sum(mask)
        assert mask == [1] * real + [0] * (len(mask) - real), "padding only at a row's end"
        assert labels[real:] == [-100] * (len(mask) - real) and not any(positions[real:])
        for t in range(real):
            if positions[t] == 0:
                examples.append(([], []))
            else:
                assert positions[t] == positions[t - 1] + 1
            examples[-1][0].append(ids[t])
            examples[-1][1].append(labels[t])
    return examples


ROOT = Path(__file__).parents[1]
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"  # on the line above a code block: shown and compiled, not run


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    """A fenced code block of a Markdown page; `line` is its first line of code (1-based)."""

    page: Path
    line: int
    language: str
    code: str
    fragment: bool


def code_blocks(page):
    """The fenced code blocks of the Markdown file `page`, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"( *)```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(x[len(indent) :] for x in lines[i + 1 : end])
        fragment = i > 0 and lines[i - 1].strip() == FRAGMENT
        blocks.append(CodeBlock(page, i + 2, language, code, fragment))
        i = end + 1
    return blocks


def section_code(page, heading):
    """The first Python block after the line `heading` of `page`."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading) + 1
    return next(b for b in code_blocks(page) if b.language == "python" and b.line > start)


def example_count(n: int) -> int:
    """Hypothesis's `max_examples` for a property test: `n` in the whole suite, a quarter
    (at least 2) in the fast tier (`make test-fast` sets `PEFTX_FAST_TESTS=1`)."""
    return max(2, n // 4) if os.environ.get("PEFTX_FAST_TESTS") else n
