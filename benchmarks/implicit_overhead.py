"""What implicit arrays cost: compile time and run time of a LoRA MLP against a dense one.

A 12-layer MLP (width 256, batch 64; then width 1024, batch 512) whose every weight is a
`peftx.adapters.lora` array (rank 8, alpha 16, both factors random, so the adapter path is
not all zeros), against the same MLP with the merged dense weights. Everything runs under
`strict()`, so the implicit timings are of the handler path, never of a materialized
weight.

Run with `make bench`.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import peftx
from peftx.implicit import use_implicit_args

LAYERS, RANK, ALPHA = 12, 8, 16
SIZES = [(256, 64), (1024, 512)]  # (width, batch)
COMPILE_REPEATS, WARMUP, CALLS = 7, 5, 50


def compile_seconds(make_fn: Callable[[], Callable], *args: Any) -> tuple[float, float]:
    """Median (trace + lower, compile) wall times, each run on a fresh function."""
    lowers, compiles = [], []
    for _ in range(COMPILE_REPEATS):
        jax.clear_caches()  # so nothing traced or compiled before is reused
        fn = jax.jit(make_fn())
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        lowers.append(t1 - t0)
        compiles.append(t2 - t1)
    return statistics.median(lowers), statistics.median(compiles)


def call_seconds(fn: Callable, *args: Any) -> float:
    """Median wall time of one call, after warm-up."""
    for _ in range(WARMUP):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(width: int, batch: int) -> None:
    mlp_key, lora_key, x_key = jax.random.split(jax.random.key(0), 3)
    mlp = eqx.nn.MLP(width, width, width, depth=LAYERS - 1, key=mlp_key)
    lora = eqx.tree_at(
        lambda m: [layer.weight for layer in m.layers],
        mlp,
        [
            peftx.adapters.lora(layer.weight, r=RANK, lora_alpha=ALPHA, init="random", key=k)
            for layer, k in zip(mlp.layers, jax.random.split(lora_key, LAYERS))
        ],
    )
    dense = eqx.tree_at(
        lambda m: [layer.weight for layer in m.layers],
        lora,
        [layer.weight.materialize() for layer in lora.layers],
    )
    # `jax.jit` takes arrays only: the activation functions stay outside, closed over.
    lora_params, static = eqx.partition(lora, eqx.is_array)
    dense_params, _ = eqx.partition(dense, eqx.is_array)
    x = jax.random.normal(x_key, (batch, width))

    def make_f() -> Callable:
        return lambda params, x: jax.vmap(eqx.combine(params, static))(x)

    f = make_f()
    runs = {
        "jax.jit(use_implicit_args(f))": (jax.jit(use_implicit_args(f)), lora_params),
        "use_implicit_args(jax.jit(f))": (use_implicit_args(jax.jit(f)), lora_params),
        "jax.jit(f), dense weights": (jax.jit(f), dense_params),
    }
    with peftx.implicit.strict():
        ref = jax.vmap(dense)(x)
        for name, (fn, params) in runs.items():
            err = float(jnp.max(jnp.abs(fn(params, x) - ref)))
            if err > 1e-4:
                raise SystemExit(f"{name} differs from the dense MLP by {err:.2e}")

        implicit_compile = compile_seconds(lambda: use_implicit_args(make_f()), lora_params, x)
        dense_compile = compile_seconds(make_f, dense_params, x)
        per_call = {name: call_seconds(fn, params, x) for name, (fn, params) in runs.items()}

    print(
        f"MLP: {LAYERS} layers, width {width}, batch {batch}, LoRA rank {RANK}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{COMPILE_REPEATS} compiles / {CALLS} calls, medians.\n"
    )
    print("| compile | trace + lower (ms) | XLA compile (ms) | total (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    base_total = sum(dense_compile)
    for name, (lower, comp) in [
        ("jax.jit(use_implicit_args(f))", implicit_compile),
        ("jax.jit(f), dense weights", dense_compile),
    ]:
        total = lower + comp
        print(
            f"| `{name}` | {1e3 * lower:.1f} | {1e3 * comp:.1f} | {1e3 * total:.1f} "
            f"| {total / base_total:.2f}x |"
        )
    print("\nratio: against dense `jax.jit(f)`.\n")

    print("| run | time per call (us) | ratio |")
    print("|---|---:|---:|")
    base_call = per_call["jax.jit(use_implicit_args(f))"]
    for name, seconds in per_call.items():
        print(f"| `{name}` | {1e6 * seconds:.1f} | {seconds / base_call:.2f}x |")
    print("\nratio: against `jax.jit(use_implicit_args(f))`.")


def main() -> None:
    for width, batch in SIZES:
        run(width, batch)
        print()


if __name__ == "__main__":
    main()
