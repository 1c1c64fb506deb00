"""Adapters and structured weights, each an implicit array with its handlers."""

from ._adalora import (
    AdaLoraArray as AdaLoraArray,
    RankAllocator as RankAllocator,
    adalora as adalora,
    orthogonality_penalty as orthogonality_penalty,
)
from ._dora import DoraArray as DoraArray, dora as dora
from ._embedding import (
    LoraEmbeddingArray as LoraEmbeddingArray,
    lora_embedding as lora_embedding,
)
from ._experts import (
    ExpertLoraArray as ExpertLoraArray,
    ExpertLoraInit as ExpertLoraInit,
    expert_lora as expert_lora,
)
from ._ia3 import IA3Array as IA3Array, ia3 as ia3
from ._kind import (
    AbstractAdapter as AbstractAdapter,
    AbstractTrainHook as AbstractTrainHook,
    AbstractWeight as AbstractWeight,
)
from ._loha import LoHaArray as LoHaArray, loha as loha
from ._lokr import (
    LoKrArray as LoKrArray,
    LoKrInit as LoKrInit,
    factorization as factorization,
    lokr as lokr,
)
from ._lora import (
    LoraArray as LoraArray,
    LoraInit as LoraInit,
    lora as lora,
    unmerge as unmerge,
    with_compute_dtype as with_compute_dtype,
    with_dropout as with_dropout,
    without_dropout as without_dropout,
)
from ._merge import merge as merge
from ._oft import OFTArray as OFTArray, oft as oft
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
from ._vera import (
    VeraArray as VeraArray,
    vera as vera,
    vera_projections as vera_projections,
)
from ._zeros import Zeros as Zeros
