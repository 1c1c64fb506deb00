"""The benchmark suite: one command, one markdown report, every figure of a table measured
side by side in one run.

Train steps (zoo Llama, zoo BERT), inference, QLoRA against LoRA, compile time, memory and
NF4 storage. Times are medians over `--repeats` calls taken round-robin across the
variants of a table (so drifts of the machine hit them all alike), after `--warmup` calls;
ratios are within the run. On a GPU the Llama is ~1B parameters in bfloat16.

Run: `python benchmarks/suite.py [--quick | --tiny] [--out benchmarks/RESULTS.md]`.
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hand_models import from_peft_bert, from_peft_llama, lora_spec

import peftx
import peftx.models as pm
from peftx.implicit import strict
from peftx.models._common import attention_mask, dot_product_attention

Array = jax.Array
RANK, ALPHA = 8, 16
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BERT_TARGETS = ["query", "key", "value", "output.dense", "intermediate.dense"]
FROZEN = "frozen model, norm weights trained"
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16
# (llama: hidden, intermediate, layers, heads, kv heads, vocab, batch, seq;
#  bert: layers, hidden, heads, intermediate, vocab, batch, seq; warmup, repeats, compiles)
SIZES = {
    "full": dict(
        llama=(512, 1376, 4, 8, 4, 2048, 8, 128),
        bert=(6, 384, 12, 1536, 30522, 16, 64),
        warmup=2,
        repeats=10,
        compiles=3,
    ),
    "quick": dict(
        llama=(256, 688, 2, 4, 2, 2048, 4, 128),
        bert=(2, 384, 12, 1536, 30522, 8, 64),
        warmup=1,
        repeats=3,
        compiles=1,
    ),
    "tiny": dict(
        llama=(64, 128, 1, 2, 1, 256, 2, 16),
        bert=(1, 64, 2, 128, 512, 2, 16),
        warmup=0,
        repeats=1,
        compiles=1,
    ),
    "gpu": dict(
        llama=(2048, 5632, 16, 16, 8, 32000, 4, 2048),
        bert=(6, 384, 12, 1536, 30522, 64, 128),
        warmup=3,
        repeats=15,
        compiles=1,
    ),
}


# --------------------------------------------------------------------------------------
# Variants: something to compile once and call many times


class Variant:
    """A jitted function with its arguments; `step=True` feeds `(trainable, state)` back."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        args: tuple,
        *,
        step: bool,
        flops: float = 0.0,
        implicit: bool = False,
    ):
        self.name, self.args, self.step, self.flops = name, list(args), step, flops
        self.jitted = eqx.filter_jit(fn)
        self.times: list[float] = []
        t0 = time.perf_counter()
        if implicit:
            with strict():  # tracing here: a materialized weight would raise
                lowered = self.jitted.lower(*self.args)
        else:
            lowered = self.jitted.lower(*self.args)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        self.lower_s, self.compile_s = t1 - t0, time.perf_counter() - t1
        self.memory = self.compiled.compiled.memory_analysis()
        self.implicit = implicit
        self.first = self.call()

    def call(self) -> Any:
        out = jax.block_until_ready(self.compiled(*self.args))
        if self.step:
            self.args[0], self.args[2] = out[0], out[1]
            return out[2]
        return out

    def run(self) -> None:
        t0 = time.perf_counter()
        self.call()
        self.times.append(time.perf_counter() - t0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


class TorchVariant:
    """A PyTorch training step (forward, backward, AdamW) on `inputs`."""

    def __init__(self, name: str, model: Any, loss: Callable, flops: float):
        import torch

        self.name, self.model, self.loss, self.flops = name, model, loss, flops
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.times: list[float] = []
        self.sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else lambda: None
        self.first = self.call()

    def call(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.model)
        loss.backward()
        self.opt.step()
        self.sync()
        return loss.detach().item()

    def run(self) -> None:
        t0 = time.perf_counter()
        self.call()
        self.times.append(time.perf_counter() - t0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure(variants: list[Any], warmup: int, repeats: int) -> None:
    """Warm-up calls, then `repeats` rounds calling every variant once each."""
    for _ in range(warmup):
        for v in variants:
            v.run()
    for v in variants:
        v.times.clear()
    for _ in range(repeats):
        for v in variants:
            v.run()


def train_step(loss: Callable, optim: optax.GradientTransformation) -> Callable:
    def step(trainable: Any, frozen: Any, state: Any, batch: Any) -> tuple[Any, Any, Array]:
        value, grads = jax.value_and_grad(lambda t: loss(eqx.combine(t, frozen), batch))(trainable)
        updates, state = optim.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state, value

    return step


def step_variant(name: str, model: Any, spec: Any, loss: Callable, batch: Any, **kw: Any):
    optim = optax.adamw(1e-4)
    trainable, frozen = eqx.partition(model, spec)
    state = optim.init(trainable)
    v = Variant(name, train_step(loss, optim), (trainable, frozen, state, batch), step=True, **kw)
    v.state_bytes = 2 * nbytes(trainable) + nbytes(state)  # params + grads + AdamW
    v.n_trainable = sum(x.size for x in jax.tree.leaves(eqx.filter(trainable, eqx.is_array)))
    return v


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


# --------------------------------------------------------------------------------------
# Models, losses, FLOPs


def lm_loss(logits: Array, ids: Array) -> Array:
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def cls_loss(logits: Array, labels: Array) -> Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def llama_config(size: tuple) -> pm.LlamaConfig:
    hidden, inter, layers, heads, kv, vocab, _, _ = size
    return pm.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
    )


def bert_config(size: tuple) -> pm.BertConfig:
    layers, hidden, heads, inter, vocab, _, _ = size
    return pm.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def llama_linears(c: pm.LlamaConfig, tokens: int) -> list[tuple[int, int, int, bool]]:
    """`(tokens, in, out, adapted)` of every linear layer, in the order they run."""
    d, hd = c.hidden_size, c.head_dim
    block = [
        (d, c.num_attention_heads * hd),
        (d, c.num_key_value_heads * hd),
        (d, c.num_key_value_heads * hd),
        (c.num_attention_heads * hd, d),
        (d, c.intermediate_size),
        (d, c.intermediate_size),
        (c.intermediate_size, d),
    ]
    out = [(tokens, i, o, True) for _ in range(c.num_hidden_layers) for i, o in block]
    return out + [(tokens, d, c.vocab_size, False)]


def bert_linears(c: pm.BertConfig, batch: int, seq: int) -> list[tuple[int, int, int, bool]]:
    d, t = c.hidden_size, batch * seq
    block = [(d, d)] * 4 + [(d, c.intermediate_size), (c.intermediate_size, d)]
    out = [(t, i, o, True) for _ in range(c.num_hidden_layers) for i, o in block]
    return out + [(batch, d, d, False), (batch, d, c.num_labels, False)]


def step_flops(linears: list, attention: float, kind: str) -> float:
    """Matmul FLOPs of one step: forward, activation gradient and (full) weight gradient of
    every linear layer, LoRA's rank-r products, and attention's products times three."""
    gemm = sum(2 * t * i * o for t, i, o, _ in linears)
    if kind == "full":
        return 3 * gemm + 3 * attention
    if kind == "floor":
        return 2 * gemm
    if kind == "frozen":
        return 2 * gemm + 3 * attention
    lora = sum(3 * 2 * t * RANK * (i + o) for t, i, o, adapted in linears if adapted)
    return 2 * gemm + lora + 3 * attention


def norms_spec(model: Any) -> Any:
    """Train only the normalization weights: the backward then runs the activation
    gradients through every layer, as any adapter's does, with no adapter work at all."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: eqx.is_inexact_array(x) and "norm" in jax.tree_util.keystr(path).lower(),
        model,
    )


def gemm_floor(linears: list, dtype: Any, key: Array) -> Variant:
    """The forward and activation-gradient GEMMs of every linear layer, token-major, in one
    jitted function and nothing else; chained (each consumes the last output of its width)
    so XLA cannot merge independent products into one."""
    keys = jax.random.split(key, len(linears) + 1)
    weights = [
        jax.random.normal(k, (o, i), dtype) / (i * o) ** 0.25
        for k, (_, i, o, _) in zip(keys, linears)
    ]
    inputs = {(t, i): jax.random.normal(keys[-1], (t, i), dtype) for t, i, _, _ in linears}

    def floor(weights: list[Array], acts: dict) -> dict:
        acts = dict(acts)
        for (t, i, o, _), w in zip(linears, weights):
            y = jax.lax.dot_general(acts[t, i], w, (((1,), (1,)), ((), ())))  # (t,i)@(i,o)
            acts[t, o] = y
            acts[t, i] = y @ w  # (t,o)@(o,i)
        return acts

    return Variant(
        "GEMM floor", floor, (weights, inputs), step=False, flops=step_flops(linears, 0, "floor")
    )


def attention_cost(
    shape: tuple[int, int, int, int, int], layers: int, causal: bool, dtype: Any, key: Array
) -> Variant:
    """The zoo's softmax attention (`dot_product_attention`), forward and backward, once per
    layer, chained through the gradients: the other matmul work a step cannot avoid."""
    b, s, heads, kv, hd = shape
    kq, kk, kv_ = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, s, heads, hd), dtype)
    k, v = (jax.random.normal(x, (b, s, kv, hd), dtype) for x in (kk, kv_))
    slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mask = attention_mask(slots, jnp.ones((b, s), bool), causal=causal)

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
        for _ in range(layers):
            out, vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, hd**-0.5), q, k, v)
            q, k, v = vjp(out)
        return q, k, v

    flops = 3 * 4 * b * s * s * heads * hd * layers
    return Variant("attention fwd + bwd", attention, (q, k, v), step=False, flops=flops)


# --------------------------------------------------------------------------------------
# PyTorch


def torch_available() -> bool:
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def torch_variants(
    kind: str,
    config: Any,
    batch: np.ndarray,
    labels: np.ndarray | None,
    targets: list[str],
    flops: dict[str, float],
    gpu: bool,
) -> list[TorchVariant]:
    """PyTorch PEFT LoRA and PyTorch full fine-tuning of transformers' own model."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = transformers.AutoConfig.for_model(**config.to_hf_config())
    cls = (
        transformers.LlamaForCausalLM
        if kind == "llama"
        else transformers.BertForSequenceClassification
    )
    ids = torch.as_tensor(np.array(batch, np.int64), device=device)
    if kind == "llama":
        loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    else:
        y = torch.as_tensor(np.array(labels, np.int64), device=device)
        loss = lambda m: m(input_ids=ids, labels=y).loss  # noqa: E731
    lora_config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,
        task_type="CAUSAL_LM" if kind == "llama" else "SEQ_CLS",
    )
    lora = peft.get_peft_model(cls(hf), lora_config).to(device, dtype).train()
    full = cls(hf).to(device, dtype).train()
    return [
        TorchVariant("PyTorch PEFT LoRA", lora, loss, flops["lora"]),
        TorchVariant("PyTorch full fine-tuning", full, loss, flops["full"]),
    ]


# --------------------------------------------------------------------------------------
# The tables


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((f for name, f in PEAK_FLOPS.items() if name in kind), None)


def train_table(variants: list[Any], tokens: int) -> tuple[str, dict]:
    """Rows with median, ratio to full fine-tuning, multiple of the floor, throughput."""
    by = {v.name: v for v in variants if not isinstance(v, str)}
    full, floor = by["full fine-tuning"].median, by["GEMM floor"].median
    peak = peak_flops()
    header = ["step", "median ms", "vs full FT", "vs GEMM floor", "tokens/s", "TFLOP/s"]
    header += ["MFU"] if peak else []
    header += ["XLA temp MiB"]
    rows = []
    for v in variants:
        if isinstance(v, str):  # a row that could not run
            rows.append([v, "not installed", *[""] * (len(header) - 2)])
            continue
        tflops = v.flops / v.median / 1e12
        temp = mib(v.memory.temp_size_in_bytes) if hasattr(v, "memory") else ""
        row = [
            v.name,
            ms(v.median),
            f"{v.median / full:.2f}x",
            f"{v.median / floor:.2f}x",
            f"{tokens / v.median:,.0f}" if isinstance(v, TorchVariant) or v.step else "",
            f"{tflops:.3f}",
        ]
        row += [f"{100 * v.flops / v.median / peak:.0f}%"] if peak else []
        rows.append(row + [temp])
    return md_table(header, rows), {name: v.median for name, v in by.items()}


def paired_ratios(a: Any, b: Any) -> list[float]:
    """`a`'s time over `b`'s in each round-robin round: a drift in the machine's speed
    moves both calls of a round alike, so these scatter less than the medians' ratio."""
    return [x / y for x, y in zip(a.times, b.times, strict=True)]


def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


# --------------------------------------------------------------------------------------
# The runs


def llama_group(size: tuple, dtype: Any, gpu: bool, use_torch: bool) -> dict:
    """Every Llama train-step variant, built (compiled) and checked."""
    c = llama_config(size)
    *_, b, s = size
    kb, kl, kd, kf = jax.random.split(jax.random.key(0), 4)
    ids = jax.random.randint(kd, (b, s), 0, c.vocab_size)
    base = pm.LlamaForCausalLM(c, key=kb, dtype=dtype)
    lconf = peftx.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=LLAMA_TARGETS, init_lora_weights=False
    )
    peft = peftx.get_peft_model(base, lconf, key=kl)
    hand = from_peft_llama(peft)
    unrolled = pm.LlamaForCausalLM(c, key=kb, dtype=dtype, layout="unrolled")
    peft_unrolled = peftx.get_peft_model(unrolled, lconf, key=kl)
    nf4 = peftx.QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)
    qlora = peftx.get_peft_model(peftx.quantize_model(base, nf4), lconf, key=kl)

    linears = llama_linears(c, b * s)
    attention = 4 * b * s * s * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    fl = {k: step_flops(linears, attention, k) for k in ("full", "lora", "frozen")}
    zoo_loss = lambda m, x: lm_loss(m(x).logits, x)  # noqa: E731
    hand_loss = lambda m, x: lm_loss(m(x), x)  # noqa: E731
    v = [
        step_variant(
            "peftx LoRA",
            peft,
            peft.trainable_spec(),
            zoo_loss,
            ids,
            flops=fl["lora"],
            implicit=True,
        ),
        step_variant(
            "hand-written Equinox LoraLinear",
            hand,
            lora_spec(hand),
            hand_loss,
            ids,
            flops=fl["lora"],
        ),
        step_variant(
            "full fine-tuning", base, eqx.is_inexact_array, zoo_loss, ids, flops=fl["full"]
        ),
        step_variant(FROZEN, base, norms_spec(base), zoo_loss, ids, flops=fl["frozen"]),
    ]
    if use_torch:
        v += torch_variants("llama", c, np.asarray(ids), None, LLAMA_TARGETS, fl, gpu)
    else:
        v += ["PyTorch PEFT LoRA", "PyTorch full fine-tuning"]
    v.append(gemm_floor(linears, dtype, kf))
    attn_shape = (b, s, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    v.append(attention_cost(attn_shape, c.num_hidden_layers, True, dtype, kf))
    extra = [
        step_variant(
            'peftx LoRA, layout="unrolled"',
            peft_unrolled,
            peft_unrolled.trainable_spec(),
            zoo_loss,
            ids,
            flops=fl["lora"],
            implicit=True,
        ),
        step_variant(
            'full fine-tuning, layout="unrolled"',
            unrolled,
            eqx.is_inexact_array,
            zoo_loss,
            ids,
            flops=fl["full"],
        ),
        step_variant(
            "peftx QLoRA (NF4 + double quant)",
            qlora,
            qlora.trainable_spec(),
            zoo_loss,
            ids,
            flops=fl["lora"],
            implicit=True,
        ),
    ]
    by = {x.name: x for x in v + extra if not isinstance(x, str)}
    loss_peft, loss_hand = float(by["peftx LoRA"].first), float(by[v[1].name].first)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    if abs(loss_peft - loss_hand) > tol:
        raise SystemExit(f"Llama: hand-written loss {loss_hand} differs from peftx {loss_peft}")
    check = f"first-step loss: peftx {loss_peft:.6f}, hand-written {loss_hand:.6f}"
    return dict(
        config=c,
        batch=(b, s),
        variants=v,
        extra=extra,
        check=check,
        base=base,
        peft=peft,
        ids=ids,
        qlora=qlora,
        forward=zoo_loss,
    )


def bert_group(size: tuple, dtype: Any, gpu: bool, use_torch: bool) -> dict:
    c = bert_config(size)
    *_, b, s = size
    kb, kl, kd, ky, kf = jax.random.split(jax.random.key(1), 5)
    ids = jax.random.randint(kd, (b, s), 1, c.vocab_size)
    labels = jax.random.randint(ky, (b,), 0, c.num_labels)
    base = pm.BertForSequenceClassification(c, key=kb, dtype=dtype)
    lconf = peftx.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=BERT_TARGETS,
        init_lora_weights=False,
        task_type="SEQ_CLS",
    )
    peft = peftx.get_peft_model(base, lconf, key=kl)
    hand = from_peft_bert(peft)
    linears = bert_linears(c, b, s)
    attention = 4 * b * s * s * c.hidden_size * c.num_hidden_layers
    fl = {k: step_flops(linears, attention, k) for k in ("full", "lora", "frozen")}
    zoo_loss = lambda m, x: cls_loss(m(x[0]).logits, x[1])  # noqa: E731
    hand_loss = lambda m, x: cls_loss(m(x[0]), x[1])  # noqa: E731
    batch = (ids, labels)
    v = [
        step_variant(
            "peftx LoRA",
            peft,
            peft.trainable_spec(),
            zoo_loss,
            batch,
            flops=fl["lora"],
            implicit=True,
        ),
        step_variant(
            "hand-written Equinox LoraLinear",
            hand,
            lora_spec(hand),
            hand_loss,
            batch,
            flops=fl["lora"],
        ),
        step_variant(
            "full fine-tuning", base, eqx.is_inexact_array, zoo_loss, batch, flops=fl["full"]
        ),
        step_variant(FROZEN, base, norms_spec(base), zoo_loss, batch, flops=fl["frozen"]),
    ]
    if use_torch:
        v += torch_variants("bert", c, np.asarray(ids), np.asarray(labels), BERT_TARGETS, fl, gpu)
    else:
        v += ["PyTorch PEFT LoRA", "PyTorch full fine-tuning"]
    v.append(gemm_floor(linears, dtype, kf))
    heads = c.num_attention_heads
    attn_shape = (b, s, heads, heads, c.hidden_size // heads)
    v.append(attention_cost(attn_shape, c.num_hidden_layers, False, dtype, kf))
    loss_peft, loss_hand = float(v[0].first), float(v[1].first)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    if abs(loss_peft - loss_hand) > tol:
        raise SystemExit(f"BERT: hand-written loss {loss_hand} differs from peftx {loss_peft}")
    check = f"first-step loss: peftx {loss_peft:.6f}, hand-written {loss_hand:.6f}"
    return dict(
        config=c, batch=(b, s), variants=v, extra=[], check=check, base=base, peft=peft, ids=ids
    )


def hand_merged(peft: peftx.PeftModel) -> Any:
    """The base model with `W + scaling · B @ A` written into every adapted weight by hand."""

    def is_set(x: Any) -> bool:
        return isinstance(x, peftx.adapters.AdapterSet)

    def merged(s: Any) -> Any:
        if not is_set(s):
            return s
        a = s.adapters["default"]
        delta = jnp.einsum("...or,...ri->...oi", a.lora_B, a.lora_A) * a.scaling
        return s.weight + delta.astype(s.weight.dtype)

    return jax.tree.map(merged, peft.base_model, is_leaf=is_set)


def same_program(a: Variant, b: Variant) -> bool:
    """Whether two variants compiled to the same optimized HLO (metadata aside)."""

    def text(v: Variant) -> str:
        return re.sub(r", metadata=\{[^}]*\}", "", v.compiled.compiled.as_text())

    return text(a) == text(b)


def inference_group(group: dict) -> tuple[list[Variant], str]:
    """Base forward, LoRA unmerged (`peft_model(...)`) and merged (`merge_and_unload`)."""
    base, peft, ids = group["base"], group["peft"], group["ids"]
    merged = peft.merge_and_unload()
    if type(merged) is not type(base):
        raise SystemExit(f"merge_and_unload returned {type(merged).__name__}")
    forward = lambda m, x: m(x).logits  # noqa: E731
    v = [
        Variant("base model", forward, (base, ids), step=False),
        Variant("LoRA unmerged (peft_model(...))", forward, (peft, ids), step=False, implicit=True),
        Variant("LoRA merged (merge_and_unload)", forward, (merged, ids), step=False),
    ]
    want = jax.jit(lambda m, x: m(x).logits)(hand_merged(peft), ids)
    err_hand = float(jnp.max(jnp.abs(v[2].first - want)))
    err_unmerged = float(jnp.max(jnp.abs(v[2].first - v[1].first)))
    scale = float(jnp.max(jnp.abs(want)))
    if err_hand > 1e-5 * max(scale, 1.0) or err_unmerged > 1e-3 * max(scale, 1.0):
        raise SystemExit(f"merged outputs differ: {err_hand} (hand merge), {err_unmerged}")
    check = (
        f"merged logits vs the base class on hand-merged weights: max diff {err_hand:.1e}; "
        f"vs unmerged: {err_unmerged:.1e} (max |logit| {scale:.2f})"
    )
    return v, check


def compile_rows(groups: dict[str, dict], inference: dict[str, list], repeats: int) -> str:
    """Trace+lower and XLA compile seconds of the steps and forwards, fresh each time."""
    entries = []
    for model, g in groups.items():
        by = {x.name: x for x in g["variants"] if isinstance(x, Variant)}
        for name in ("full fine-tuning", "hand-written Equinox LoraLinear", "peftx LoRA"):
            entries.append((model, f"train step: {name}", by[name]))
        for x in inference[model][:2]:
            entries.append((model, f"forward: {x.name}", x))
    times = {id(x): [(x.lower_s, x.compile_s)] for _, _, x in entries}
    for _ in range(repeats - 1):
        for _, _, x in entries:
            jax.clear_caches()
            t0 = time.perf_counter()
            if x.implicit:
                with strict():
                    lowered = x.jitted.lower(*x.args)
            else:
                lowered = x.jitted.lower(*x.args)
            t1 = time.perf_counter()
            lowered.compile()
            times[id(x)].append((t1 - t0, time.perf_counter() - t1))
    rows, ref = [], {}
    for model, label, x in entries:
        lower = statistics.median(t[0] for t in times[id(x)])
        comp = statistics.median(t[1] for t in times[id(x)])
        key = (model, label.split(":")[0])
        ref.setdefault(key, lower + comp)
        rows.append(
            [
                f"{model}, {label}",
                "yes" if x.implicit else "no",
                f"{lower:.2f}",
                f"{comp:.2f}",
                f"{lower + comp:.2f}",
                f"{(lower + comp) / ref[key]:.2f}x",
            ]
        )
    return md_table(
        [
            "what",
            "use_implicit_args",
            "trace + lower s",
            "XLA compile s",
            "total s",
            "vs the first row of its kind",
        ],
        rows,
    )


def nf4_rows(base: Any) -> str:
    """Bytes of the Llama's arrays before and after `quantize_model`, and per parameter of
    the quantized weights (codes, absmax and the nested state all counted)."""

    def is_nf4(x: Any) -> bool:
        return isinstance(x, peftx.adapters.NF4Array)

    rows = []
    n_quantized = None
    for label, double in (("before (dense)", None), ("NF4", False), ("NF4 + double quant", True)):
        model = (
            base
            if double is None
            else peftx.quantize_model(
                base, peftx.QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=double)
            )
        )
        weights = [x for x in jax.tree.leaves(model, is_leaf=is_nf4) if is_nf4(x)]
        if weights:
            n_quantized = sum(int(np.prod(w.shape)) for w in weights)
            per_param = sum(nbytes(w) for w in weights) / n_quantized
        else:
            per_param = jnp.dtype(base.model.embed_tokens.weight.dtype).itemsize
        rows.append([label, mib(nbytes(model)), f"{per_param:.4f}", f"{8 * per_param:.3f}"])
    rows[0][2:] = [f"{float(rows[0][2]):.4f}", f"{8 * float(rows[0][2]):.3f}"]
    table = md_table(
        ["Llama base", "all arrays MiB", "bytes/param (linear weights)", "bits/param"], rows
    )
    return table + f"\n\n{n_quantized:,} parameters quantized (every Linear but `lm_head`)."


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = [
        f"jax {jax.__version__}",
        f"equinox {eqx.__version__}",
        f"optax {optax.__version__}",
    ]
    if torch_available():
        import peft
        import torch
        import transformers

        versions += [
            f"torch {torch.__version__}",
            f"transformers {transformers.__version__}",
            f"peft {peft.__version__}",
        ]
    dev = jax.devices()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores; JAX device: {dev.platform} ({dev.device_kind}); "
        + ", ".join(versions)
        + f"; Python {platform.python_version()}"
    )


KEPT = (
    "<!-- Below: the focused scripts' tables, kept by `suite.py --out`; "
    "each script prints its own. -->"
)


def write_report(path: str, report: str) -> None:
    """Write the suite's report to `path`, keeping what `path` holds from the `KEPT` line on
    (the focused scripts' tables, which this run does not measure)."""
    old = open(path).read() if os.path.exists(path) else ""
    kept = old[old.index(KEPT) :] if KEPT in old else ""
    with open(path, "w") as f:
        f.write(report + ("\n" + kept if kept else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (~3 min)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, 1 repeat (smoke test)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    mode = "tiny" if args.tiny else "quick" if args.quick else "gpu" if gpu else "full"
    sz = SIZES[mode]
    dtype = jnp.bfloat16 if gpu else jnp.float32
    use_torch = torch_available() and not args.no_torch
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    jax.jit(lambda x: x + 1)(1.0)  # JAX's one-off start-up, not a variant's compile
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    log("building the Llama variants")
    llama = llama_group(sz["llama"], dtype, gpu, use_torch)
    log("building the BERT variants")
    bert = bert_group(sz["bert"], dtype, gpu, use_torch)
    groups = {"Llama": llama, "BERT": bert}
    inference, inf_checks = {}, {}
    for name, g in groups.items():
        inference[name], inf_checks[name] = inference_group(g)
    for name, g in groups.items():
        log(f"timing the {name} train steps")
        measure(
            [x for x in g["variants"] + g["extra"] if not isinstance(x, str)],
            sz["warmup"],
            sz["repeats"],
        )
    log("timing inference")
    measure([x for vs in inference.values() for x in vs], sz["warmup"] + 2, 3 * sz["repeats"])
    log("timing compiles")
    compiles = compile_rows(groups, inference, sz["compiles"])
    load_after = os.getloadavg()

    out = [
        f"# peftx benchmark suite ({mode})",
        "",
        f"Machine: {machine()}.",
        "",
        (
            f"Run {started:%Y-%m-%d %H:%M} UTC; load average (1, 5, 15 min) "
            f"{', '.join(f'{x:.2f}' for x in load_before)} before, "
            f"{', '.join(f'{x:.2f}' for x in load_after)} after. Medians of {sz['repeats']} "
            f"round-robin calls after {sz['warmup']} warm-up; ratios within this run. "
            f"`python benchmarks/suite.py{' --' + mode if mode in ('quick', 'tiny') else ''}`."
        ),
    ]
    for name, g in groups.items():
        c, (b, s) = g["config"], g["batch"]
        by = {x.name: x for x in g["variants"] + g["extra"] if not isinstance(x, str)}
        table, med = train_table(g["variants"] + g["extra"], b * s)
        pairs = paired_ratios(by["peftx LoRA"], by["full fine-tuning"])
        full, lora, hand = (
            med["full fine-tuning"],
            med["peftx LoRA"],
            med["hand-written Equinox LoraLinear"],
        )
        if name == "Llama":
            shape = (
                f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, intermediate "
                f"{c.intermediate_size}, {c.num_attention_heads} heads / "
                f"{c.num_key_value_heads} KV heads, vocab {c.vocab_size}"
            )
            targets = "q, k, v, o, gate, up, down projections"
        else:
            shape = (
                f"all-MiniLM-L6-v2 shape when full: {c.num_hidden_layers} layers, hidden "
                f"{c.hidden_size}, {c.num_attention_heads} heads, intermediate "
                f"{c.intermediate_size}, vocab {c.vocab_size}, classification head"
            )
            targets = (
                "query, key, value, attention output dense, intermediate dense, output "
                "dense (the classifier trains too: task_type SEQ_CLS)"
            )
        out += [
            "",
            f"## Train step: {name}",
            "",
            (
                f"Zoo `{type(g['base']).__name__}` ({shape}; {dtype.__name__}), batch {b}x{s}, "
                f"AdamW, `eqx.filter_jit`; LoRA r={RANK}, alpha={ALPHA} on {targets}; "
                f"{by['peftx LoRA'].n_trainable:,} trainable vs "
                f"{by['full fine-tuning'].n_trainable:,}. Zoo layout `stacked` (`lax.scan`) unless "
                "said; the hand-written model is a Python loop of blocks whose linears are a "
                "`LoraLinear` (`x @ W.T + b + s (x @ A.T) @ B.T`, W frozen by `eqx.partition`). "
                "PyTorch: transformers' class with the same config, PEFT's LoraConfig with the "
                "same targets, AdamW, "
                f"{'all CPU threads' if not gpu else 'CUDA bf16'}. GEMM floor: the forward and "
                "activation-gradient GEMMs of every linear layer (adapted and frozen, head "
                "included), token-major, chained, in one jitted function. TFLOP/s counts each "
                "row's own matmul FLOPs (full FT: 3 GEMMs per linear; LoRA: 2 plus the rank-8 "
                "products; attention's products 3 times). The frozen-model row trains only "
                "the normalization weights, so its backward is the activation gradient "
                "through every layer with no adapter: what any adapter's step costs at least. "
                f"Check: {g['check']}."
            ),
            "",
            table,
            "",
            (
                f"- peftx LoRA <= 0.55x full fine-tuning: {lora / full:.2f}x (medians' ratio); "
                f"round by round {statistics.median(pairs):.2f}x median, {min(pairs):.2f}-"
                f"{max(pairs):.2f}x over {len(pairs)} rounds "
                f"{verdict(statistics.median(pairs) <= 0.55)}"
            ),
            (
                f"- peftx LoRA no slower than the hand-written layer: {lora / hand:.2f}x "
                f"{verdict(lora <= hand)}"
            ),
            (
                f"- the frozen model's step (no adapter) is {med[FROZEN] / full:.2f}x full "
                f"fine-tuning; peftx LoRA is {lora / med[FROZEN]:.2f}x that step"
            ),
            (
                f"- peftx LoRA is {lora / med['GEMM floor']:.2f}x the GEMM floor, "
                f"{lora / (med['GEMM floor'] + med['attention fwd + bwd']):.2f}x the GEMM floor "
                "plus attention"
            ),
        ]

    llama_by = {x.name: x for x in llama["variants"] + llama["extra"] if not isinstance(x, str)}
    q, lo = llama_by["peftx QLoRA (NF4 + double quant)"], llama_by["peftx LoRA"]
    out += [
        "",
        "## Training cost: QLoRA against LoRA (Llama)",
        "",
        (
            "`quantize_model` (NF4, double quantization; every Linear but `lm_head`), then "
            "`get_peft_model` with the same LoRA; the same round-robin as the Llama table."
        ),
        "",
        md_table(
            ["step", "median ms", "vs peftx LoRA", "vs full FT"],
            [
                [
                    x.name,
                    ms(x.median),
                    f"{x.median / lo.median:.2f}x",
                    f"{x.median / llama_by['full fine-tuning'].median:.2f}x",
                ]
                for x in (lo, q)
            ],
        ),
    ]

    out += ["", "## Inference (forward pass, logits)", ""]
    rows = []
    for name, vs in inference.items():
        base_t = vs[0].median
        rows += [[f"{name}: {x.name}", ms(x.median), f"{x.median / base_t:.2f}x"] for x in vs]
    out += [md_table(["forward", "median ms", "vs base"], rows), ""]
    for name, vs in inference.items():
        ratio = vs[2].median / vs[0].median
        same = "identical" if same_program(vs[0], vs[2]) else "different"
        out.append(
            f"- {name}: merged inference equals the base (<= 1.05x, the same program): "
            f"{ratio:.2f}x {verdict(ratio <= 1.05)}; compiled programs {same}; "
            f"{inf_checks[name]}"
        )

    out += [
        "",
        "## Compile time",
        "",
        (
            "Each row: `eqx.filter_jit(f).lower(*args)` (trace, through `use_implicit_args` "
            "where said, and lower to HLO) then `.compile()` (XLA), wall seconds; median of "
            f"{sz['compiles']} after `jax.clear_caches()` (the first one is the build's). Ratios "
            "to the full fine-tuning step, or to the base forward."
        ),
        "",
        compiles,
    ]

    out += [
        "",
        "## Memory: trainable state",
        "",
        (
            "Trainable parameters + gradients + AdamW state (mu, nu), bytes of the pytrees; XLA "
            "temp: `compiled.memory_analysis().temp_size_in_bytes` of the step."
        ),
        "",
    ]
    rows = []
    for name, g in groups.items():
        by = {x.name: x for x in g["variants"] + g["extra"] if isinstance(x, Variant)}
        full = by["full fine-tuning"]
        for x in by.values():
            if hasattr(x, "state_bytes"):
                rows.append(
                    [
                        f"{name}: {x.name}",
                        f"{x.n_trainable:,}",
                        mib(x.state_bytes),
                        f"{x.state_bytes / full.state_bytes:.3f}x",
                        mib(x.memory.temp_size_in_bytes),
                    ]
                )
    out.append(
        md_table(
            ["train", "trainable params", "params+grads+AdamW MiB", "vs full FT", "XLA temp MiB"],
            rows,
        )
    )

    out += ["", "## NF4 storage (Llama base)", "", nf4_rows(llama["base"])]
    report = "\n".join(out) + "\n"
    print(report)
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
