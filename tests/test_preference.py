"""Preference tuning (`peftx.train.encode_preference`, `dpo_loss`, `orpo_loss`) against
TRL's `DPOTrainer` and `ORPOTrainer` in PyTorch, on the same tiny Llama and the same
PEFT LoRA adapter: the tokenization, the losses and their metrics; and the reference,
which is the model with its adapters disabled, against the base model's own output."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import (
    CLASSES,
    FILLER,
    run_cli,
    tiny_llama_config,
    word_tokenizer,
    write_jsonl,
)

import peftx
from peftx.train import (
    DPO_LOSS_TYPES,
    IGNORE,
    dpo_loss,
    encode_preference,
    orpo_loss,
    precompute_ref_log_probs,
)

trl = pytest.importorskip("trl", reason="trl is a test reference (pip install -e .[test])")
datasets = pytest.importorskip("datasets")

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
    import peft

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


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
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
    total, sums = jax.jit(lambda b: loss(ours, b))(_ours_from_trl(batch))
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
    total, sums = jax.jit(lambda b: orpo_loss(ours, b, beta=0.25))(pairs)
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
        np.testing.assert_allclose(float(sums[name]) / count, want[name], rtol=1e-5, atol=1e-6)


def test_the_reference_is_the_base_and_precomputed_equals_in_step(pair_model, getkey):
    root, tok, base = pair_model
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)
    ours = peftx.get_peft_model(base, config, key=getkey())
    data = encode_preference(tok, TEXT_ROWS, max_length=16)
    base = peftx.models.from_pretrained(root / "base")
    ids, mask = (
        jnp.asarray(data[k].reshape(-1, data[k].shape[-1])) for k in ("input_ids", "attention_mask")
    )
    logits = np.asarray(base(ids, mask).logits, np.float64)
    # the base's own summed completion log-probabilities, written out here
    labels = data["labels"].reshape(ids.shape)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want = np.zeros(ids.shape[0])
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if labels[r, t] != IGNORE:
                want[r] += logp[r, t - 1, labels[r, t]]
    pre = precompute_ref_log_probs(ours, data, batch_size=2)
    np.testing.assert_allclose(pre["ref_chosen_logps"], want[0::2], rtol=1e-5)
    np.testing.assert_allclose(pre["ref_rejected_logps"], want[1::2], rtol=1e-5)
    in_step = jax.jit(lambda b: dpo_loss(ours, b))(data)
    from_data = jax.jit(lambda b: dpo_loss(ours, b))(pre)
    # rewards are differences of log-probabilities: a bound in their scale, not relative
    atol = 16 * np.finfo(np.float32).eps * np.abs(want).max()
    for k in in_step[1]:
        np.testing.assert_allclose(in_step[1][k], from_data[1][k], atol=atol, err_msg=k)
    np.testing.assert_allclose(in_step[0], from_data[0], atol=atol)


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
