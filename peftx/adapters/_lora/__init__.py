"""LoRA's family, one kind: `LoraConfig` and the arrays it builds (LoRA, DoRA, LoRA on an
embedding table, LoRA on a stack of experts)."""

from ._config import (
    LORA_HARMLESS as LORA_HARMLESS,
    LORA_KEYS as LORA_KEYS,
    LORA_TARGET_MODULES as LORA_TARGET_MODULES,
    PEFT_ONLY_LORA as PEFT_ONLY_LORA,
    LoraConfig as LoraConfig,
)
from ._corda import (
    CordaConfig as CordaConfig,
    corda_factors as corda_factors,
    sample_covariance as sample_covariance,
)
from ._dora import DoraArray as DoraArray, dora as dora
from ._embedding import (
    LoraEmbeddingArray as LoraEmbeddingArray,
    lora_embedding as lora_embedding,
)
from ._eva import EvaConfig as EvaConfig, eva_components as eva_components
from ._experts import (
    ExpertLoraArray as ExpertLoraArray,
    ExpertLoraInit as ExpertLoraInit,
    expert_lora as expert_lora,
)
from ._lora import (
    LoraArray as LoraArray,
    LoraInit as LoraInit,
    lora as lora,
    lora_dot as lora_dot,
    lora_update as lora_update,
    with_compute_dtype as with_compute_dtype,
)
from ._lora_ga import LoraGAConfig as LoraGAConfig, lora_ga_factors as lora_ga_factors
