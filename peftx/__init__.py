"""peftx: parameter-efficient fine-tuning for JAX and Equinox."""

from . import adapters as adapters, implicit as implicit, models as models, train as train
from ._bank import PeftBankModel as PeftBankModel, SlotTable as SlotTable
from ._config import (
    FINITE as FINITE,
    PROBABILITY as PROBABILITY,
    RANK as RANK,
    AbstractAdapterConfig as AbstractAdapterConfig,
    AdaptedLayer as AdaptedLayer,
    Range as Range,
    field as field,
    from_toml as from_toml,
    load_config as load_config,
    save_config as save_config,
)
from ._errors import (
    CheckpointError as CheckpointError,
    ConfigFileError as ConfigFileError,
    RunFailed as RunFailed,
    TargetNotFoundError as TargetNotFoundError,
    UnknownAdapterError as UnknownAdapterError,
    UnsupportedTargetError as UnsupportedTargetError,
)
from ._initialize import initialize_lora as initialize_lora
from ._peft_model import (
    BASE as BASE,
    PeftModel as PeftModel,
    get_peft_model as get_peft_model,
    partition as partition,
)
from ._quantize import (
    QuantizationConfig as QuantizationConfig,
    quantize_model as quantize_model,
)
from ._select import (
    Predicate as Predicate,
    Selection as Selection,
    dotted as dotted,
    in_layers as in_layers,
    layer_index as layer_index,
    layer_span as layer_span,
    named as named,
    of_type as of_type,
    path_glob as path_glob,
    path_regex as path_regex,
    peft_targets as peft_targets,
    require_matches as require_matches,
    select as select,
    where as where,
    with_ndim as with_ndim,
    with_shape as with_shape,
)
from ._targets import (
    Targets as Targets,
    targets as targets,
)
from ._version import __version__ as __version__
from .adapters import (
    AdaLoraConfig as AdaLoraConfig,
    CordaConfig as CordaConfig,
    EvaConfig as EvaConfig,
    GraloraConfig as GraloraConfig,
    HiraConfig as HiraConfig,
    IA3Config as IA3Config,
    LilyConfig as LilyConfig,
    LoHaConfig as LoHaConfig,
    LoKrConfig as LoKrConfig,
    LoraConfig as LoraConfig,
    LoraGAConfig as LoraGAConfig,
    MissConfig as MissConfig,
    OFTConfig as OFTConfig,
    ShiraConfig as ShiraConfig,
    VeraConfig as VeraConfig,
)
from .implicit import (
    ImplicitArray as ImplicitArray,
    use_implicit_args as use_implicit_args,
)
from .models import (
    from_pretrained as from_pretrained,
    generate as generate,
    save_pretrained as save_pretrained,
)
