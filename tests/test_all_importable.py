"""Every public name is importable from where the README says it is."""

import peftx
import peftx.adapters
import peftx.implicit

PUBLIC = {
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
        "Slot",
        "is_template",
        "MaterializationPolicy",
        "MaterializationWarning",
        "MaterializationError",
        "HandlerOutputError",
        "HandlerRegistrationError",
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
