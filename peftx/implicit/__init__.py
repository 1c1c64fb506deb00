"""Implicit arrays: objects that stand for arrays, and the tracer that routes primitives
touching them to handlers."""

from .._errors import (
    DenseWeightError as DenseWeightError,
    HandlerOutputError as HandlerOutputError,
    HandlerRegistrationError as HandlerRegistrationError,
    MaterializationError as MaterializationError,
    MaterializationWarning as MaterializationWarning,
    UnsupportedVersionError as UnsupportedVersionError,
    UntestedVersionWarning as UntestedVersionWarning,
)
from ._core import (
    ImplicitArray as ImplicitArray,
    MaterializationPolicy as MaterializationPolicy,
    Slot as Slot,
    default_handler as default_handler,
    gate_rows as gate_rows,
    is_implicit as is_implicit,
    is_template as is_template,
    materialization_policy as materialization_policy,
    materialize as materialize,
    materialize_all as materialize_all,
    primitive_handler as primitive_handler,
    strict as strict,
    use_implicit_args as use_implicit_args,
)
from ._engine import outer_vmap_size as outer_vmap_size
from ._no_dense import assert_no_dense as assert_no_dense
from ._transposed import Transposed as Transposed, dense_base as dense_base
