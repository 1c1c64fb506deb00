"""Every public name is importable from where the README and the docs say it is."""

from pathlib import Path

import pytest

import peftx
import peftx.adapters
import peftx.cli
import peftx.implicit
import peftx.models
import peftx.train

PUBLIC = {
    peftx.train: [
        "TrainState",
        "init_state",
        "make_train_step",
        "make_eval_step",
        "summarize",
        "classification_loss",
        "causal_lm_loss",
        "logits",
        "read_records",
        "encode_classification",
        "encode_causal_lm",
        "supervised_tokens",
        "train_batches",
        "eval_batches",
        "batches_per_epoch",
        "mixed_batches",
        "pad_to",
        "IGNORE",
        "save_checkpoint",
        "restore_checkpoint",
        "latest_checkpoint",
        "checkpoints",
    ],
    peftx.cli: ["main", "model_dir"],
    peftx: [
        "ImplicitArray",
        "use_implicit_args",
        "implicit",
        "adapters",
        "select",
        "Selection",
        "Predicate",
        "of_type",
        "named",
        "path_glob",
        "path_regex",
        "in_layers",
        "layer_index",
        "layer_span",
        "with_shape",
        "with_ndim",
        "where",
        "peft_targets",
        "require_matches",
        "dotted",
        "TargetNotFoundError",
        "UnsupportedTargetError",
        "UnknownAdapterError",
        "LoraConfig",
        "IA3Config",
        "AbstractAdapterConfig",
        "load_config",
        "save_config",
        "from_toml",
        "get_peft_model",
        "PeftModel",
        "partition",
        "BASE",
        "QuantizationConfig",
        "quantize_model",
        "targets",
        "models",
        "from_pretrained",
        "save_pretrained",
        "generate",
        "CheckpointError",
        "ConfigFileError",
    ],
    peftx.models: [
        "from_pretrained",
        "save_pretrained",
        "generate",
        "gradient_checkpointing",
        "LayerStack",
        "stack_layers",
        "unstack",
        "split_stack",
        "run_layers",
        "KVCache",
        "LlamaConfig",
        "LlamaModel",
        "LlamaForCausalLM",
        "LlamaForSequenceClassification",
        "GPT2Config",
        "GPT2Model",
        "GPT2LMHeadModel",
        "GPT2ForSequenceClassification",
        "BertConfig",
        "BertModel",
        "BertForSequenceClassification",
        "BertForMaskedLM",
    ],
    peftx.implicit: [
        "ImplicitArray",
        "use_implicit_args",
        "primitive_handler",
        "default_handler",
        "materialization_policy",
        "strict",
        "is_implicit",
        "materialize",
        "materialize_all",
        "Transposed",
        "dense_base",
        "Slot",
        "is_template",
        "MaterializationPolicy",
        "MaterializationWarning",
        "MaterializationError",
        "HandlerOutputError",
        "HandlerRegistrationError",
        "assert_no_dense",
        "DenseWeightError",
        "UntestedVersionWarning",
        "UnsupportedVersionError",
    ],
    peftx.adapters: [
        "Zeros",
        "LoraArray",
        "DoraArray",
        "LoraEmbeddingArray",
        "IA3Array",
        "Int8Array",
        "NF4Array",
        "LoraInit",
        "lora",
        "dora",
        "lora_embedding",
        "ia3",
        "quantize_int8",
        "quantize_nf4",
        "merge",
        "unmerge",
        "with_dropout",
        "without_dropout",
        "AdapterSet",
        "adapter_set",
        "detach",
    ],
}


def test_public_names_exist():
    missing = [
        f"{m.__name__}.{n}" for m, names in PUBLIC.items() for n in names if not hasattr(m, n)
    ]
    assert not missing


def test_docs_and_inspect_name_every_adapter_table(capsys):
    """The job table of docs/command.md and `peftx inspect --help` name every tuner table a
    job takes (the registry's, `TOML_TABLES`)."""
    from peftx._config import TOML_TABLES

    page = (Path(__file__).parents[1] / "docs/command.md").read_text().splitlines()
    job_row = next(line for line in page if line.startswith("| `[lora]`"))
    with pytest.raises(SystemExit, match="0"):
        peftx.cli.main(["inspect", "--help"])
    inspect = " ".join(capsys.readouterr().out.split())
    assert len(TOML_TABLES) >= 7
    for table in TOML_TABLES:
        assert f"`[{table}]`" in job_row, table
        assert f"[{table}]" in inspect, table
