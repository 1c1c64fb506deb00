"""GPT-2 against transformers in PyTorch.

Every model is a tiny random transformers GPT-2 (eager attention, eval mode, fp32) whose
layer norms and biases are randomized too, saved with `save_pretrained` and loaded with
`peftx.models.from_pretrained`, so both sides run the same weights. transformers stores
GPT-2's projections as `Conv1D` weights `(in, out)`; peftx's are `Linear` `(out, in)`, so
every comparison here also checks the transposition on the way in (and, for the round
trip, on the way out).
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import peftx
import peftx.models as pm
from peftx.implicit import strict
from peftx.models import GPT2Config, KVCache

VOCAB = 61
SEQ = 10
LAYERS = 3
TOL = 1e-4  # fp32 parity on real tokens
COMMON = dict(
    vocab_size=VOCAB,
    n_positions=32,
    n_embd=32,
    n_layer=LAYERS,
    n_head=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
    initializer_range=0.2,  # attention far from uniform, logits of order one
    attn_implementation="eager",
)

# name: config overrides, and ("plain") the overrides that switch the arm's feature off
# on the same weights, so a test can check that the arm tests something of its own
CASES = {
    "gpt2": dict(config={}),
    "untied-inner-gelu": dict(
        config=dict(tie_word_embeddings=False, n_inner=48, activation_function="gelu")
    ),
    "inverse-layer-scale": dict(
        config=dict(scale_attn_by_inverse_layer_idx=True, layer_norm_epsilon=1e-3),
        plain=dict(scale_attn_by_inverse_layer_idx=False),
    ),
    "unscaled-upcast-relu": dict(
        config=dict(
            scale_attn_weights=False, reorder_and_upcast_attn=True, activation_function="relu"
        ),
        plain=dict(scale_attn_weights=True),
    ),
}


def hf_config(name: str, **overrides) -> transformers.GPT2Config:
    return transformers.GPT2Config(
        **{**COMMON, **CASES[name]["config"], "num_labels": 3, **overrides}
    )


def torch_model(name: str, head: str = "LMHeadModel", **overrides) -> torch.nn.Module:
    """A random model whose layer norms and biases are random too (transformers starts
    them at one and zero, which would hide a missing scale or bias)."""
    torch.manual_seed(sorted(CASES).index(name))
    model = getattr(transformers, "GPT2" + head)(hf_config(name, **overrides)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".ln_" in key and key.endswith(".weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
            elif key.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(name, head)`: `(torch model, its save_pretrained directory)`, built once
    per module."""
    built = {}

    def get(name: str, head: str = "LMHeadModel"):
        if (name, head) not in built:
            model = torch_model(name, head)
            path = tmp_path_factory.mktemp(f"{name}-{head}")
            model.save_pretrained(path)
            built[name, head] = model, path
        return built[name, head]

    return get


def padded_batch(seed: int, lengths, sides, seq: int = SEQ):
    """Token ids (0 is padding, real tokens are never 0) and the attention mask."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), seq), np.int32)
    mask = np.zeros((len(lengths), seq), np.int32)
    for row, (n, side) in enumerate(zip(lengths, sides)):
        part = slice(seq - n, seq) if side == "left" else slice(0, n)
        ids[row, part] = rng.integers(1, VOCAB, n)
        mask[row, part] = 1
    return ids, mask


BATCHES = {
    "left": padded_batch(0, [SEQ, 8, 5, 2], ["left"] * 4),
    "right": padded_batch(1, [SEQ, 6, 4, 1], ["right"] * 4),
    # both sides in one batch: a full row, left- and right-padded rows
    "mixed": padded_batch(2, [SEQ, 7, 5, 2], ["right", "left", "right", "left"]),
}


def torch_forward(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, **kwargs):
    """transformers' outputs, and each block's output (by forward hooks, so every layer
    is compared as it leaves its block). Positions count the real tokens (the mask's
    cumsum minus one, as `generate` makes them), which peftx derives by itself."""
    backbone = getattr(model, "transformer", model)
    blocks = []
    hooks = [b.register_forward_hook(lambda m, i, o: blocks.append(o)) for b in backbone.h]
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    try:
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long),
                **kwargs,
            )
    finally:
        for hook in hooks:
            hook.remove()
    blocks = [b[0] if isinstance(b, tuple) else b for b in blocks]
    return out, blocks


@eqx.filter_jit
def run(model, ids, mask=None, **kwargs):
    """`model(ids, mask, output_hidden_states=True, **kwargs)`, compiled once per model
    structure and input shape (an eager call of a stacked model compiles its scan every
    time), and shared between the tests: every batch is `(4, SEQ)`."""
    return model(ids, mask, output_hidden_states=True, **kwargs)


def real_diff(ours, theirs, mask: np.ndarray) -> float:
    """Max |ours - theirs| over the real tokens of `(batch, seq, ...)` arrays."""
    ours = np.asarray(jnp.asarray(ours, jnp.float32))
    theirs = theirs.detach().float().numpy() if isinstance(theirs, torch.Tensor) else theirs
    keep = mask.astype(bool)
    return float(np.max(np.abs(ours[keep] - theirs[keep])))


def assert_layers_match(ours_hidden, ref_blocks, mask, tol=TOL):
    """Each block's output against transformers' block output, first failure named."""
    assert ours_hidden.shape == (LAYERS, *mask.shape, COMMON["n_embd"])
    assert len(ref_blocks) == LAYERS
    for i in range(LAYERS):
        diff = real_diff(ours_hidden[i], ref_blocks[i], mask)
        assert diff <= tol, f"block {i} of {LAYERS} differs first: max |diff| {diff:.3g}"


# -- parity ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, layout",
    [
        ("gpt2", "stacked"),
        ("gpt2", "unrolled"),
        ("inverse-layer-scale", "stacked"),  # per-layer scales: sliced by the scan
        ("inverse-layer-scale", "unrolled"),  # ... and indexed layer by layer
        ("untied-inner-gelu", "unrolled"),
        ("unscaled-upcast-relu", "stacked"),
    ],
)
def test_lm_head_model_matches_transformers(checkpoint, name, layout):
    model, path = checkpoint(name)
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.GPT2LMHeadModel
    assert (ours.lm_head is None) == model.config.tie_word_embeddings
    assert isinstance(ours.transformer.h, pm.LayerStack) == (layout == "stacked")
    ids, mask = BATCHES["mixed"]
    ref, blocks = torch_forward(model, ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert_layers_match(out.hidden_states, blocks, mask)
    assert out.logits.shape == (*ids.shape, VOCAB)
    assert real_diff(out.logits, ref.logits, mask) <= TOL


@pytest.mark.parametrize("layout, side", [("stacked", "left"), ("unrolled", "right")])
def test_backbone_matches_transformers(checkpoint, layout, side):
    model, path = checkpoint("inverse-layer-scale", "Model")
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.GPT2Model
    ids, mask = BATCHES[side]
    ref, blocks = torch_forward(model, ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert_layers_match(out.hidden_states, blocks, mask)
    assert real_diff(out.last_hidden_state, ref.last_hidden_state, mask) <= TOL


def test_backbone_reads_a_head_models_checkpoint(checkpoint):
    """The backbone of a `GPT2LMHeadModel` checkpoint (keys under `transformer.`)."""
    model, path = checkpoint("untied-inner-gelu")
    ours = pm.from_pretrained(path, model_class="GPT2Model")
    ids, mask = BATCHES["left"]
    ref, _ = torch_forward(model.transformer, ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert real_diff(out.last_hidden_state, ref.last_hidden_state, mask) <= TOL


@pytest.mark.parametrize("layout, side", [("stacked", "right"), ("unrolled", "left")])
def test_sequence_classification_matches_transformers(checkpoint, layout, side):
    model, path = checkpoint("gpt2", "ForSequenceClassification")
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.GPT2ForSequenceClassification
    assert ours.config.pad_token_id == 0 and ours.config.num_labels == 3
    ids, mask = BATCHES[side]
    ref, blocks = torch_forward(model, ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert_layers_match(out.hidden_states, blocks, mask)
    assert out.logits.shape == ref.logits.shape == (len(ids), 3)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=0, atol=TOL)


def test_classifier_on_a_language_model_checkpoint_starts_fresh(checkpoint):
    """`score` is not in an LM checkpoint: initialized fresh with a warning naming it, the
    backbone loaded (and the LM head's tensor, if any, ignored)."""
    model, path = checkpoint("untied-inner-gelu")
    with pytest.warns(UserWarning, match=r"score\.weight"):
        ours = pm.from_pretrained(path, model_class=pm.GPT2ForSequenceClassification)
    assert ours.score.weight.shape == (3, COMMON["n_embd"])
    ids, mask = BATCHES["right"]
    _, blocks = torch_forward(model, ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert_layers_match(out.hidden_states, blocks, mask)


ARMS = [n for n in sorted(CASES) if "plain" in CASES[n]]


@pytest.mark.parametrize("name", ARMS)
def test_each_arm_changes_the_output(checkpoint, name):
    """The arm's feature, switched off on the same weights, changes the logits by far more
    than the parity tolerance."""
    model, _ = checkpoint(name)
    plain = copy.deepcopy(torch_model(name, **CASES[name]["plain"]))
    plain.load_state_dict(model.state_dict())
    ids, mask = BATCHES["left"]
    ours = torch_forward(model, ids, mask)[0].logits
    theirs = torch_forward(plain, ids, mask)[0].logits
    assert real_diff(ours.numpy(), theirs, mask) > 1000 * TOL


# -- padding and the cache ---------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance(checkpoint, side):
    """Each sequence's logits on its real tokens are the same alone as in a padded batch."""
    _, path = checkpoint("gpt2")
    ours = pm.from_pretrained(path)
    lengths = [SEQ, 6, 3, 1]
    ids, mask = padded_batch(5, lengths, [side] * len(lengths))
    batch = run(ours, jnp.asarray(ids), jnp.asarray(mask)).logits
    for row in range(len(lengths)):
        real = mask[row].astype(bool)
        alone = run(ours, jnp.asarray(ids[row, real][None])).logits[0]
        np.testing.assert_allclose(
            np.asarray(batch[row][real]), np.asarray(alone), rtol=0, atol=TOL
        )


@pytest.mark.parametrize(
    "name, layout",
    [
        ("gpt2", "stacked"),
        # the fast tier checks the per-layer scales in test_lm_head_model_matches_transformers
        # and decodes GPT-2 from a cache on its stack (an unrolled model in test_llama)
        pytest.param("inverse-layer-scale", "unrolled", marks=pytest.mark.variant_sweep),
    ],
)
def test_kv_cache_steps_match_full_forward(checkpoint, name, layout):
    """A left-padded prompt prefilled into the cache, then one token at a time (positions
    continuing from the cache's real tokens), gives the full forward's logits at every
    step."""
    _, path = checkpoint(name)
    ours = pm.from_pretrained(path, layout=layout)
    c = ours.config
    prompt = 4
    ids, mask = padded_batch(3, [SEQ, SEQ - 2, SEQ - 5, SEQ - 7], ["left"] * 4)
    full = run(ours, jnp.asarray(ids), jnp.asarray(mask)).logits
    cache = KVCache.empty(
        c.num_hidden_layers, len(ids), SEQ, c.num_key_value_heads, c.head_dim, jnp.float32
    )
    out = run(ours, jnp.asarray(ids[:, :prompt]), jnp.asarray(mask[:, :prompt]), cache=cache)
    assert int(out.cache.index) == prompt
    steps = [out.logits]
    for t in range(prompt, SEQ):
        out = run(
            ours, jnp.asarray(ids[:, t : t + 1]), jnp.asarray(mask[:, t : t + 1]), cache=out.cache
        )
        steps.append(out.logits)
    assert int(out.cache.index) == SEQ
    np.testing.assert_array_equal(np.asarray(out.cache.valid), mask.astype(bool))
    cached = jnp.concatenate(steps, axis=1)
    assert real_diff(cached, np.asarray(full), mask) <= TOL


def test_kv_cache_matches_transformers_generation_step(checkpoint):
    """One cached step without a mask or positions against transformers' own cache."""
    model, path = checkpoint("untied-inner-gelu")
    ours = pm.from_pretrained(path)
    c = ours.config
    ids, _ = padded_batch(4, [SEQ, SEQ], ["left", "left"])
    cache = KVCache.empty(c.num_hidden_layers, 2, SEQ, c.n_head, c.head_dim, jnp.float32)
    out = run(ours, jnp.asarray(ids[:, :-1]), cache=cache)
    out = run(ours, jnp.asarray(ids[:, -1:]), cache=out.cache)
    with torch.no_grad():
        prefill = model(torch.tensor(ids[:, :-1], dtype=torch.long), use_cache=True)
        ref = model(
            torch.tensor(ids[:, -1:], dtype=torch.long), past_key_values=prefill.past_key_values
        )
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=0, atol=TOL)


# -- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("name, layout", [("gpt2", "stacked"), ("untied-inner-gelu", "unrolled")])
def test_save_pretrained_round_trips_through_transformers(checkpoint, tmp_path, name, layout):
    """peftx's checkpoint, read by transformers, holds the very tensors it was loaded from
    (Conv1D weights transposed back) and gives the same logits."""
    model, path = checkpoint(name)
    ours = pm.from_pretrained(path, layout=layout)
    peftx.save_pretrained(ours, tmp_path)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    back = back.eval()
    original, reread = model.state_dict(), back.state_dict()
    assert set(original) == set(reread)
    for key, value in original.items():
        assert torch.equal(value, reread[key]), key
    ids, mask = BATCHES["left"]
    np.testing.assert_array_equal(
        torch_forward(back, ids, mask)[0].logits.numpy(),
        torch_forward(model, ids, mask)[0].logits.numpy(),
    )


def test_reads_original_gpt2_layout(checkpoint, tmp_path):
    """The layout of OpenAI's released checkpoints: no `transformer.` prefix, and the
    causal-mask buffers `attn.bias` / `attn.masked_bias` stored next to the weights."""
    model, path = checkpoint("gpt2")
    tensors = load_file(path / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(LAYERS):
        old[f"h.{i}.attn.bias"] = np.tril(np.ones((32, 32), np.float32))[None, None]
        old[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = pm.from_pretrained(tmp_path)
    assert type(ours) is pm.GPT2LMHeadModel
    ids, mask = BATCHES["right"]
    ref, _ = torch_forward(model, ids, mask)
    assert real_diff(run(ours, jnp.asarray(ids), jnp.asarray(mask)).logits, ref.logits, mask) <= TOL


def test_untransposed_conv1d_weight_is_rejected(checkpoint, tmp_path):
    """A projection stored `(out, in)` (not as Conv1D stores it) fails with the shape
    transformers' layout expects."""
    _, path = checkpoint("gpt2")
    tensors = load_file(path / "model.safetensors")
    key = "transformer.h.1.attn.c_attn.weight"
    tensors[key] = np.ascontiguousarray(tensors[key].T)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(peftx.CheckpointError, match=r"c_attn\.weight.*\(32, 96\).*transposed"):
        pm.from_pretrained(tmp_path)


def test_bf16_matches_transformers_bf16(checkpoint):
    """Loaded as bfloat16 (`dtype=jnp.bfloat16`) against transformers in bfloat16.

    The tolerance comes from bf16's epsilon: each side rounds the residual stream twice
    per block, then the final norm's output and the logits (2·layers + 2 roundings of
    relative size eps/2, one more for the last product's accumulation); an error of
    relative size r in the final hidden state moves a logit by at most r times the sum of
    its product's term magnitudes, `|ln_f(h)| @ |wte|ᵀ` (taken from fp32). Two sides.
    """
    model, path = checkpoint("gpt2")
    ids, mask = BATCHES["left"]
    ref32, _ = torch_forward(model, ids, mask, output_hidden_states=True)
    final = ref32.hidden_states[-1].numpy()
    wte = model.transformer.wte.weight.detach().numpy()
    magnitude = np.abs(final) @ np.abs(wte).T
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    roundings = 2 * LAYERS + 3
    tol = 2 * roundings * (eps / 2) * magnitude[mask.astype(bool)].max()

    ours = pm.from_pretrained(path, dtype=jnp.bfloat16)
    dtypes = {x.dtype for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert out.dtype == jnp.bfloat16
    ref16, _ = torch_forward(copy.deepcopy(model).to(torch.bfloat16), ids, mask)
    diff = real_diff(out, ref16.logits, mask)
    assert diff <= tol, f"bf16 logits differ by {diff:.3g} > {tol:.3g}"
    # one side's own error against fp32: half the bound
    assert real_diff(out, ref32.logits, mask) <= tol / 2
    # and bf16 is really in use: the fp32 logits differ from both by more than fp32's error
    assert real_diff(out, ref32.logits, mask) > 100 * TOL


# -- PEFT --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_lora_targets_and_count_match_peft(checkpoint, layout):
    """PEFT's default LoRA targets for GPT-2 (`c_attn`), and the same parameter counts as
    PyTorch PEFT on the same transformers model (which wraps Conv1D with fan_in_fan_out).
    """
    model, path = checkpoint("gpt2")
    ours = pm.from_pretrained(path, layout=layout)
    assert ours.config.model_type == "gpt2"
    config = peftx.LoraConfig(r=4, target_modules=None)
    selected = peftx.targets(ours, config, model_type="gpt2").paths()
    assert selected == peftx.targets(ours, config).paths()
    if layout == "stacked":
        assert selected == [f"transformer.h.0-{LAYERS - 1}.attn.c_attn"]
    else:
        assert selected == [f"transformer.h.{i}.attn.c_attn" for i in range(LAYERS)]
    peft_model = peftx.get_peft_model(ours, config, key=jax.random.key(0))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4))
    trainable, total = theirs.get_nb_trainable_parameters()
    assert trainable == 4 * (32 + 96) * LAYERS  # A (r, in) and B (out, r) per c_attn
    assert peft_model.get_nb_trainable_parameters() == (trainable, total)


def test_ia3_defaults_and_count_match_peft(checkpoint):
    """PEFT's default IA3 targets for GPT-2 (`c_attn`, and `mlp.c_proj` as feed-forward,
    scaled on its input): the same counts as PyTorch PEFT."""
    model, path = checkpoint("gpt2")
    ours = pm.from_pretrained(path)
    config = peftx.IA3Config(target_modules=None)
    assert peftx.targets(ours, config).paths() == [
        f"transformer.h.0-{LAYERS - 1}.attn.c_attn",
        f"transformer.h.0-{LAYERS - 1}.mlp.c_proj",
    ]
    peft_model = peftx.get_peft_model(ours, config, key=jax.random.key(0))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        theirs = peft.get_peft_model(copy.deepcopy(model), peft.IA3Config())
    trainable, total = theirs.get_nb_trainable_parameters()
    assert trainable == (3 * 32 + 4 * 32) * LAYERS  # c_attn's outputs, c_proj's inputs
    assert peft_model.get_nb_trainable_parameters() == (trainable, total)


def test_lora_forward_matches_peft(checkpoint):
    """LoRA on GPT-2's Conv1D layers in PyTorch PEFT (fan_in_fan_out) and on peftx's
    Linear layers, with the same factors (`lora_A (r, in)`, `lora_B (out, r)` on both
    sides), give the same logits."""
    model, path = checkpoint("gpt2")
    ours = pm.from_pretrained(path)
    kwargs = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False)
    peft_model = peftx.get_peft_model(ours, peftx.LoraConfig(**kwargs), key=jax.random.key(2))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**kwargs)).eval()
    stack = peft_model.base_model.transformer.h.segments[f"0-{LAYERS - 1}"]
    with torch.no_grad():
        for i, block in enumerate(theirs.base_model.model.transformer.h):
            for torch_layer, layer in [
                (block.attn.c_attn, stack.attn.c_attn),
                (block.mlp.c_fc, stack.mlp.c_fc),
            ]:
                factors = layer.weight.adapters["default"]
                torch_layer.lora_A["default"].weight.copy_(
                    torch.tensor(np.asarray(factors.lora_A[i]))
                )
                torch_layer.lora_B["default"].weight.copy_(
                    torch.tensor(np.asarray(factors.lora_B[i]))
                )
    ids, mask = BATCHES["mixed"]
    ref, _ = torch_forward(theirs, ids, mask)
    out = run(peft_model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert real_diff(out, ref.logits, mask) <= TOL
    # the adapters matter: the base model's logits are far away
    assert real_diff(out, torch_forward(model, ids, mask)[0].logits, mask) > 100 * TOL


def test_lora_trains_a_loaded_gpt2(checkpoint):
    """A few optax steps on `partition`'s trainable half lower the language-model loss
    and move only the adapters."""
    _, path = checkpoint("gpt2")
    ours = pm.from_pretrained(path)
    config = peftx.LoraConfig(r=4, target_modules=None)
    peft_model = peftx.get_peft_model(ours, config, key=jax.random.key(0))

    ids, mask = BATCHES["right"]
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    trainable, frozen = peftx.partition(peft_model)
    optim = optax.adam(1e-2)
    opt_state = optim.init(trainable)

    def loss_fn(trainable):
        logits = eqx.combine(trainable, frozen)(ids, mask).logits[:, :-1]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        weights = mask[:, 1:].astype(losses.dtype)
        return jnp.sum(losses * weights) / jnp.sum(weights)

    @eqx.filter_jit
    def step(trainable, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with strict(), jax.numpy_dtype_promotion("standard"):
        for _ in range(10):
            trainable, opt_state, loss = step(trainable, opt_state)
            losses.append(float(loss))
    assert losses[-1] < losses[0]
    trained = eqx.combine(trainable, frozen)
    base = jax.tree.leaves(eqx.filter(trained.disable_adapters(), eqx.is_array))
    original = jax.tree.leaves(eqx.filter(ours, eqx.is_array))
    assert all(jnp.array_equal(a, b) for a, b in zip(base, original, strict=True))


def test_merged_lora_saves_as_conv1d(checkpoint, tmp_path):
    """A LoRA merged into the weights, saved, and read by transformers: the merged
    `(out, in)` weights go out transposed like the rest, so the logits agree."""
    _, path = checkpoint("untied-inner-gelu")
    ours = pm.from_pretrained(path)
    config = peftx.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], init_lora_weights=False)
    merged = peftx.get_peft_model(ours, config, key=jax.random.key(3)).merge_and_unload()
    assert type(merged) is pm.GPT2LMHeadModel
    peftx.save_pretrained(merged, tmp_path)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask = BATCHES["left"]
    ref, _ = torch_forward(back.eval(), ids, mask)
    out = run(merged, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert real_diff(out, ref.logits, mask) <= TOL
    assert real_diff(out, run(ours, jnp.asarray(ids), jnp.asarray(mask)).logits, mask) > 100 * TOL


# -- config ------------------------------------------------------------------------------


def test_config_round_trips():
    theirs = hf_config("untied-inner-gelu", scale_attn_by_inverse_layer_idx=True)
    config = GPT2Config.from_hf_config(theirs)
    assert config == GPT2Config.from_hf_config(theirs.to_dict())
    assert (config.n_embd, config.n_layer, config.n_head, config.n_inner) == (32, LAYERS, 4, 48)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (32, LAYERS, 8)
    assert config.num_labels == 3 and config.pad_token_id == 0
    assert config.scale_attn_by_inverse_layer_idx and not config.tie_word_embeddings
    back = transformers.GPT2Config(**config.to_hf_config())
    for field in (
        "vocab_size",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "tie_word_embeddings",
        "num_labels",
        "pad_token_id",
        "initializer_range",
    ):
        assert getattr(back, field) == getattr(theirs, field), field
    assert GPT2Config.from_hf_config(back) == config


def test_config_defaults_are_gpt2_small():
    config = GPT2Config.from_hf_config({"model_type": "gpt2"})
    assert config == GPT2Config.from_hf_config(transformers.GPT2Config())
    assert config.inner_size == 4 * 768 and config.tie_word_embeddings


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="llama"), r"GPT2Config reads model types \('gpt2',\), got 'llama'"),
        (dict(add_cross_attention=True), r"add_cross_attention=True .* not supported"),
        (dict(activation_function="swiglu"), r"activation 'swiglu' is not supported"),
        (dict(n_embd=30), r"n_embd \(30\) must be divisible by n_head \(4\)"),
    ],
)
def test_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        GPT2Config.from_hf_config({**hf_config("gpt2").to_dict(), **change})


def test_unknown_remat_policy_fails_at_construction():
    config = GPT2Config.from_hf_config(hf_config("gpt2"))
    with pytest.raises(ValueError, match=r"remat_policy 'no_such_policy'"):
        pm.GPT2Model(config, key=jax.random.key(0), remat_policy="no_such_policy")


def test_fresh_model_saves_as_a_transformers_checkpoint(tmp_path):
    """A model built in peftx (not loaded) is a valid transformers checkpoint: the
    classifier (backbone under `transformer.`, `score` at the top) read back by
    transformers computes what it computes. (The LM head: the round trip test.)"""
    config = GPT2Config.from_hf_config(hf_config("gpt2"))
    # built under jit: eagerly, each random draw compiles for its own shape
    build = eqx.filter_jit(lambda k: pm.GPT2ForSequenceClassification(config, key=k))
    ours = build(jax.random.key(1))
    peftx.save_pretrained(ours, tmp_path)
    back = transformers.GPT2ForSequenceClassification.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    ids, mask = BATCHES["right"]
    ref, blocks = torch_forward(back.eval(), ids, mask)
    out = run(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert_layers_match(out.hidden_states, blocks, mask)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=0, atol=TOL)
