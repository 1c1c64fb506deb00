import itertools

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A fresh PRNG key on each call."""
    counter = itertools.count()
    base = jax.random.key(0)
    return lambda: jax.random.fold_in(base, next(counter))
