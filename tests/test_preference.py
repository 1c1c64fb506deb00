"""Preference tuning (`peftx.train.encode_preference`, `dpo_loss`, `orpo_loss`) against
TRL's `DPOTrainer` and `ORPOTrainer` in PyTorch, on the same tiny Llama and the same
PEFT LoRA adapter: the tokenization, the losses and their metrics; and the reference,
which is the model with its adapters disabled, against the base model's own output."""

import functools
import json
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from helpers import (
    CLASSES,
    FILLER,
    as_users_run,
    phi3_longrope,
    run_cli,
    run_script,
    tiny_llama_config,
    word_tokenizer,
    write_jsonl,
)
from hypothesis import given, settings, strategies as st
from test_moe_lora import BUILD as MOE_BUILD
from test_peft_interop import BUILDERS, _llama_config

import peftx
from peftx.implicit import use_implicit_args
from peftx.train import (
    DPO_LOSS_TYPES,
    IGNORE,
    dpo_loss,
    encode_preference,
    orpo_loss,
    precompute_ref_log_probs,
    share_prompts,
)

WORDS = ["[PAD]", "[UNK]", "</s>", "<s>", "user", "assistant", "eot"]
WORDS += [f"w{i}" for i in range(40)]
# "role content eot" per message, the role word as the generation prompt
TEMPLATE = (
    "{% for m in messages %}{{ m.role }} {{ m.content }} eot {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
TEXT_ROWS = [
    {"prompt": "w1 w2 w3", "chosen": " w4 w5", "rejected": " w6"},
    {"prompt": "w7 w8", "chosen": " w9", "rejected": " w10 w11 w12"},
    {"prompt": "w13", "chosen": " w14 w15 w16 </s>", "rejected": " w17 w18"},
]
CHAT_ROWS = [
    {
        "prompt": [{"role": "user", "content": "w1 w2"}],
        "chosen": [{"role": "assistant", "content": "w3 w4"}],
        "rejected": [{"role": "assistant", "content": "w5"}],
    },
    {
        "prompt": [{"role": "user", "content": "w6"}],
        "chosen": [{"role": "assistant", "content": "w7"}],
        "rejected": [{"role": "assistant", "content": "w8 w9 w10"}],
    },
]


def _tokenizer():
    tok = word_tokenizer(WORDS)
    tok.chat_template = TEMPLATE
    return tok


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory):
    """A tiny Llama saved by transformers: `(its directory, tokenizer, peftx's base)`."""
    root = tmp_path_factory.mktemp("preference")
    config = tiny_llama_config(len(WORDS), bos_token_id=3, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    tok = _tokenizer()
    tok.save_pretrained(root / "base")
    return root, tok, peftx.models.from_pretrained(root / "base")


def _trl_trainer(kind, root, tok, rows, tmp_path, **args):
    """TRL's trainer on `rows`, training a new LoRA adapter of random factors (both
    nonzero, so the policy is not the reference) on the base in `root`, with dropout off
    and no logging; and peftx's model with the same adapter, read from PEFT's files."""
    import datasets
    import peft
    import trl

    common = {"output_dir": str(tmp_path / "trl"), "report_to": [], "max_length": 32}
    common |= {"bf16": False, "use_cpu": True, **args}
    if kind == "dpo":
        cls, config = trl.DPOTrainer, trl.DPOConfig(**common)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        cls, config = ORPOTrainer, ORPOConfig(**common)
    torch.manual_seed(1)
    trainer = cls(
        model=transformers.LlamaForCausalLM.from_pretrained(root / "base"),
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft.LoraConfig(**LORA, init_lora_weights=False),
    )
    trainer.model.save_pretrained(tmp_path / "adapter")
    return trainer, tmp_path / "adapter"


def _trl_batch(trainer):
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    return trainer.data_collator(rows)


def _ours_from_trl(batch):
    """TRL's collated batch (chosen rows, then rejected rows) as peftx's pairs."""
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    labels = np.where(batch["completion_mask"].numpy() > 0, ids, IGNORE)
    pairs = lambda x: np.stack(np.split(x, 2), axis=1).astype(np.int32)  # noqa: E731
    return {"input_ids": pairs(ids), "attention_mask": pairs(mask), "labels": pairs(labels)}


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["text", "chat"])
@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_pairs_are_trls_tokens(pair_model, rows, truncation_mode, tmp_path):
    root, tok, _ = pair_model
    trainer, _ = _trl_trainer(
        "dpo", root, tok, rows, tmp_path, max_length=6, truncation_mode=truncation_mode
    )
    want = _ours_from_trl(_trl_batch(trainer))
    got = encode_preference(tok, rows, max_length=6, truncation_mode=truncation_mode)
    width = want["input_ids"].shape[-1]
    assert got["input_ids"].shape[-1] >= width
    for k in want:
        np.testing.assert_array_equal(got[k][..., :width], want[k], err_msg=k)
    assert not got["attention_mask"][..., width:].any()


def _trl_metrics(trainer, batch):
    trainer._metrics["train"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


# the fast tier checks DPO's sigmoid loss; the whole suite every loss type
@pytest.mark.parametrize(
    "loss_type",
    [
        t if t == "sigmoid" else pytest.param(t, marks=pytest.mark.variant_sweep)
        for t in DPO_LOSS_TYPES
    ],
)
def test_dpo_loss_and_metrics_are_trls(pair_model, loss_type, tmp_path):
    root, tok, base = pair_model
    beta, smoothing = 0.3, (0.2 if loss_type == "robust" else 0.0)
    trainer, adapter = _trl_trainer(
        "dpo",
        root,
        tok,
        TEXT_ROWS + [{**TEXT_ROWS[1], "chosen": " w10 w11", "rejected": " w9"}],
        tmp_path,
        beta=beta,
        loss_type=[loss_type],
        label_smoothing=smoothing,
    )
    ours = peftx.PeftModel.from_pretrained(base, adapter)
    batch = _trl_batch(trainer)
    want_loss, want = _trl_metrics(trainer, batch)
    loss = functools.partial(dpo_loss, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    pairs = _ours_from_trl(batch)
    for data in (pairs, share_prompts(pairs)):  # the prompts run twice, or once
        total, sums = jax.jit(lambda b: loss(ours, b))(data)
        count = float(sums["count"])
        np.testing.assert_allclose(float(total) / count, want_loss, rtol=1e-5, atol=1e-6)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
            np.testing.assert_allclose(float(sums[name]) / count, want[name], rtol=1e-5, atol=1e-6)
        for name in ("logps/chosen", "logps/rejected"):
            np.testing.assert_allclose(float(sums[name]) / count, want[name], rtol=1e-5)


def test_orpo_loss_and_metrics_are_trls(pair_model, tmp_path):
    root, tok, base = pair_model
    trainer, adapter = _trl_trainer("orpo", root, tok, TEXT_ROWS, tmp_path, beta=0.25)
    ours = peftx.PeftModel.from_pretrained(base, adapter)
    row = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(row)
    with torch.no_grad():
        want_loss, want = trainer.get_batch_loss_metrics(trainer.model, batch)
    # TRL's ORPO batch as peftx's pairs: the labels mark its completions
    n = batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1]
    width = max(n)

    def side(name):
        ids = np.asarray(batch[f"{name}_input_ids"])
        pad = width - ids.shape[1]
        padded = lambda x, v: np.pad(np.asarray(x), ((0, 0), (0, pad)), constant_values=v)  # noqa: E731
        return (
            padded(ids, 0),
            padded(batch[f"{name}_attention_mask"], 0),
            padded(batch[f"{name}_labels"], IGNORE),
        )

    chosen, rejected = side("chosen"), side("rejected")
    pairs = {
        k: np.stack([c, r], axis=1).astype(np.int32)
        for k, c, r in zip(("input_ids", "attention_mask", "labels"), chosen, rejected)
    }
    for data in (pairs, share_prompts(pairs)):  # the prompts run twice, or once
        total, sums = jax.jit(lambda b: orpo_loss(ours, b, beta=0.25))(data)
        count = float(sums["count"])
        np.testing.assert_allclose(float(total) / count, float(want_loss), rtol=1e-5)
        for name in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "nll_loss",
            "log_odds_ratio",
            "log_odds_chosen",
        ):
            np.testing.assert_allclose(
                float(sums[name]) / count, want[name], rtol=1e-5, atol=1e-6, err_msg=name
            )


def _base_log_probs(logits, labels):
    """Each sequence's summed log-probability of its labelled tokens, written out: row r's
    position t - 1 predicts `labels[r, t]`."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    out = np.zeros(labels.shape[0])
    for r, t in zip(*np.nonzero(labels[:, 1:] != IGNORE), strict=True):
        out[r] += logp[r, t, labels[r, t + 1]]
    return out


def _check_reference(model, base, data, batch_size=2, shared=False):
    """The reference log-probabilities, precomputed, equal `base`'s own written out, and
    DPO's loss and metrics with them equal those of the reference computed in the step;
    with `shared`, on the pairs with their prompts held once (`share_prompts`)."""
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in data.items() if k != "adapter_ids"}
    logits = use_implicit_args(base)(
        jnp.asarray(flat["input_ids"]), jnp.asarray(flat["attention_mask"])
    ).logits
    want = _base_log_probs(logits, flat["labels"])
    data = share_prompts(data) if shared else data
    pre = precompute_ref_log_probs(model, data, batch_size=batch_size)
    np.testing.assert_allclose(pre["ref_chosen_logps"], want[0::2], rtol=1e-5)
    np.testing.assert_allclose(pre["ref_rejected_logps"], want[1::2], rtol=1e-5)
    in_step = jax.jit(lambda b: dpo_loss(model, b))(data)
    from_data = jax.jit(lambda b: dpo_loss(model, b))(pre)
    # rewards are differences of log-probabilities: a bound in their scale, not relative
    atol = 16 * np.finfo(np.float32).eps * np.abs(want).max()
    for k in in_step[1]:
        np.testing.assert_allclose(in_step[1][k], from_data[1][k], atol=atol, err_msg=k)
    np.testing.assert_allclose(in_step[0], from_data[0], atol=atol)
    return in_step


@pytest.mark.parametrize(
    "shared, truncation",
    [(False, "keep_start"), (True, "keep_start"), (True, "keep_end")],
    ids=["pairs", "prompts_shared", "prompts_cut_apart"],
)
def test_the_reference_is_the_base_and_precomputed_equals_in_step(
    pair_model, shared, truncation, getkey
):
    """Also with `keep_end` cutting the two sequences of a pair at different places, so
    that some pairs share little or nothing of their prompts."""
    _, tok, base = pair_model
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)
    model = peftx.get_peft_model(base, config, key=getkey())
    length = 16 if truncation == "keep_start" else 4
    data = encode_preference(tok, TEXT_ROWS, max_length=length, truncation_mode=truncation)
    if truncation == "keep_end":  # the cut leaves pairs whose sequences start apart
        assert share_prompts(data)["prompt_attention_mask"].sum(1).min() == 0
    _check_reference(model, base, data, shared=shared)


@pytest.mark.variant_sweep  # the fast tier checks the reference under LoRA
def test_under_qlora_the_reference_is_the_nf4_base(pair_model, getkey):
    _, tok, base = pair_model
    nf4 = peftx.quantize_model(base, peftx.QuantizationConfig(load_in_4bit=True))
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)
    model = peftx.get_peft_model(nf4, config, key=getkey())
    _check_reference(model, nf4, encode_preference(tok, TEXT_ROWS, max_length=16))


@pytest.mark.variant_sweep  # the fast tier checks the reference under LoRA
@pytest.mark.parametrize("shared", [False, True], ids=["pairs", "prompts_shared"])
def test_a_bank_of_four_adapters_tunes_each_rows_own_against_the_base(pair_model, shared, getkey):
    """Multi-tenant DPO: each row's policy is its own adapter, the reference the base for
    every row; a step changes the adapters whose rows are in the batch and no other."""
    _, tok, base = pair_model
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)
    names = ["a", "b", "c", "d"]
    bank = peftx.get_peft_model(base, config, key=getkey(), adapter_name="a", max_adapters=4)
    for name in names[1:]:
        bank = bank.add_adapter(name, config, key=getkey())
    rows = TEXT_ROWS + [{**TEXT_ROWS[0], "chosen": " w20"}]
    data = encode_preference(tok, rows, max_length=16)
    data["adapter_ids"] = np.asarray(bank.adapter_ids(["a", "b", "a", "c"]))
    _, mixed = _check_reference(bank, base, data, batch_size=4, shared=shared)
    data = share_prompts(data) if shared else data
    # each row's policy log-probabilities are its adapter's alone
    alone = 0.0
    for n, name in enumerate(["a", "b", "a", "c"]):
        one = {k: v[n : n + 1] for k, v in data.items() if k != "adapter_ids"}
        alone += float(
            jax.jit(lambda b, m: dpo_loss(m, b))(one, bank.set_adapter(name))[1]["logps/chosen"]
        )
    np.testing.assert_allclose(float(mixed["logps/chosen"]), alone, rtol=1e-5)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)  # decay would move an absent adapter
    state, frozen = peftx.train.init_state(bank, optimizer, key=getkey(), adapters=names)
    step = peftx.train.make_train_step(dpo_loss, optimizer)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        new, metrics = step(state, frozen, {k: jnp.asarray(v) for k, v in data.items()})
    assert bool(metrics["finite"])
    before, after = (peftx.train.trained_model(s, frozen) for s in (state, new))
    for name in names:
        a, b = (m.to_peft_model([name]) for m in (before, after))
        changed = any(
            not np.array_equal(x, y)
            for x, y in zip(
                jax.tree.leaves(eqx.filter(a, eqx.is_array)),
                jax.tree.leaves(eqx.filter(b, eqx.is_array)),
            )
        )
        assert changed == (name != "d"), name


# -- prompts held once (share_prompts) ----------------------------------------------------


@st.composite
def _pairs(draw):
    """Right-padded pairs as encode_preference makes them: a prompt (unlabelled, possibly
    empty) shared by both sequences, then each side's labelled completion; a side may
    also keep unlabelled tokens of its own after the prompt (a prompt cut differently)."""
    rows = draw(st.integers(1, 4))
    token = st.integers(1, 9)
    made = []
    for _ in range(rows):
        prompt = draw(st.lists(token, max_size=5))
        sides = []
        for _ in range(2):
            own = draw(st.lists(token, max_size=2))  # unlabelled, the side's own
            done = draw(st.lists(token, min_size=1, max_size=4))
            sides.append((prompt + own, done))
        made.append(sides)
    width = max(len(a) + len(b) for sides in made for a, b in sides) + draw(st.integers(0, 2))
    ids = np.zeros((rows, 2, width), np.int32)
    mask, labels = np.zeros_like(ids), np.full_like(ids, IGNORE)
    for r, sides in enumerate(made):
        for side, (head, done) in enumerate(sides):
            n = len(head) + len(done)
            ids[r, side, :n] = head + done
            mask[r, side, :n] = 1
            labels[r, side, len(head) : n] = done
    extra = np.arange(rows, dtype=np.float32)  # another key, as ref_chosen_logps
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "ref_chosen_logps": extra}


@settings(max_examples=60, deadline=None)
@given(_pairs())
def test_shared_prompts_hold_each_pairs_common_unlabelled_start_once(data):
    shared = share_prompts(data)
    rows = len(data["input_ids"])
    np.testing.assert_array_equal(shared["ref_chosen_logps"], data["ref_chosen_logps"])
    prompt_mask = shared["prompt_attention_mask"]
    for r in range(rows):
        real = prompt_mask[r] > 0
        assert not np.any(real[:-1] & ~real[1:]), "prompts are left-padded"
        prompt = list(shared["prompt_input_ids"][r][real])
        for side in range(2):
            keep = data["attention_mask"][r, side] > 0
            whole = list(data["input_ids"][r, side][keep])
            rest = shared["attention_mask"][r, side] > 0
            assert not np.any(~rest[:-1] & rest[1:]), "completions are right-padded"
            assert prompt + list(shared["input_ids"][r, side][rest]) == whole
            labels = list(data["labels"][r, side][keep])
            assert [IGNORE] * len(prompt) + list(shared["labels"][r, side][rest]) == labels
        # the shared start is the longest common unlabelled one: the next tokens differ
        n = len(prompt)
        a, b = (data["input_ids"][r, s] for s in range(2))
        la, lb = (data["labels"][r, s] for s in range(2))
        ends = [data["attention_mask"][r, s].sum() for s in range(2)]
        assert n == min(ends) or a[n] != b[n] or la[n] != IGNORE or lb[n] != IGNORE
    assert shared["prompt_input_ids"].shape[1] == max(1, prompt_mask.sum(1).max())


def test_share_prompts_pads_to_given_lengths_and_refuses_what_is_not_pairs(pair_model):
    _, tok, _ = pair_model
    data = encode_preference(tok, TEXT_ROWS, max_length=16)
    shared = share_prompts(data)
    wide = share_prompts(data, prompt_length=7, completion_length=9)
    assert wide["prompt_input_ids"].shape == (3, 7) and wide["labels"].shape == (3, 2, 9)
    width = shared["prompt_input_ids"].shape[1]
    np.testing.assert_array_equal(wide["prompt_input_ids"][:, -width:], shared["prompt_input_ids"])
    with pytest.raises(ValueError, match="prompt_length 1 is shorter than these pairs' 3"):
        share_prompts(data, prompt_length=1)
    with pytest.raises(ValueError, match="share their prompts already"):
        share_prompts(shared)
    flat = {k: v[:, 0] for k, v in data.items()}
    with pytest.raises(ValueError, match=r"\(rows, 2, length\); got shapes"):
        share_prompts(flat)
    with pytest.raises(ValueError, match="no labels"):
        share_prompts({k: v for k, v in data.items() if k != "labels"})


ARCHITECTURES = {
    # a sliding window the pairs exceed, and both softcaps
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=len(WORDS),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            initializer_range=0.2,
            attn_implementation="eager",
        )
    ),
    # other test files' tiny models (their vocabularies hold WORDS)
    "gpt2": BUILDERS["gpt2"],
    "qwen3_moe": MOE_BUILD["qwen3_moe"],
}


@pytest.mark.parametrize(
    "name",
    ["gemma2", *(pytest.param(n, marks=pytest.mark.variant_sweep) for n in ("gpt2", "qwen3_moe"))],
)
def test_shared_prompts_give_each_architectures_log_probs_losses_and_gradients(
    name, tmp_path, getkey
):
    """With prompts run once and cached, DPO's and ORPO's log-probabilities are those of
    the whole sequences' logits written out, and the losses and gradients those of the
    pairs run whole."""
    torch.manual_seed(0)
    ARCHITECTURES[name]().save_pretrained(tmp_path)
    base = peftx.models.from_pretrained(tmp_path)
    targets = {"gpt2": ["c_attn", "c_fc"]}.get(name, ["q_proj", "v_proj"])
    config = peftx.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peftx.get_peft_model(base, config, key=getkey())
    rows = TEXT_ROWS + [{"prompt": "w1 w2 w3 w4 w5 w6", "chosen": " w7", "rejected": " w8 w9"}]
    pairs = encode_preference(_tokenizer(), rows, max_length=16)
    shared = share_prompts(pairs)
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in pairs.items()}
    logits = use_implicit_args(model)(
        jnp.asarray(flat["input_ids"]), jnp.asarray(flat["attention_mask"])
    ).logits
    want = _base_log_probs(logits, flat["labels"])
    trainable, frozen = peftx.partition(model)
    for loss in (functools.partial(dpo_loss, beta=0.3), orpo_loss):

        def value(t, b, loss=loss):
            return loss(eqx.combine(t, frozen), b)

        run = eqx.filter_jit(eqx.filter_value_and_grad(value, has_aux=True))
        (total, sums), grads = run(trainable, shared)
        (want_total, want_sums), want_grads = run(trainable, pairs)
        if loss is not orpo_loss:  # ORPO's are per-token averages
            np.testing.assert_allclose(sums["logps/chosen"], want[0::2].sum(), rtol=1e-5)
            np.testing.assert_allclose(sums["logps/rejected"], want[1::2].sum(), rtol=1e-5)
        np.testing.assert_allclose(total, want_total, rtol=1e-5)
        for k in want_sums:
            np.testing.assert_allclose(sums[k], want_sums[k], rtol=1e-5, atol=1e-6, err_msg=k)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            scale = float(jnp.abs(w).max())
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=64 * np.finfo(np.float32).eps * scale)


def test_shared_prompts_refuse_a_rope_that_the_whole_length_would_change(tmp_path, getkey):
    """A LongRoPE Phi-3 turns to its long factors for a whole call once a position passes
    `original_max_position_embeddings`; a prompt run alone would not see them."""
    config = _llama_config(
        transformers.Phi3Config, original_max_position_embeddings=8, rope_parameters=phi3_longrope()
    )
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    base = peftx.models.from_pretrained(tmp_path)
    rows = [{"prompt": "w1 w2 w3 w4 w5 w6", "chosen": " w7 w8", "rejected": " w9"}]
    pairs = encode_preference(_tokenizer(), rows, max_length=16)
    with pytest.raises(ValueError, match="longrope rope changes its frequencies past 8"):
        precompute_ref_log_probs(base, share_prompts(pairs))
    short = encode_preference(_tokenizer(), [{**rows[0], "prompt": "w1"}], max_length=16)
    precompute_ref_log_probs(base, share_prompts(short))  # within the original length


MESH_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import peftx
    from peftx.models import LlamaConfig, LlamaForCausalLM
    from peftx.sharding import make_mesh, shard

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, model_type="llama"),
        key=jax.random.key(0),
    )
    config = peftx.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                              init_lora_weights=False)
    model = peftx.get_peft_model(llama, config, key=jax.random.key(1))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (8, 2, 10)).astype(np.int32)
    ids[:, 1, :4] = ids[:, 0, :4]  # one prompt of 4 tokens per pair
    labels = np.where(np.arange(10) < 4, -100, ids).astype(np.int32)
    data = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}

    # the reference on the mesh: the base's own log-probabilities, sharded as the policy
    mesh = make_mesh(fsdp=4, tensor=2)
    one = peftx.train.precompute_ref_log_probs(model, data, batch_size=8)
    with jax.set_mesh(mesh):
        eight = peftx.train.precompute_ref_log_probs(shard(model, mesh, "fsdp_tp"), data,
                                                     batch_size=8)
    shared = peftx.train.share_prompts(data)  # each pair's prompt run once
    with jax.set_mesh(mesh):
        eight_shared = peftx.train.precompute_ref_log_probs(shard(model, mesh, "fsdp_tp"),
                                                            shared, batch_size=8)
    for k in ("ref_chosen_logps", "ref_rejected_logps"):
        np.testing.assert_allclose(eight[k], one[k], rtol=2e-5, err_msg=k)
        np.testing.assert_allclose(eight_shared[k], one[k], rtol=2e-5, err_msg=k)

    # a DPO step on the mesh (reference in the step) equals the step on one device, the
    # prompts run twice or once
    loss = functools.partial(peftx.train.dpo_loss, beta=0.2)
    optimizer = optax.adamw(1e-2)
    results = []
    for on_mesh, pairs in ((None, data), (mesh, data), (mesh, shared)):
        state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(4),
                                               mesh=on_mesh, rules="fsdp_tp")
        step = peftx.train.make_train_step(loss, optimizer, mesh=on_mesh)
        with jax.numpy_dtype_promotion("standard"):
            state, metrics = step(state, frozen, pairs)
        leaves = [np.asarray(x) for x in jax.tree.leaves(state.trainable)]
        results.append((float(metrics["loss"]), float(metrics["rewards/margins"]), leaves))
    loss1, margin1, a = results[0]
    for loss8, margin8, b in results[1:]:
        assert abs(loss1 - loss8) < 1e-5 and abs(margin1 - margin8) < 1e-5, results[0][:2]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5)
    print("OK")
    """
)


@pytest.mark.simulated_devices
def test_on_eight_devices_the_reference_and_the_step_equal_one_devices(tmp_path):
    run_script(tmp_path / "dpo_mesh.py", MESH_SCRIPT)


# -- it learns: a job whose chosen answers follow a rule that the rejected ones break -----


def _toy_pairs(rng, n):
    """A prompt of filler words; the chosen answer is two words of one class (the rule),
    the rejected one two words of another."""
    out = []
    for _ in range(n):
        good, bad = (rng.choice(CLASSES[c], 2) for c in ("red", "blue"))
        out.append(
            {
                "question": " ".join(rng.choice(FILLER, 3)),
                "good": " " + " ".join(good),
                "bad": " " + " ".join(bad),
            }
        )
    return out


def _torch_log_probs(base_dir, adapter_dir, tok, rows):
    """Each held-out pair's summed completion log-probabilities under PyTorch PEFT with the
    written adapter: `(chosen, rejected)` arrays, computed here by hand."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    sums = {"good": [], "bad": []}
    for row in rows:
        prompt = tok(row["question"])["input_ids"]
        for side in sums:
            ids = tok(row["question"] + row[side] + tok.eos_token)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            sums[side].append(sum(float(logp[t - 1, ids[t]]) for t in range(len(prompt), len(ids))))
    return np.array(sums["good"]), np.array(sums["bad"])


@pytest.mark.command_run
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_preference_job_learns_the_chosen_answers(llama, objective, tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_jsonl(tmp_path / "train.jsonl", _toy_pairs(rng, 96))
    held_out = _toy_pairs(rng, 24)
    write_jsonl(tmp_path / "eval.jsonl", held_out)
    table = (
        "[dpo]\nbeta = 0.5\nprecompute_ref_log_probs = true\n"
        if objective == "dpo"
        else "[orpo]\nbeta = 0.5\n"
    )
    (tmp_path / "job.toml").write_text(
        f"""
[model]
path = "{llama / "base"}"
task = "causal-lm"

[data]
train = "train.jsonl"
eval = "eval.jsonl"
prompt_column = "question"
chosen_column = "good"
rejected_column = "bad"
max_length = 16

[lora]
r = 4
lora_alpha = 8
target_modules = ["q_proj", "v_proj", "down_proj"]

[train]
objective = "{objective}"
batch_size = 8
steps = 60
learning_rate = 2e-2
eval_every = 30
log_every = 10

{table}
[output]
dir = "run"
"""
    )
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["after"]["rewards/accuracies"] >= 0.9, summary
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    train_rows = [r for r in records if r["split"] == "train"]
    assert all("rewards/margins" in r for r in train_rows)
    # the written adapter, in PyTorch PEFT: held-out chosen answers are the likelier
    tok = transformers.AutoTokenizer.from_pretrained(llama / "base")
    good, bad = _torch_log_probs(llama / "base", tmp_path / "run" / "adapter", tok, held_out)
    assert np.mean(good > bad) >= 0.9, (good, bad)


@pytest.mark.command_run
def test_a_job_with_prompts_shared_writes_the_adapter_of_prompts_run_twice(llama, tmp_path, capsys):
    """`[data] share_prompts` (on by default for preference tuning) changes how a step runs
    the pairs, not what it computes: three DPO steps write the adapter of the same job
    with the prompts run twice, to float32 rounding."""
    from safetensors.numpy import load_file

    write_jsonl(tmp_path / "train.jsonl", _toy_pairs(np.random.default_rng(2), 24))
    adapters = []
    for share in ("true", "false"):
        (tmp_path / f"{share}.toml").write_text(
            f'[model]\npath = "{llama / "base"}"\ntask = "causal-lm"\n'
            '[data]\ntrain = "train.jsonl"\neval = "train.jsonl"\nprompt_column = "question"\n'
            f'chosen_column = "good"\nrejected_column = "bad"\nshare_prompts = {share}\n'
            '[lora]\nr = 4\nlora_alpha = 8\ntarget_modules = ["q_proj", "v_proj", "down_proj"]\n'
            '[train]\nobjective = "dpo"\nbatch_size = 8\nsteps = 3\nlearning_rate = 1e-3\n'
            f'[output]\ndir = "{share}"\n'
        )
        code, _, err = run_cli(capsys, "finetune", tmp_path / f"{share}.toml")
        assert code == 0, err
        adapters.append(load_file(tmp_path / share / "adapter" / "adapter_model.safetensors"))
    shared, twice = adapters
    assert shared.keys() == twice.keys()
    for k in twice:
        scale = float(np.abs(twice[k]).max())
        np.testing.assert_allclose(shared[k], twice[k], rtol=1e-4, atol=1e-4 * scale, err_msg=k)


@pytest.mark.command_run
def test_a_dpo_job_initializes_eva_from_its_pairs(llama, tmp_path, capsys):
    """`init_lora_weights = "eva"` with `[init]` in a DPO job: EVA reads the pairs' chosen
    and rejected sequences, then the job trains with the prompts shared."""
    write_jsonl(tmp_path / "train.jsonl", _toy_pairs(np.random.default_rng(0), 24))
    (tmp_path / "job.toml").write_text(
        f'[model]\npath = "{llama / "base"}"\ntask = "causal-lm"\n'
        '[data]\ntrain = "train.jsonl"\neval = "train.jsonl"\nprompt_column = "question"\n'
        'chosen_column = "good"\nrejected_column = "bad"\n'
        '[lora]\nr = 4\nlora_alpha = 8\ntarget_modules = ["q_proj", "v_proj"]\n'
        'init_lora_weights = "eva"\n[init]\nbatches = 2\n'
        '[train]\nobjective = "dpo"\nbatch_size = 8\nsteps = 2\n[output]\ndir = "run"\n'
    )
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 0, err
    assert "initializing the adapter from 2 train batches" in out
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["init_lora_weights"] == "eva"


# -- bad input: one clear error, naming what is at fault ----------------------------------


@pytest.mark.parametrize(
    "rows, error, match",
    [
        ([TEXT_ROWS[0], {"prompt": "w1", "chosen": " w2"}], ValueError, "row 2 has no 'rejected'"),
        ([{**TEXT_ROWS[0], "chosen": 3}], TypeError, r"row 1, 'chosen' holds an int: 3"),
        (
            [{**CHAT_ROWS[0], "rejected": "w5"}],
            TypeError,
            r"row 1, 'rejected' holds a str.*list of messages",
        ),
        ([TEXT_ROWS[0], ["w1"]], TypeError, "row 2 holds a list"),
        ([], ValueError, "no rows"),
        ([{"prompt": "w1 " * 20, "chosen": " w2", "rejected": " w3"}], ValueError, "fill"),
    ],
)
def test_bad_rows_are_named(rows, error, match):
    with as_users_run(), pytest.raises(error, match=match):
        encode_preference(_tokenizer(), rows, max_length=8)


def test_a_prompt_that_fills_max_length_drops_its_row_with_a_warning():
    rows = [TEXT_ROWS[0], {"prompt": "w1 " * 20, "chosen": " w2", "rejected": " w3"}]
    with pytest.warns(UserWarning, match=r"1 of 2 .* dropped \(rows 2\)"):
        data = encode_preference(_tokenizer(), rows, max_length=8)
    assert data["input_ids"].shape[0] == 1


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"loss_type": "kto"}, "loss_type 'kto': choose one of sigmoid, ipo, hinge, robust"),
        ({"beta": 0.0}, "beta must be a finite number > 0"),
        ({"beta": float("nan")}, "beta must be a finite number > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
    ],
)
def test_bad_dpo_settings_are_refused(pair_model, settings, match, getkey):
    _, tok, base = pair_model
    model = peftx.get_peft_model(base, peftx.LoraConfig(**LORA), key=getkey())
    data = jax.tree.map(jnp.asarray, encode_preference(tok, TEXT_ROWS, max_length=16))
    with as_users_run(), pytest.raises(ValueError, match=match):
        dpo_loss(model, data, **settings)


def test_without_adapters_the_reference_needs_precomputing(pair_model):
    _, tok, base = pair_model
    data = jax.tree.map(jnp.asarray, encode_preference(tok, TEXT_ROWS, max_length=16))
    with pytest.raises(TypeError, match="must be a PeftModel or PeftBankModel.*precompute"):
        dpo_loss(base, data)


@pytest.mark.parametrize(
    "change, match",
    [
        ("[dpo]\nbeta = 0.2\n", r'\[dpo\] sets up train.objective = "dpo", but the objective is'),
        ('[train]\nobjective = "kto"\n', "train.objective = 'kto' is not one of sft, dpo, orpo"),
        (
            '[train]\nobjective = "dpo"\n[dpo]\nloss_type = "nca_pair"\n',
            "dpo.loss_type = 'nca_pair' is not one of sigmoid, ipo, hinge, robust",
        ),
        ('[train]\nobjective = "orpo"\n[orpo]\nbeta = -1\n', "orpo.beta must be a finite"),
        (
            '[train]\nobjective = "dpo"\n[data]\ntext_column = "answer"\n',
            "preference tuning reads data.prompt_column",
        ),
        ("[data]\nshare_prompts = true\n", 'it applies to train.objective = "dpo" or "orpo"'),
        (
            '[train]\nobjective = "dpo"\n[data]\nshare_prompts = "yes"\n',
            "data.share_prompts must be true or false, got 'yes'",
        ),
    ],
)
def test_bad_preference_jobs_fail_in_one_line(llama, change, match, tmp_path, capsys):
    tables = {"model": f'path = "{llama / "base"}"\ntask = "causal-lm"\n'}
    tables["data"] = 'train = "t.jsonl"\neval = "t.jsonl"\n'
    tables["lora"] = 'r = 4\ntarget_modules = ["q_proj"]\n'
    tables["train"] = ""
    for block in change.strip().split("\n["):
        name, _, body = block.lstrip("[").partition("]\n")
        tables[name] = tables.get(name, "") + body
    job = "".join(f"[{name}]\n{body}\n" for name, body in tables.items())
    write_jsonl(tmp_path / "t.jsonl", TEXT_ROWS)
    (tmp_path / "job.toml").write_text(job)
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(match, err), err


def test_a_missing_column_names_the_file_and_column(llama, tmp_path, capsys):
    write_jsonl(tmp_path / "t.jsonl", [{"q": "w1", "good": " w2", "bad": 3}])
    (tmp_path / "job.toml").write_text(
        f"""
[model]
path = "{llama / "base"}"
task = "causal-lm"
[data]
train = "t.jsonl"
eval = "t.jsonl"
prompt_column = "q"
chosen_column = "good"
rejected_column = "bad"
[lora]
r = 4
target_modules = ["q_proj"]
[train]
objective = "dpo"
"""
    )
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 2 and err.count("\n") == 1, err
    assert "t.jsonl: row 1, column 'bad' holds an int: 3" in err, err


@pytest.mark.parametrize("shared", [False, True], ids=["pairs", "prompts_shared"])
def test_a_bfloat16_base_gives_the_float32_loss_within_its_precision(pair_model, shared, getkey):
    """On a bf16 base with fp32 adapters, DPO's log-probabilities and loss are the fp32
    model's to within bf16's precision: the logits are rounded once per layer, and the
    log-softmax and sums run in float32. The fp32 model runs the pairs as given, the bf16
    one with its prompts shared (its keys and values cached in bf16) or not."""
    root, tok, base = pair_model
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)
    key = getkey()
    pairs = encode_preference(tok, TEXT_ROWS, max_length=16)
    layouts = {jnp.float32: pairs, jnp.bfloat16: share_prompts(pairs) if shared else pairs}
    runs = []
    for dtype, data in layouts.items():
        loaded = peftx.models.from_pretrained(root / "base", dtype=dtype)
        model = peftx.get_peft_model(loaded, config, key=key)
        total, sums = jax.jit(lambda b, m=model: dpo_loss(m, b, beta=0.5))(data)
        assert sums["logps/chosen"].dtype == jnp.float32
        runs.append((float(total), {k: float(v) for k, v in sums.items()}))
    (want_loss, want), (got_loss, got) = runs
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    scale = abs(want["logps/chosen"]) + abs(want["logps/rejected"])
    for k in ("logps/chosen", "logps/rejected"):
        assert abs(got[k] - want[k]) <= 8 * eps * scale, (k, got[k], want[k])
    assert abs(got_loss - want_loss) <= 8 * eps * scale * 0.5, (got_loss, want_loss)


def test_a_separate_reference_model_precomputes_for_any_policy(pair_model, getkey):
    """`precompute_ref_log_probs` with a plain model takes it as the reference itself; the
    base's numbers are then those of a PEFT model's disabled adapters."""
    _, tok, base = pair_model
    data = encode_preference(tok, TEXT_ROWS, max_length=16)
    model = peftx.get_peft_model(
        base, peftx.LoraConfig(**LORA, init_lora_weights=False), key=getkey()
    )
    plain, peft_base = (precompute_ref_log_probs(m, data, batch_size=4) for m in (base, model))
    for k in ("ref_chosen_logps", "ref_rejected_logps"):
        np.testing.assert_array_equal(plain[k], peft_base[k])


@pytest.mark.command_run
def test_a_bank_job_tunes_each_adapter_on_its_own_pairs(llama, tmp_path, capsys):
    """Multi-tenant DPO from the command: two adapters of a bank, each on its own pairs
    (the same rule, flipped for the second), the base the reference of both."""
    rng = np.random.default_rng(1)
    pairs = _toy_pairs(rng, 64)
    flipped = [{**r, "good": r["bad"], "bad": r["good"]} for r in pairs]
    for name, rows in (("red", pairs), ("blue", flipped)):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
    entries = "".join(
        f'[[adapters]]\nname = "{n}"\ntrain = "{n}.jsonl"\neval = "{n}.jsonl"\n[adapters.lora]\n'
        'r = 4\nlora_alpha = 8\ntarget_modules = ["q_proj", "v_proj", "down_proj"]\n'
        for n in ("red", "blue")
    )
    (tmp_path / "job.toml").write_text(
        f'[model]\npath = "{llama / "base"}"\ntask = "causal-lm"\n'
        '[data]\nprompt_column = "question"\nchosen_column = "good"\nrejected_column = "bad"\n'
        f"max_length = 16\n{entries}[bank]\nmax_adapters = 4\n"
        '[train]\nobjective = "dpo"\nsteps = 40\nbatch_size = 8\nlearning_rate = 2e-2\n'
        '[dpo]\nbeta = 0.5\n[output]\ndir = "run"\n'
    )
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml")
    assert code == 0, err
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    last = {(r["adapter"], r["data"]): r for r in evals if r["split"] == "eval" and r["step"] == 40}
    for name in ("red", "blue"):
        assert last[name, name]["rewards/accuracies"] >= 0.9, last[name, name]
        # the base is the reference: its rows' margins vanish, up to float32 rounding of
        # the log-probabilities (policy and reference are separate programs' sums)
        base = last["__base__", name]
        scale = 0.5 * (abs(base["logps/chosen"]) + abs(base["logps/rejected"]))
        assert abs(base["rewards/margins"]) <= 16 * np.finfo(np.float32).eps * scale, base
