"""What quantized weights cost: a 4096x4096 linear layer at 16 and 1024 tokens.

Every variant runs the idiomatic Equinox form, `jax.vmap(lambda v: w @ v)(x)`, jitted:
the fp32 weight; `NF4Array` and `Int8Array` weights through their `dot_general` handler
(in strict mode, so never a fallback materialization); and, for comparison, the naive
`materialize()` of the whole weight followed by the fp32 matmul in the same jit. Calls are
interleaved round-robin and the medians reported, so drifting machine load hits every
variant alike. Then the storage of each format, in bytes per parameter.

Run with `python benchmarks/quantized_matmul.py` (about a minute on 2 CPU cores).
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from peftx.adapters import quantize_int8, quantize_nf4
from peftx.implicit import strict, use_implicit_args

SIZE = 4096
TOKENS = {16: 40, 1024: 11}  # tokens: round-robin repetitions


def forward(w: Any, x: jax.Array) -> jax.Array:
    return jax.vmap(lambda v: w @ v)(x)


def naive(w: Any, x: jax.Array) -> jax.Array:
    return forward(w.materialize(), x)


def medians(runs: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each run, measured round-robin after a warm-up."""
    for fn, args in runs.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (fn, args) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    w_key, x_key = jax.random.split(jax.random.key(0))
    weight = jax.random.normal(w_key, (SIZE, SIZE)) / SIZE**0.5
    nf4 = quantize_nf4(weight)
    nf4_dq = quantize_nf4(weight, double_quant=True)
    int8 = quantize_int8(weight)
    implicit = jax.jit(use_implicit_args(forward))
    variants = {
        "fp32 matmul": (jax.jit(forward), weight),
        "NF4, handler (chunked dequantize + matmul)": (implicit, nf4),
        "NF4 + double quant, handler": (implicit, nf4_dq),
        "NF4, naive (materialize whole weight, then matmul)": (jax.jit(naive), nf4),
        "int8, handler": (implicit, int8),
        "int8, naive": (jax.jit(naive), int8),
    }
    results = {}
    with strict():
        for tokens, repeats in TOKENS.items():
            x = jax.random.normal(x_key, (tokens, SIZE))
            for name, (fn, w) in variants.items():
                if w is not weight:
                    err = float(jnp.max(jnp.abs(fn(w, x) - forward(w.materialize(), x))))
                    if err > 1e-3:
                        raise SystemExit(f"{name} differs from its dense product by {err:.2e}")
            runs = {name: (fn, (w, x)) for name, (fn, w) in variants.items()}
            results[tokens] = medians(runs, repeats)

    print(
        f"Linear layer {SIZE}x{SIZE}, x of shape (tokens, {SIZE}), fp32 activations; "
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} device, "
        f"medians of {', '.join(f'{r} calls at {t} tokens' for t, r in TOKENS.items())}.\n"
    )
    header = " | ".join(f"{t} tokens (ms) | vs fp32" for t in TOKENS)
    print(f"| weight | {header} |")
    print("|---|" + "---:|---:|" * len(TOKENS))
    for name in variants:
        cells = []
        for tokens in TOKENS:
            seconds, base = results[tokens][name], results[tokens]["fp32 matmul"]
            cells.append(f"{1e3 * seconds:.1f} | {seconds / base:.2f}x")
        print(f"| {name} | {' | '.join(cells)} |")

    params = weight.size
    storage = {
        "fp32": 4 * params,
        "bf16": 2 * params,
        "int8 (codes + one fp32 scale per row)": int8.nbytes,
        "NF4 (blocksize 64)": nf4.nbytes,
        "NF4 + double quant": nf4_dq.nbytes,
    }
    print(f"\n| storage of a {SIZE}x{SIZE} weight | bytes/param | bits/param |")
    print("|---|---:|---:|")
    for name, nbytes in storage.items():
        print(f"| {name} | {nbytes / params:.4f} | {8 * nbytes / params:.3f} |")


if __name__ == "__main__":
    main()
