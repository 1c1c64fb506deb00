"""The model card (`README.md`) that a save writes beside the adapters, as PyTorch PEFT does:
PEFT loads a directory holding it to the same logits, its front matter parses and names the
base and the config, the command's card names the run's data and final metrics, a user's
`README.md` is kept, and the card lies where PEFT puts its own. The tiny Llama of
`conftest.llama`."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import WORDS, run_cli
from huggingface_hub import ModelCard

import peftx

CARD = "README.md"
EPS = np.finfo(np.float32).eps
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
IA3 = dict(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
# each kind's config, and the lines of its settings that differ from PEFT's defaults
KINDS = {
    "lora": (
        peftx.LoraConfig(**LORA),
        ['- `target_modules`: `["q_proj", "v_proj"]`', "- `r`: `4`"],
    ),
    "ia3": (
        peftx.IA3Config(**IA3, task_type="CAUSAL_LM"),
        [
            '- `target_modules`: `["down_proj", "k_proj"]`',  # sorted, as PEFT writes it
            '- `feedforward_modules`: `["down_proj"]`',
        ],
    ),
}


@pytest.fixture(scope="module")
def base(llama):
    return peftx.from_pretrained(llama / "base")


def _cards(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(CARD))


def test_peft_loads_a_directory_with_the_card(llama, base, tmp_path):
    config = peftx.LoraConfig(**LORA, init_lora_weights=False)  # B random: the adapter counts
    ours = peftx.get_peft_model(base, config, key=jax.random.key(0))
    ours.save_pretrained(tmp_path)
    assert _cards(tmp_path) == [CARD]
    ids = np.random.default_rng(0).integers(5, len(WORDS), size=(2, 9))
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32)).logits)
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    theirs = peft.PeftModel.from_pretrained(torch_base, tmp_path).eval()
    with torch.no_grad():
        want = theirs(torch.from_numpy(ids)).logits.numpy()
        with theirs.disable_adapter():
            plain = theirs(torch.from_numpy(ids)).logits.numpy()
    tolerance = 64 * EPS * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
    assert np.abs(want - plain).max() > 100 * tolerance  # the adapter was loaded


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_card_front_matter_names_the_base_and_the_config(kind, llama, base, tmp_path):
    config, settings = KINDS[kind]
    model = peftx.get_peft_model(base, config, key=jax.random.key(0))
    sections = {"Data": {"train": "data/train.jsonl"}, "Evaluation": {"x": {"loss": 0.123456789}}}
    model.save_pretrained(tmp_path, model_card=sections)
    card = ModelCard.load(tmp_path / CARD)
    where = str(llama / "base")
    assert card.data.library_name == "peft"
    assert card.data.base_model == where
    assert card.data.pipeline_tag == "text-generation"
    assert sorted(card.data.tags) == sorted(["peftx", "jax", kind, f"base_model:adapter:{where}"])
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    lines = card.text.splitlines()
    assert f"### `default`: {saved['peft_type']}, in this folder" in lines
    assert all(s in lines for s in settings)
    assert json.dumps(saved, indent=2, sort_keys=True) in card.text  # the whole config, folded
    assert "| train | `data/train.jsonl` |" in lines and "| x / loss | 0.123457 |" in lines
    assert f"- peftx {peftx.__version__}" in lines and f"- JAX {jax.__version__}" in lines


def test_peft_version_of_the_config_is_named(base, tmp_path):
    config = peftx.LoraConfig(**LORA, peft_version=peft.__version__)
    peftx.get_peft_model(base, config, key=jax.random.key(0)).save_pretrained(tmp_path)
    assert f"- PEFT {peft.__version__}" in ModelCard.load(tmp_path / CARD).text.splitlines()


def test_a_users_readme_is_kept_and_peftx_rewrites_its_own(base, tmp_path):
    model = peftx.get_peft_model(base, peftx.LoraConfig(**LORA), key=jax.random.key(0))
    mine = "---\nlicense: mit\n---\n# My adapter\n\nmy notes\n"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / CARD).write_text(mine)
    with pytest.warns(UserWarning, match=r"README.md' is not a model card peftx wrote.*kept"):
        model.save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / CARD).read_text() == mine
    assert (tmp_path / "mine" / "adapter_config.json").is_file()

    ours = tmp_path / "ours"
    model.save_pretrained(ours)
    other = peftx.get_peft_model(base, peftx.LoraConfig(**{**LORA, "r": 2}), key=jax.random.key(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peftx's own card is replaced without a word
        other.save_pretrained(ours)
    text = (ours / CARD).read_text()
    assert "- `r`: `2`" in text and "- `r`: `4`" not in text
    # with the marker line deleted, the card is the user's
    edited = "\n".join(line for line in text.splitlines() if "peftx model card" not in line)
    (ours / CARD).write_text(edited)
    with pytest.warns(UserWarning, match="no card is written"):
        model.save_pretrained(ours)
    assert (ours / CARD).read_text() == edited


@pytest.mark.parametrize("selected", [None, ["other"]], ids=["all", "other"])
def test_several_adapters_get_one_card_where_peft_writes_it(selected, llama, base, tmp_path):
    second = dict(r=2, target_modules=["k_proj"], task_type="CAUSAL_LM")
    ours = peftx.get_peft_model(base, peftx.LoraConfig(**LORA), key=jax.random.key(0))
    ours = ours.add_adapter("other", peftx.LoraConfig(**second), key=jax.random.key(1))
    ours.save_pretrained(tmp_path / "ours", selected_adapters=selected)
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(llama / "base")
    theirs = peft.get_peft_model(torch_base, peft.LoraConfig(**LORA))
    theirs.add_adapter("other", peft.LoraConfig(**second))
    theirs.save_pretrained(tmp_path / "theirs", selected_adapters=selected)
    assert _cards(tmp_path / "ours") == _cards(tmp_path / "theirs") == [CARD]
    headings = [
        line for line in (tmp_path / "ours" / CARD).read_text().splitlines()
        if line.startswith("### `")
    ]  # fmt: skip
    want = ["### `default`: LORA, in this folder", "### `other`: LORA, in `other/`"]
    assert headings == (want if selected is None else want[1:])


def test_bank_saves_the_card(llama, base, tmp_path):
    bank = peftx.get_peft_model(
        base, peftx.LoraConfig(**LORA), key=jax.random.key(0), max_adapters=2
    )
    bank.save_pretrained(tmp_path)
    assert _cards(tmp_path) == [CARD]
    card = ModelCard.load(tmp_path / CARD)
    assert card.data.base_model == str(llama / "base") and "- `r`: `4`" in card.text


@pytest.mark.command_run
def test_finetune_card_names_the_data_and_the_final_metrics(llama, tmp_path, capsys):
    out = tmp_path / "run"
    sets = [f"output.dir={out}", "train.steps=4", "output.merged=false"]
    code, stdout, err = run_cli(
        capsys, "finetune", llama / "job.toml", *[a for s in sets for a in ("--set", s)]
    )
    assert code == 0, (stdout, err)
    card = ModelCard.load(out / "adapter" / CARD)
    assert card.data.base_model == str(llama / "base")
    assert card.data.pipeline_tag == "text-generation"
    lines = card.text.splitlines()
    assert f"| train | `{llama / 'train.jsonl'}` |" in lines
    assert f"| eval | `{llama / 'eval.jsonl'}` |" in lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and "## Evaluation after 4 steps" in lines
    for name, value in summary["after"].items():
        assert f"| {name} | {value:.6g} |" in lines
