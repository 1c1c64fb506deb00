"""One PEFT training step on a GPT-2-style decoder: full fine-tuning, a hand-written
Equinox LoRA layer, and peftx's `LoraArray`, `IA3Array` and QLoRA (`LoraArray` on an
`NF4Array`), measured side by side in one run.

The model is written the idiomatic Equinox way: one sequence at a time, every
`eqx.nn.Linear` applied per token with `jax.vmap`, the batch added by `jax.vmap` over
sequences. LoRA (r=8, alpha=16) goes on q, k, v, o, fc and proj of every block. Each
step is next-token cross-entropy, `optax.adamw`, under `eqx.filter_jit`; the times are
medians over `--steps` steps taken round-robin across the variants (so drifts of the
machine hit every variant alike), warm-up excluded.

The peftx variants:

- `peftx LoRA (batch vmap outside)`: `jax.vmap` over the batch of
  `use_implicit_args(lambda m, t: m(t))(model, tokens)`; the per-token `vmap`s of the
  model run inside `use_implicit_args`, so the handler sees `(tokens, features)` products,
  which the outer batch `vmap` then batches.
- `peftx LoRA (all vmaps inside)`: `use_implicit_args(lambda m, b: jax.vmap(m)(b))`: the
  handler sees the whole `(batch, tokens, features)` product.
- `peftx IA3`: `ia3(weight)` (output scaling) on k and v, `ia3(weight, feedforward=True)`
  (input scaling) on proj, the IA3 paper's placement; only `ia3_l` is trained.
- `peftx QLoRA`: every LoRA target's base weight is `quantize_nf4(weight,
  double_quant=True)` (frozen), with the same r=8 factors on top; only `lora_A`/`lora_B`
  are trained.

IA3 and QLoRA run with all vmaps inside `use_implicit_args`, like the second LoRA row.

- `get_peft_model LoRA`: the same LoRA placed by `peftx.get_peft_model` (weights become
  `AdapterSet`s holding one adapter), all vmaps inside.
- `get_peft_model, 2 adapters, mixed batch`: two LoRA adapters on the same layers, each
  sequence of the batch routed to one of them (`adapter_names` as ids, under the batch
  `vmap`); both adapters train in the same step.

- `bf16 base: ...`: the same model with every weight in bfloat16: full fine-tuning, and
  LoRA with float32 factors (PEFT's default), its adapter branch in float32 or, with
  `with_compute_dtype`, in bfloat16; their ratio is to the bfloat16 full fine-tuning.
- `jvp: ...`: forward mode, the loss and its derivative along one random direction of the
  trainable parameters (every weight for the dense model, the factors for LoRA), as
  forward-gradient methods and Hessian-vector products use it; the ratio is to the dense
  model's.

Before timing: the peftx LoRA loss and gradients are checked against the hand-written
layer on the same weights; the mixed-batch loss against each adapter alone on its own
sequences; the QLoRA loss and gradients against a dense-base LoRA on the
dequantized weights; the IA3 loss (ones-initialized, so the base model's) and `ia3_l`
gradients against full fine-tuning's loss and weight gradients. Every step is first
traced under `peftx.implicit.strict()`, so no weight is ever materialized.

Run: `python benchmarks/lora_step.py [--layers 6] [--steps 7] [--quick] [--hlo]`
(about 3 minutes on 2 CPU cores; `--quick` takes 3 steps after 1 warm-up). `--hlo` also
prints, for each variant, how much the optimized HLO copies and transposes activations:
on CPU, autodiff's factor gradients contract the output cotangent over the tokens with
the cotangent on the left, and XLA serves that with a transposed copy into which it fuses
(and so recomputes, layer after layer) the elementwise ops producing the cotangent. The
LoRA handler's explicit backward avoids it; full fine-tuning cannot (its `dW` needs it).
"""

import argparse
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import peftx
from peftx.implicit import strict, use_implicit_args

D_MODEL, HEADS, VOCAB, SEQ, BATCH = 512, 8, 1024, 128, 8
RANK, ALPHA = 8, 16
BF16_FULL = "bf16 base: full fine-tuning"
JVP_FULL = "jvp: full model, along every weight"
TARGETS = ("q", "k", "v", "o", "fc", "proj")
IA3_TARGETS = {"k": False, "v": False, "proj": True}  # name: feedforward (scale inputs)


# --------------------------------------------------------------------------------------
# The model


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko, kf, kp = jax.random.split(key, 6)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.q = eqx.nn.Linear(d, d, key=kq)
        self.k = eqx.nn.Linear(d, d, key=kk)
        self.v = eqx.nn.Linear(d, d, key=kv)
        self.o = eqx.nn.Linear(d, d, key=ko)
        self.fc = eqx.nn.Linear(d, 4 * d, key=kf)
        self.proj = eqx.nn.Linear(4 * d, d, key=kp)
        self.heads = heads

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        seq, d = x.shape
        h = jax.vmap(self.ln1)(x)
        split = lambda y: y.reshape(seq, self.heads, d // self.heads)  # noqa: E731
        q, k, v = (split(jax.vmap(lin)(h)) for lin in (self.q, self.k, self.v))
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        att = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), v).reshape(seq, d)
        x = x + jax.vmap(self.o)(att)
        h = jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(x)))
        return x + jax.vmap(self.proj)(h)


class GPT(eqx.Module):
    tok: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, layers: int, *, key: PRNGKeyArray):
        kt, kp, kh, *kb = jax.random.split(key, 3 + layers)
        self.tok = eqx.nn.Embedding(VOCAB, D_MODEL, key=kt)
        self.pos = eqx.nn.Embedding(SEQ, D_MODEL, key=kp)
        self.blocks = [Block(D_MODEL, HEADS, key=k) for k in kb]
        self.ln_f = eqx.nn.LayerNorm(D_MODEL)
        self.head = eqx.nn.Linear(D_MODEL, VOCAB, use_bias=False, key=kh)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.tok)(tokens) + jax.vmap(self.pos)(jnp.arange(tokens.shape[0]))
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def next_token_loss(logits: Float[Array, "batch seq vocab"], batch: Int[Array, "batch seq"]):
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def cast(model: GPT, dtype: Any) -> GPT:
    """`model` with every floating-point weight in `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


# --------------------------------------------------------------------------------------
# Adapters


class LoraLinear(eqx.Module):
    """The hand-written LoRA layer: `W @ x + b + s · B @ (A @ x)` for one vector `x`."""

    weight: Array
    bias: Array
    lora_A: Array
    lora_B: Array
    scaling: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return self.weight @ x + self.bias + self.scaling * (self.lora_B @ (self.lora_A @ x))


def _targets(model: GPT, names: Any = TARGETS) -> list[eqx.nn.Linear]:
    return [getattr(b, name) for b in model.blocks for name in names]


def with_peftx_lora(model: GPT, *, key: PRNGKeyArray) -> GPT:
    """Every target weight replaced by a `peftx.adapters.lora` array (random factors,
    so the adapter path is not all zeros and the gradient check means something)."""
    layers = _targets(model)
    keys = jax.random.split(key, len(layers))
    adapted = [
        peftx.adapters.lora(lin.weight, r=RANK, lora_alpha=ALPHA, init="random", key=k)
        for lin, k in zip(layers, keys)
    ]
    return eqx.tree_at(lambda m: [lin.weight for lin in _targets(m)], model, adapted)


def with_hand_lora(peftx_model: GPT) -> GPT:
    """The hand-written layer on exactly the weights and factors of `peftx_model`."""
    layers = [
        LoraLinear(lin.weight.weight, lin.bias, lin.weight.lora_A, lin.weight.lora_B,
                   lin.weight.scaling)
        for lin in _targets(peftx_model)
    ]  # fmt: skip
    return eqx.tree_at(_targets, peftx_model, layers)


def with_peftx_ia3(model: GPT) -> GPT:
    """`ia3` on k and v (outputs scaled) and proj (inputs scaled); `ia3_l` starts at ones."""
    adapted = [
        peftx.adapters.ia3(getattr(b, name).weight, feedforward=feedforward)
        for b in model.blocks
        for name, feedforward in IA3_TARGETS.items()
    ]
    return eqx.tree_at(lambda m: [lin.weight for lin in _targets(m, IA3_TARGETS)], model, adapted)


@eqx.filter_jit
def quantize(weight: Array) -> peftx.adapters.NF4Array:
    return peftx.adapters.quantize_nf4(weight, double_quant=True)


def with_nf4_base(lora: GPT) -> GPT:
    """QLoRA: the base weight inside every `LoraArray` of `lora` quantized to NF4 with
    double quantization; the factors are kept, so it differs from `lora` by the rounding
    of the base weights only."""
    return eqx.tree_at(
        lambda m: [lin.weight.weight for lin in _targets(m)],
        lora,
        [quantize(lin.weight.weight) for lin in _targets(lora)],
    )


def dequantized(qlora: GPT) -> GPT:
    """`qlora` with each NF4 base weight replaced by its dense dequantized value."""
    return eqx.tree_at(
        lambda m: [lin.weight.weight for lin in _targets(m)],
        qlora,
        [lin.weight.weight.materialize() for lin in _targets(qlora)],
    )


def leaf_filter(model: GPT, names: tuple[str, ...]) -> Any:
    """Trainable = the array leaves whose field name is in `names`, for `eqx.partition`."""

    def is_trainable(path: tuple[Any, ...], leaf: Any) -> bool:
        return eqx.is_array(leaf) and getattr(path[-1], "name", None) in names

    return jax.tree_util.tree_map_with_path(is_trainable, model)


def lora_filter(model: GPT) -> Any:
    """Trainable = the `lora_A`/`lora_B` leaves."""
    return leaf_filter(model, ("lora_A", "lora_B"))


def ia3_filter(model: GPT) -> Any:
    """Trainable = the `ia3_l` leaves."""
    return leaf_filter(model, ("ia3_l",))


# --------------------------------------------------------------------------------------
# Losses and steps


def dense_loss(model: GPT, batch: Int[Array, "batch seq"]) -> Array:
    return next_token_loss(jax.vmap(model)(batch), batch)


def peftx_loss_batch_outside(model: GPT, batch: Int[Array, "batch seq"]) -> Array:
    logits = jax.vmap(lambda t: use_implicit_args(lambda m, t: m(t))(model, t))(batch)
    return next_token_loss(logits, batch)


def peftx_loss_all_inside(model: GPT, batch: Int[Array, "batch seq"]) -> Array:
    logits = use_implicit_args(lambda m, b: jax.vmap(m)(b))(model, batch)
    return next_token_loss(logits, batch)


def peft_model_loss(model: peftx.PeftModel, batch: Int[Array, "batch seq"]) -> Array:
    logits = use_implicit_args(lambda m, b: jax.vmap(m)(b))(model.prepared(), batch)
    return next_token_loss(logits, batch)


def mixed_loss(ids: Int[Array, " batch"]) -> Callable[[peftx.PeftModel, Array], Array]:
    """Each sequence of the batch through its own adapter (`ids` from `adapter_ids`)."""

    def loss(model: peftx.PeftModel, batch: Int[Array, "batch seq"]) -> Array:
        def one(tokens: Array, i: Array) -> Array:
            return use_implicit_args(lambda m, t: m(t))(model.prepared(i), tokens)

        return next_token_loss(jax.vmap(one)(batch, ids), batch)

    return loss


def check_mixed(two: peftx.PeftModel, ids: Array, batch: Array, tol: float = 1e-5) -> str:
    """The mixed-batch loss against each adapter alone on its own sequences."""
    with strict():
        got = eqx.filter_jit(mixed_loss(ids))(two, batch)
        halves = [
            eqx.filter_jit(peft_model_loss)(two.set_adapter(name), batch[ids == i])
            for i, name in enumerate(two.adapter_names)
        ]
    want = sum(halves) / len(halves)
    if abs(float(got) - float(want)) > tol:
        raise SystemExit(f"mixed batch: loss {float(got)} differs from {float(want)}")
    return f"mixed batch vs each adapter alone: loss {float(got):.6f} vs {float(want):.6f}"


def make_step(loss: Callable[[GPT, Array], Array], optim: optax.GradientTransformation):
    def loss_fn(trainable: GPT, frozen: GPT, batch: Array) -> Array:
        return loss(eqx.combine(trainable, frozen), batch)

    @eqx.filter_jit
    def step(trainable: GPT, frozen: GPT, opt_state: Any, batch: Array):
        value, grads = eqx.filter_value_and_grad(loss_fn)(trainable, frozen, batch)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value

    return step, loss_fn


class Variant:
    def __init__(
        self, name: str, model: GPT, spec: Any, loss: Callable, optim: Any, baseline: str = ""
    ):
        self.name = name
        self.baseline = baseline or "full fine-tuning"
        self.trainable, self.frozen = eqx.partition(model, spec)
        self.opt_state = optim.init(self.trainable)
        self.step, self.loss_fn = make_step(loss, optim)
        self.times: list[float] = []

    def run(self, batch: Array) -> float:
        t0 = time.perf_counter()
        self.trainable, self.opt_state, value = self.step(
            self.trainable, self.frozen, self.opt_state, batch
        )
        jax.block_until_ready((self.trainable, self.opt_state, value))
        return time.perf_counter() - t0

    def hlo(self, batch: Array) -> str:
        lowered = self.step.lower(self.trainable, self.frozen, self.opt_state, batch)
        return lowered.compile().compiled.as_text()  # equinox's wrapper, then JAX's


class JvpVariant(Variant):
    """Forward mode instead of a train step: the loss and its derivative along one random
    direction of the trainable parameters (`jax.jvp`), as forward-gradient methods and
    Hessian-vector products use it."""

    def __init__(self, name: str, model: GPT, spec: Any, loss: Callable, baseline: str = ""):
        super().__init__(name, model, spec, loss, optax.identity(), baseline)
        leaves, tree = jax.tree.flatten(self.trainable)
        keys = jax.random.split(jax.random.key(3), len(leaves))
        tangent = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
        self.tangent = jax.tree.unflatten(tree, tangent)

        @eqx.filter_jit
        def step(trainable: GPT, frozen: GPT, tangent: GPT, batch: Array):
            return jax.jvp(lambda t: loss(eqx.combine(t, frozen), batch), (trainable,), (tangent,))

        self.step = step

    def run(self, batch: Array) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(self.trainable, self.frozen, self.tangent, batch))
        return time.perf_counter() - t0

    def hlo(self, batch: Array) -> str:
        lowered = self.step.lower(self.trainable, self.frozen, self.tangent, batch)
        return lowered.compile().compiled.as_text()


# --------------------------------------------------------------------------------------
# Checks and reports


def _value_and_grad(loss: Callable[[GPT, Array], Array]) -> Callable:
    """`(trainable, frozen, batch) -> (loss, gradient)`, jitted."""
    return eqx.filter_jit(jax.value_and_grad(lambda t, f, b: loss(eqx.combine(t, f), b)))


def _compare(name: str, got: tuple, want: tuple, tol: float) -> float:
    """Raises unless the losses agree to `tol` and every gradient leaf to `tol` times its
    largest entry; returns the worst gradient difference relative to that entry."""
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    if len(got_grads) != len(want_grads):
        raise SystemExit(f"{name}: {len(got_grads)} gradient leaves, expected {len(want_grads)}")
    if abs(float(got_loss) - float(want_loss)) > tol:
        raise SystemExit(f"{name}: loss {float(got_loss)} differs from {float(want_loss)}")
    worst = 0.0
    for a, b in zip(got_grads, want_grads):
        scale = float(jnp.max(jnp.abs(b)))
        err = float(jnp.max(jnp.abs(a - b)))
        worst = max(worst, err / scale)
        if err > tol * max(scale, 1.0):
            raise SystemExit(f"{name}: gradient differs by {err:.2e} (max {scale})")
    return worst


def check_against_hand_written(hand: GPT, lora: GPT, batch: Array, tol: float = 1e-5) -> str:
    th, fh = eqx.partition(hand, lora_filter(hand))
    tp, fp = eqx.partition(lora, lora_filter(lora))
    want = jax.jit(jax.value_and_grad(lambda t, f: dense_loss(eqx.combine(t, f), batch)))(th, fh)
    want = want[0], jax.tree.leaves(want[1])
    if len(want[1]) != 2 * len(TARGETS) * len(hand.blocks):
        raise SystemExit(f"{len(want[1])} LoRA gradient leaves")
    worst = 0.0
    for loss in (peftx_loss_batch_outside, peftx_loss_all_inside):
        with strict():
            got = _value_and_grad(loss)(tp, fp, batch)
        worst = max(worst, _compare(loss.__name__, (got[0], jax.tree.leaves(got[1])), want, tol))
    return f"loss {float(want[0]):.6f}; max gradient difference / max gradient {worst:.1e}"


def check_qlora(qlora: GPT, batch: Array, tol: float = 1e-4) -> str:
    """QLoRA against a LoRA whose dense base weights are the dequantized NF4 weights."""
    value_and_grad = _value_and_grad(peftx_loss_all_inside)
    dense = dequantized(qlora)
    with strict():
        got = value_and_grad(*eqx.partition(qlora, lora_filter(qlora)), batch)
        want = value_and_grad(*eqx.partition(dense, lora_filter(dense)), batch)
    leaves = lambda r: (r[0], jax.tree.leaves(r[1]))  # noqa: E731
    worst = _compare("QLoRA", leaves(got), leaves(want), tol)
    return (
        f"QLoRA vs LoRA on the dequantized weights: loss {float(got[0]):.6f} vs "
        f"{float(want[0]):.6f}; max gradient difference / max gradient {worst:.1e}"
    )


def check_ia3(base: GPT, ia3: GPT, batch: Array, tol: float = 1e-4) -> str:
    """IA3 at `ia3_l = 1` against full fine-tuning: the same loss, and the gradient of
    each scale is the weight-gradient of the base weight contracted with the weight,
    `dL/dl = sum(W * dL/dW)` over the axis that `l` does not index."""
    full_loss, full_grads = eqx.filter_jit(eqx.filter_value_and_grad(dense_loss))(base, batch)
    with strict():
        got = _value_and_grad(peftx_loss_all_inside)(*eqx.partition(ia3, ia3_filter(ia3)), batch)
    want = [
        jnp.sum(w.weight * g.weight, axis=0 if feedforward else 1, keepdims=True)
        for w, g, feedforward in zip(
            _targets(base, IA3_TARGETS),
            _targets(full_grads, IA3_TARGETS),
            list(IA3_TARGETS.values()) * len(base.blocks),
        )
    ]
    got_l = [lin.weight.ia3_l for lin in _targets(got[1], IA3_TARGETS)]
    worst = _compare("IA3", (got[0], got_l), (full_loss, want), tol)
    return (
        f"IA3 vs full fine-tuning: loss {float(got[0]):.6f} vs {float(full_loss):.6f}; "
        f"max ia3_l gradient difference / max gradient {worst:.1e}"
    )


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$")


def _elements(shape: str) -> int:
    return sum(
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\[([\d,]*)\]", shape)
    )


def hlo_summary(text: str) -> str:
    """Where the optimized HLO moves activations around: the entry-level operations
    (fusions, copies, transposes) that transpose or copy an activation-sized array, the
    bytes they read, and the largest fan-in of an activation-sized fusion (a long chain of
    elementwise ops that XLA fused, and so recomputes, instead of storing)."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            m = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line)
            current = m.group(1) if m else None
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    entry = text[text.index("ENTRY") :].splitlines()
    shapes = {m.group(1): m.group(2) for line in entry if (m := _INSTR.match(line))}
    act = BATCH * SEQ * D_MODEL
    moves = n_moves = fan_in = 0
    for line in entry:
        m = _INSTR.match(line)
        if not m or _elements(m.group(2)) < act:
            continue
        name, _, op, rest = m.groups()
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        if op == "fusion":
            body = bodies.get(re.search(r"calls=%([\w.\-]+)", rest).group(1), [])
            moving = any(
                (i := _INSTR.match(b)) and i.group(3) in ("copy", "transpose")
                and _elements(i.group(2)) >= act
                for b in body
            )  # fmt: skip
            if "__ynn_fusion" not in rest:
                fan_in = max(fan_in, len(operands))
        else:
            moving = op in ("copy", "transpose")
        if moving:
            n_moves += 1
            moves += sum(_elements(shapes.get(o, "")) for o in operands)
    return (
        f"{n_moves} activation-sized copy/transpose ops reading {4 * moves / 2**20:.0f} MiB; "
        f"largest fusion fan-in {fan_in}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 steps after 1 warm-up")
    parser.add_argument("--hlo", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 1

    model_key, lora_key, data_key = jax.random.split(jax.random.key(0), 3)
    base = GPT(args.layers, key=model_key)
    lora = with_peftx_lora(base, key=lora_key)
    hand = with_hand_lora(lora)
    ia3 = with_peftx_ia3(base)
    qlora = with_nf4_base(lora)
    batch = jax.random.randint(data_key, (BATCH, SEQ), 0, VOCAB)

    print(check_against_hand_written(hand, lora, batch))
    print(check_qlora(qlora, batch))
    print(check_ia3(base, ia3, batch))
    config = peftx.LoraConfig(
        target_modules=list(TARGETS), r=RANK, lora_alpha=ALPHA, init_lora_weights=False
    )
    one = peftx.get_peft_model(base, config, key=lora_key)
    two = one.add_adapter("b", config, key=data_key)
    ids = jnp.arange(BATCH) % 2
    print(check_mixed(two, ids, batch))
    base16 = cast(base, jnp.bfloat16)
    lora16 = with_peftx_lora(base16, key=lora_key)  # factors stay float32, as in PEFT
    lora16c = peftx.adapters.with_compute_dtype(lora16, jnp.bfloat16)

    optim = optax.adamw(1e-4)
    variants = [
        Variant("full fine-tuning", base, eqx.is_inexact_array, dense_loss, optim),
        Variant("hand-written LoraLinear", hand, lora_filter(hand), dense_loss, optim),
        Variant("peftx LoRA (batch vmap outside)", lora, lora_filter(lora),
                peftx_loss_batch_outside, optim),
        Variant("peftx LoRA (all vmaps inside)", lora, lora_filter(lora),
                peftx_loss_all_inside, optim),
        Variant("peftx IA3 (k, v, proj)", ia3, ia3_filter(ia3), peftx_loss_all_inside, optim),
        Variant("peftx QLoRA (NF4 + double quant)", qlora, lora_filter(qlora),
                peftx_loss_all_inside, optim),
        Variant("get_peft_model LoRA (all vmaps inside)", one, one.trainable_spec(),
                peft_model_loss, optim),
        Variant("get_peft_model, 2 adapters, mixed batch (batch vmap outside)", two,
                two.trainable_spec(two.adapter_names), mixed_loss(ids), optim),
        Variant(BF16_FULL, base16, eqx.is_inexact_array, dense_loss, optim, BF16_FULL),
        Variant("bf16 base: peftx LoRA, fp32 factors (PEFT's default)", lora16,
                lora_filter(lora16), peftx_loss_all_inside, optim, BF16_FULL),
        Variant("bf16 base: peftx LoRA, fp32 factors, bf16 adapter compute", lora16c,
                lora_filter(lora16c), peftx_loss_all_inside, optim, BF16_FULL),
        JvpVariant(JVP_FULL, base, eqx.is_inexact_array, dense_loss, JVP_FULL),
        JvpVariant("jvp: peftx LoRA, along the factors", lora, lora_filter(lora),
                   peftx_loss_all_inside, JVP_FULL),
    ]  # fmt: skip

    compile_s = {}
    for v in variants:
        t0 = time.perf_counter()
        with strict():  # the first call traces: any materialization raises here
            v.run(batch)
        compile_s[v.name] = time.perf_counter() - t0
    for _ in range(args.warmup):
        for v in variants:
            v.run(batch)
    for _ in range(args.steps):
        for v in variants:
            v.times.append(v.run(batch))

    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(base, eqx.is_array)))
    n_lora, n_ia3 = (
        sum(x.size for x in jax.tree.leaves(v.trainable)) for v in (variants[2], variants[4])
    )
    print(
        f"\nGPT-2-style decoder: {args.layers} layers, d_model {D_MODEL}, {HEADS} heads, MLP 4x, "
        f"vocab {VOCAB}, batch {BATCH}x{SEQ}; {n_params / 1e6:.1f}M params, LoRA r={RANK} on "
        f"{','.join(TARGETS)} ({n_lora / 1e3:.0f}K trainable), IA3 on "
        f"{','.join(IA3_TARGETS)} ({n_ia3 / 1e3:.0f}K trainable), QLoRA = the LoRA on NF4 "
        f"double-quantized base weights. jax {jax.__version__}, "
        f"{jax.devices()[0].platform}; median of {args.steps} steps after {args.warmup} warm-up, "
        "round-robin.\n"
    )
    print("| step | median (ms) | min (ms) | vs its baseline | baseline | first call (s) |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    medians = {v.name: statistics.median(v.times) for v in variants}
    for v in variants:
        med = medians[v.name]
        print(
            f"| {v.name} | {1e3 * med:.0f} | {1e3 * min(v.times):.0f} | "
            f"{med / medians[v.baseline]:.2f}x | {v.baseline} | {compile_s[v.name]:.1f} |"
        )

    if args.hlo:
        print("\nOptimized HLO, per step:")
        for v in variants:
            print(f"- {v.name}: {hlo_summary(v.hlo(batch))}")


if __name__ == "__main__":
    main()
