"""Dropout in training: every adapter (or bank) whose class declares `draws_dropout` holds
a key of its own, set for a step with `with_dropout` and cleared with `without_dropout`."""

from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .._kind import AbstractWeight
from ._products import LayerKeys


def _draws_dropout(x: Any) -> bool:
    return isinstance(x, AbstractWeight) and x.draws_dropout


def _set_key(x: Any, key: LayerKeys | None) -> Any:
    return eqx.tree_at(lambda m: m.dropout_key, x, key, is_leaf=lambda n: n is None)


def with_dropout(tree: Any, key: PRNGKeyArray) -> Any:
    """Give every adapter in `tree` a fresh dropout key (training mode).

    Call it inside the jitted loss with a new key each step. It reaches the adapters of
    an `AdapterSet` (so of a `PeftModel`) too. An adapter stacked over layers (with
    `eqx.filter_vmap`) gets one key per layer, so `jax.lax.scan` or `jax.vmap` over the
    stack gives each layer its own mask. Under `jax.vmap` over examples, the adapters see
    one example at a time and share the mask unless the keys are batched too; see the
    README.
    """
    adapters = [x for x in jax.tree.leaves(tree, is_leaf=_draws_dropout) if _draws_dropout(x)]
    keys = list(jax.random.split(key, max(len(adapters), 1)))

    def keyed(x: Any) -> Any:
        # a stack of layers gets a key per layer: `lax.scan` and `jax.vmap` slice one each
        return _set_key(x, jax.random.split(keys.pop(), x.weight.shape[: x.stack_ndim]))

    return jax.tree.map(
        lambda x: keyed(x) if _draws_dropout(x) else x, tree, is_leaf=_draws_dropout
    )


def without_dropout(tree: Any) -> Any:
    """Remove every adapter's dropout key (inference mode)."""
    return jax.tree.map(
        lambda x: _set_key(x, None) if _draws_dropout(x) else x, tree, is_leaf=_draws_dropout
    )
