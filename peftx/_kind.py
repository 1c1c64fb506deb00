"""What every weight kind declares on its class: how its arrays follow the axes of the
weight it stands for, and, for an adapter, what it trains, how PEFT names it on disk and
what dense weight it merges to. The PEFT layer (saving, loading, `partition`, counting,
merging) and sharding read these declarations; no table outside the class lists them."""

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
from jaxtyping import Array

from .implicit import ImplicitArray, materialize


class AbstractWeight(ImplicitArray):
    """An implicit array that stands for a weight (a layer's kernel or table).

    `weight_axes` maps each array field to the axis of the represented weight that each of
    the field's own axes runs along, or `None` for an axis of its own (a LoRA rank). Axes
    are counted after any leading stacking axes (layers stacked by `eqx.filter_vmap`),
    which every field shares; a field's axes beyond those listed, and any of length 1,
    follow nothing. A field that flattens the weight row-major (NF4's packed codes) lists
    axis 0: its one axis splits as the weight's rows do. Sharding places each field by
    this map, so a new kind declares it once here.

    `draws_dropout`: whether it draws dropout in training from a `dropout_key` field of
    its own (`with_dropout` sets it, `without_dropout` clears it).
    """

    weight_axes: eqx.AbstractClassVar[Mapping[str, tuple[int | None, ...]]]
    draws_dropout: ClassVar[bool] = False

    def num_parameters(self) -> int:
        """Its parameters as PEFT counts them (`print_trainable_parameters`): by default
        the floating arrays of its fields, an inner weight by its own count."""
        return count_parameters([getattr(self, f.name) for f in dataclasses.fields(self)])


class AbstractAdapter(AbstractWeight):
    """An adapter: a base `weight` (dense or implicit) and trained arrays on top of it.

    Subclasses declare

    - `peft_keys`: each trained field and PEFT's name for its tensor after the module path
      (`"lora_A" -> "lora_A.weight"`); the fields `partition` trains and `save_pretrained`
      writes, in this order. A field may be None in an adapter whose layout lacks it
      (LoKr's `lokr_w1` when the factor is itself factored): it is neither trained nor
      written. One an instance holds fixed is named by its `frozen_keys()`;
    - `file_transposed`: the trained fields PEFT stores transposed relative to ours (none
      of the kinds here: their layouts are PEFT's);
    - `shared_keys`: frozen fields that every layer of one adapter holds alike (VeRA's
      projections), and PEFT's names for them, saved once beside the layers' tensors
      (`base_model.vera_A`) where the config asks (`saves_shared`);
    - `index_keys`: frozen integer fields each layer holds (SHiRA's index set) and PEFT's
      names for them, saved beside the trained tensors and read back from the file;
    - `rank_axes`: the trained fields whose rank axis (given) PEFT's file holds only the
      ranks the config keeps (AdaLoRA's `rank_pattern`; see the config's `kept_ranks`);
    - `weight_axes` (see `AbstractWeight`);
    - `draws_dropout` (see `AbstractWeight`);

    and implement `merged(weight)`, the dense weight the adapter stands for on a dense
    base `weight`: `materialize()` and `merge` use it, so the dense update is declared in
    one place. A kind may also say how the layer's bias changes (`bias_scale`) and how
    `add_weighted_adapter` combines adapters of its class (`weighted`).
    """

    weight: eqx.AbstractVar[Any]
    peft_keys: eqx.AbstractClassVar[Mapping[str, str]]
    file_transposed: ClassVar[frozenset[str]] = frozenset()
    shared_keys: ClassVar[Mapping[str, str]] = {}
    index_keys: ClassVar[Mapping[str, str]] = {}
    rank_axes: ClassVar[Mapping[str, int]] = {}

    @abc.abstractmethod
    def merged(self, weight: Array) -> Array:
        """The dense weight this adapter stands for, on the dense base `weight`."""

    def materialize(self) -> Array:
        return self.merged(materialize(self.weight))

    def for_layers(self) -> "AbstractAdapter":
        """This adapter as a run of its stack's layers reads it: every array with one row
        per layer along the leading axis, as `lax.scan` slices it. A kind whose layers
        share a trained array (Lily) stores it once, one parameter with one gradient, and
        spreads it here inside the traced step, so the rows' gradients sum into it.
        Itself for most kinds."""
        return self

    def layer_rows(self, field: str) -> tuple[int, ...] | None:
        """For a stacked adapter, the row of `field` that each layer's file key holds, in
        layer order, where layers share rows (see `for_layers`); None for one row per
        layer."""
        return None

    def frozen_keys(self) -> frozenset[str]:
        """The `peft_keys` fields this adapter saves but does not train (PEFT's
        `frozen_peft_weight_names`: MiCA's `lora_B`); none by default."""
        return frozenset()

    def num_parameters(self) -> int:
        """The trained fields' sizes and the base weight's count (kept statistics, such
        as DoRA's base norms, are not parameters; PEFT has no such tensors)."""
        trained = [getattr(self, name) for name in self.peft_keys]
        return count_parameters([*trained, self.weight])

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def bias_scale(self) -> Array | None:
        """What the layer's bias is multiplied by while this adapter is active, or None
        (IA3 scales a layer's whole output, bias included, as PEFT does)."""
        return None

    def grouped_update(
        self, primitive: Any, x: Array, group_sizes: Array, params: Mapping[str, Any]
    ) -> Any:
        """The update this adapter adds to a grouped product (`ragged_dot_general` of
        `x`'s rows with an expert stack, `params` its parameters), without the base
        product; NotImplemented where the kind has none, as most kinds (a mixed batch
        over expert stacks needs it)."""
        return NotImplemented

    @classmethod
    def weighted(
        cls, present: Sequence[tuple["AbstractAdapter", float]], combination_type: str, config: Any
    ) -> "AbstractAdapter":
        """`add_weighted_adapter`'s combination of `(adapter, weight)` pairs of this class,
        each on the shared base, for the combined `config` (the config's `combined`)."""
        raise ValueError(f"{cls.__name__} adapters cannot be combined.")


class AbstractTrainHook(eqx.Module):
    """What an adapter kind does in every train step besides following the gradient
    (AdaLoRA's rank allocator). Its config's `train_hook` makes it; `peftx.train` carries
    it in the `TrainState` and calls it in each step, so no training loop built on
    `make_train_step` can leave it out. It holds its own state as arrays (a pytree)."""

    adapter_name: eqx.AbstractVar[str]

    @abc.abstractmethod
    def penalty(self, trainable: Any) -> Array:
        """A scalar added to the mean loss of the step (its gradient flows)."""

    @abc.abstractmethod
    def update(self, trainable: Any, grads: Any, step: Array) -> tuple[Any, "AbstractTrainHook"]:
        """After the optimizer's update at `step` (counted from 0), given that step's
        gradients: the trainable half and this hook, both updated."""

    @abc.abstractmethod
    def config_changes(self, layer_paths: Sequence[str]) -> dict[str, Any]:
        """What the run learned that the adapter's config records (AdaLoRA's
        `rank_pattern`), given the per-layer module paths of its layers in tree order."""


def count_parameters(tree: Any) -> int:
    """Parameters in `tree` as PEFT counts them: floating arrays by their size, each
    implicit weight by its `num_parameters()` (a 4-bit weight as two values per stored
    byte, an adapter by its trained arrays)."""

    def is_weight(x: Any) -> bool:
        return isinstance(x, AbstractWeight)

    def size(x: Any) -> int:
        if is_weight(x):
            return x.num_parameters()
        return x.size if eqx.is_inexact_array(x) else 0

    return sum(size(x) for x in jax.tree.leaves(tree, is_leaf=is_weight))


def trained_fields(adapter: AbstractAdapter) -> tuple[str, ...]:
    """The fields of `adapter` that train, as its class declares them (those it holds and
    does not keep frozen)."""
    frozen = adapter.frozen_keys()
    return tuple(
        f for f in type(adapter).peft_keys if getattr(adapter, f) is not None and f not in frozen
    )
