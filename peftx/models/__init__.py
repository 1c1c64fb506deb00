"""HuggingFace architectures in Equinox, with transformers' module names, and their
checkpoints in and out."""

from ._bert import (
    BertConfig as BertConfig,
    BertForMaskedLM as BertForMaskedLM,
    BertForSequenceClassification as BertForSequenceClassification,
    BertLayer as BertLayer,
    BertModel as BertModel,
)
from ._checkpoint import (
    ARCHITECTURES as ARCHITECTURES,
    Architecture as Architecture,
    Reader as Reader,
    architecture as architecture,
    from_pretrained as from_pretrained,
    is_transposed as is_transposed,
    key_mapper as key_mapper,
    read_config as read_config,
    read_tensors as read_tensors,
    safetensors_header as safetensors_header,
    save_pretrained as save_pretrained,
)
from ._common import (
    BaseModelOutput as BaseModelOutput,
    CausalLMOutput as CausalLMOutput,
    KVCache as KVCache,
    MaskedLMOutput as MaskedLMOutput,
    SequenceClassifierOutput as SequenceClassifierOutput,
)
from ._gemma import (
    Gemma2Config as Gemma2Config,
    Gemma2ForCausalLM as Gemma2ForCausalLM,
    Gemma2ForSequenceClassification as Gemma2ForSequenceClassification,
    Gemma2Model as Gemma2Model,
    Gemma3ForCausalLM as Gemma3ForCausalLM,
    Gemma3TextConfig as Gemma3TextConfig,
    Gemma3TextForSequenceClassification as Gemma3TextForSequenceClassification,
    Gemma3TextModel as Gemma3TextModel,
)
from ._generate import (
    CAUSAL_LM_CLASSES as CAUSAL_LM_CLASSES,
    cache_dims as cache_dims,
    cache_sharding as cache_sharding,
    generate as generate,
    nucleus as nucleus,
    routed_forward as routed_forward,
)
from ._gpt2 import (
    GPT2MLP as GPT2MLP,
    GPT2Attention as GPT2Attention,
    GPT2Block as GPT2Block,
    GPT2Config as GPT2Config,
    GPT2ForSequenceClassification as GPT2ForSequenceClassification,
    GPT2LMHeadModel as GPT2LMHeadModel,
    GPT2Model as GPT2Model,
)
from ._llama import (
    LlamaConfig as LlamaConfig,
    LlamaForCausalLM as LlamaForCausalLM,
    LlamaForSequenceClassification as LlamaForSequenceClassification,
    LlamaModel as LlamaModel,
)
from ._phi3 import (
    Phi3Config as Phi3Config,
    Phi3ForCausalLM as Phi3ForCausalLM,
    Phi3ForSequenceClassification as Phi3ForSequenceClassification,
    Phi3Model as Phi3Model,
)
from ._stack import (
    LayerStack as LayerStack,
    gradient_checkpointing as gradient_checkpointing,
    run_layers as run_layers,
    split_stack as split_stack,
    stack_layers as stack_layers,
    unstack as unstack,
)
