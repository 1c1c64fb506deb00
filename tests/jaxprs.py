"""Walking traced programs, for tests that check what a handler never builds."""

import jax.extend.core as jexc


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
