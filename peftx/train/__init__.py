"""Training: `fit`, the loop `peftx finetune` runs, and what it is made of: the jitted
train and eval steps, their losses (supervised, and preference tuning: DPO, ORPO), data
to fixed-shape batches, checkpoints a run resumes from, and writers that mirror its
metrics to TensorBoard, Weights & Biases and MLflow."""

from ._checkpoints import (
    checkpoints as checkpoints,
    latest_checkpoint as latest_checkpoint,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._data import (
    IGNORE as IGNORE,
    batches_per_epoch as batches_per_epoch,
    check_vocab as check_vocab,
    encode_causal_lm as encode_causal_lm,
    encode_chat as encode_chat,
    encode_classification as encode_classification,
    encode_preference as encode_preference,
    eval_batches as eval_batches,
    mixed_batches as mixed_batches,
    pad_to as pad_to,
    share_prompts as share_prompts,
    supervised_tokens as supervised_tokens,
    train_batches as train_batches,
)
from ._fit import (
    OPTIMIZERS as OPTIMIZERS,
    SCHEDULES as SCHEDULES,
    FitResult as FitResult,
    fit as fit,
    make_optimizer as make_optimizer,
)
from ._preference import (
    DPO_LOSS_TYPES as DPO_LOSS_TYPES,
    dpo_loss as dpo_loss,
    orpo_loss as orpo_loss,
    precompute_ref_log_probs as precompute_ref_log_probs,
    reference_model as reference_model,
    sequence_log_probs as sequence_log_probs,
)
from ._records import (
    load_local_dataset as load_local_dataset,
    read_records as read_records,
    split_records as split_records,
)
from ._slots import (
    keep_untrained_slots as keep_untrained_slots,
    per_slot_mean as per_slot_mean,
    put_slots as put_slots,
    row_counts as row_counts,
    slot_counts as slot_counts,
    take_slots as take_slots,
)
from ._step import (
    TrainState as TrainState,
    causal_lm_loss as causal_lm_loss,
    classification_loss as classification_loss,
    init_state as init_state,
    logits as logits,
    make_eval_step as make_eval_step,
    make_train_step as make_train_step,
    summarize as summarize,
    trained_model as trained_model,
)
from ._writers import (
    MetricWriter as MetricWriter,
    MLflowWriter as MLflowWriter,
    TensorBoardWriter as TensorBoardWriter,
    WandbWriter as WandbWriter,
    mlflow_name as mlflow_name,
    scalars as scalars,
)
