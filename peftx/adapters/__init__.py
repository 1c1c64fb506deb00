"""Adapters and structured weights, each an implicit array with its handlers; each adapter
kind's module holds its config class too."""

from .._kind import (
    AbstractAdapter as AbstractAdapter,
    AbstractTrainHook as AbstractTrainHook,
    AbstractWeight as AbstractWeight,
)
from ._adalora import (
    AdaLoraArray as AdaLoraArray,
    AdaLoraConfig as AdaLoraConfig,
    RankAllocator as RankAllocator,
    adalora as adalora,
    orthogonality_penalty as orthogonality_penalty,
)
from ._bank import (
    AbstractLoraBank as AbstractLoraBank,
    ExpertLoraBank as ExpertLoraBank,
    LoraBank as LoraBank,
)
from ._dropout import with_dropout as with_dropout, without_dropout as without_dropout
from ._gralora import (
    GraloraArray as GraloraArray,
    GraloraConfig as GraloraConfig,
    gralora as gralora,
)
from ._hira import HiraArray as HiraArray, HiraConfig as HiraConfig, hira as hira
from ._ia3 import IA3Array as IA3Array, IA3Config as IA3Config, ia3 as ia3
from ._lily import LilyArray as LilyArray, LilyConfig as LilyConfig, lily as lily
from ._loha import LoHaArray as LoHaArray, LoHaConfig as LoHaConfig, loha as loha
from ._lokr import (
    LoKrArray as LoKrArray,
    LoKrConfig as LoKrConfig,
    LoKrInit as LoKrInit,
    factorization as factorization,
    lokr as lokr,
)
from ._lora import (
    CordaConfig as CordaConfig,
    DoraArray as DoraArray,
    EvaConfig as EvaConfig,
    ExpertLoraArray as ExpertLoraArray,
    ExpertLoraInit as ExpertLoraInit,
    LoraArray as LoraArray,
    LoraConfig as LoraConfig,
    LoraEmbeddingArray as LoraEmbeddingArray,
    LoraGAConfig as LoraGAConfig,
    LoraInit as LoraInit,
    corda_factors as corda_factors,
    dora as dora,
    eva_components as eva_components,
    expert_lora as expert_lora,
    lora as lora,
    lora_embedding as lora_embedding,
    lora_ga_factors as lora_ga_factors,
    sample_covariance as sample_covariance,
    with_compute_dtype as with_compute_dtype,
)
from ._merge import merge as merge, unmerge as unmerge
from ._miss import MissArray as MissArray, MissConfig as MissConfig, miss as miss
from ._oft import OFTArray as OFTArray, OFTConfig as OFTConfig, oft as oft
from ._quantized import (
    Int8Array as Int8Array,
    NF4Array as NF4Array,
    quantize_int8 as quantize_int8,
    quantize_nf4 as quantize_nf4,
)
from ._set import (
    AdapterSet as AdapterSet,
    adapter_set as adapter_set,
    detach as detach,
)
from ._shira import (
    ShiraArray as ShiraArray,
    ShiraConfig as ShiraConfig,
    random_indices as random_indices,
    shira as shira,
)
from ._vera import (
    VeraArray as VeraArray,
    VeraConfig as VeraConfig,
    vera as vera,
    vera_projections as vera_projections,
)
from ._zeros import Zeros as Zeros
