import itertools
import warnings

import jax
import pytest

from peftx.implicit import MaterializationWarning

# A materialization nobody asked about is a bug; tests that expect one use `pytest.warns`.
warnings.filterwarnings("error", category=MaterializationWarning)

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A fresh PRNG key on each call."""
    counter = itertools.count()
    base = jax.random.key(0)
    return lambda: jax.random.fold_in(base, next(counter))
