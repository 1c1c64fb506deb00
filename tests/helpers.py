"""Helpers shared by the tests: comparing pytrees, walking traced programs."""

import jax
import jax.extend.core as jexc
import numpy as np


def close(a, b, tol=1e-5):
    """Assert two pytrees have the same leaves, each equal within `tol`."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def all_eqns(jaxpr):
    """Every equation of `jaxpr`, including those of the jaxprs nested in its params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jexc.ClosedJaxpr):
                    yield from all_eqns(sub.jaxpr)
                elif isinstance(sub, jexc.Jaxpr):
                    yield from all_eqns(sub)
