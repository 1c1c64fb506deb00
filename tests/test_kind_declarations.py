"""What each weight kind declares on its class holds for the arrays it builds: the fields
`weight_axes` names run along the weight axes it says (the sharding rules will read
them), the trained fields (`peft_keys`) are floating arrays, `merged` is the dense formula
written out here, and `num_parameters` is PEFT's count written out here."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

from peftx.adapters import (
    AbstractAdapter,
    AbstractWeight,
    AdapterSet,
    adapter_set,
    dora,
    expert_lora,
    gralora,
    hira,
    ia3,
    loha,
    lokr,
    lora,
    lora_embedding,
    miss,
    oft,
    quantize_int8,
    quantize_nf4,
    shira,
    vera,
    vera_projections,
)

OUT, IN, R = 6, 8, 3
EXPERTS = 4


def _weight(key, shape=(OUT, IN)):
    return jax.random.normal(key, shape)


def _random(adapter, key):
    """`adapter` with every trained field it holds redrawn, so no term of `merged` is
    zero."""
    fields = [f for f in type(adapter).peft_keys if getattr(adapter, f) is not None]
    keys = jax.random.split(key, len(fields))
    values = [
        jax.random.normal(k, getattr(adapter, f).shape, getattr(adapter, f).dtype)
        for k, f in zip(keys, fields)
    ]
    return eqx.tree_at(lambda a: [getattr(a, f) for f in fields], adapter, values)


@functools.cache
def _kinds():
    """name -> (array, stacking axes, dense formula of `merged(W)`, PEFT's parameter count:
    an adapter's trained arrays and its base weight's count)."""
    k = iter(jax.random.split(jax.random.key(0), 36))
    w = _weight(next(k))
    low = _random(lora(w, r=R, lora_alpha=5, key=next(k)), next(k))
    conv_w = _weight(next(k), (OUT, IN, 3, 3))
    conv = _random(lora(conv_w, r=R, lora_alpha=5, key=next(k)), next(k))
    decomposed = _random(dora(lora(w, r=R, lora_alpha=5, key=next(k))), next(k))
    out_scale = _random(ia3(w), next(k))
    in_scale = _random(ia3(w, feedforward=True), next(k))
    table = _random(lora_embedding(w, r=R, lora_alpha=5, key=next(k)), next(k))
    stacked_w = _weight(next(k), (2, OUT, IN))
    experts_w = _weight(next(k), (EXPERTS, OUT, IN))
    experts = _random(expert_lora(experts_w, r=R, lora_alpha=5, key=next(k)), next(k))
    hadamard = _random(loha(w, r=R, alpha=5, key=next(k)), next(k))
    kronecker = _random(lokr(w, r=1, alpha=5, decompose_both=True, key=next(k)), next(k))
    stacked = eqx.filter_vmap(lambda v, key: lora(v, r=R, lora_alpha=5, init="random", key=key))(
        stacked_w, jax.random.split(next(k), 2)
    )

    rotated = _random(oft(w, block_size=4), next(k))

    def oft_formula(v):
        # each block of 4 input features rotated by PEFT's 5-term Cayley-Neumann series
        rows, cols = np.triu_indices(4, 1)
        blocks = []
        for vec in rotated.oft_R:
            q = jnp.zeros((4, 4)).at[rows, cols].set(vec)
            q = q - q.T
            blocks.append(jnp.eye(4) + 2 * (q + q @ q + q @ q @ q) + q @ q @ q @ q)
        return v @ jax.scipy.linalg.block_diag(*blocks).T

    vera_A, vera_B = map(jnp.asarray, vera_projections(3, R, IN + 2, OUT + 1))
    shared = _random(vera(w, vera_A, vera_B), next(k))

    def vera_formula(v):
        a, b = shared.vera_A[:, :IN], shared.vera_B[:OUT]
        return v + shared.vera_lambda_b[:, None] * (b @ (shared.vera_lambda_d[:, None] * a))

    # IN = 8 in shards of R = 3: 3 + 3 + 2, the last padded
    shared_block = _random(miss(w, r=R), next(k))
    mini_block = _random(miss(w, r=R, mini_r=2, init_weights="mini"), next(k))
    bat_block = _random(miss(w, r=2, init_weights="bat"), next(k))

    def miss_formula(a):
        def formula(v):
            cols = np.arange(OUT) % a.miss_block.shape[1]
            return v + a.miss_block[np.arange(IN) % R][:, cols].T

        return formula

    def bat_formula(v):
        # each (2, 2) block of W: W_oi + W_oi·B_o + B_o
        b = bat_block.miss_block
        rows = [
            jnp.concatenate(
                [v[2 * o : 2 * o + 2, 2 * i : 2 * i + 2] @ b[o] + b[o] for i in range(IN // 2)],
                axis=1,
            )
            for o in range(OUT // 2)
        ]
        return v + jnp.concatenate(rows, axis=0)

    # R·(OUT + IN) = 42 of the 48 entries, at PEFT's random positions
    sparse = _random(shira(w, r=R), next(k))

    def shira_formula(v):
        d = np.zeros((OUT, IN), np.float32)
        for (i, j), x in zip(np.asarray(sparse.shira_indices).T, np.asarray(sparse.shira_weight)):
            d[i, j] += x
        return v + d

    # OUT = 2·3, IN = 2·4: k = 2 blocks of (3, 4), each rank 4 in sub-ranks of 2; the
    # hybrid part's rank is R
    blocks = _random(gralora(w, r=4, alpha=6, key=next(k)), next(k))
    hybrid = _random(gralora(w, r=4, hybrid_r=R, alpha=7, key=next(k)), next(k))

    def gralora_formula(a):
        def formula(v):
            rows = [
                jnp.concatenate(
                    [
                        (a.gralora_A[n][:, 2 * j : 2 * j + 2] @ a.gralora_B[j][2 * n : 2 * n + 2]).T
                        for n in range(2)
                    ],
                    axis=1,
                )
                for j in range(2)
            ]
            d = jnp.concatenate(rows, axis=0)
            if a.gralora_A_general is not None:
                d = d + a.gralora_B_general @ a.gralora_A_general
            return v + a.scaling * d

        return formula

    # W ⊙ (B·A): full rank from rank-R factors
    hadamard_low = _random(hira(w, r=R, key=next(k)), next(k))

    def low_rank(a):
        return a.scaling * a.lora_B @ a.lora_A

    def expert_formula(v):
        # PEFT's layouts: lora_A (R·E, in) expert-major, lora_B (out, R·E) expert-minor
        a = experts.lora_A.reshape(EXPERTS, R, IN)
        b = experts.lora_B.reshape(OUT, R, EXPERTS)
        return v + experts.scaling * jnp.einsum("ore,eri->eoi", b, a)

    def dora_formula(v):
        dense = v + low_rank(decomposed)
        return (
            decomposed.lora_magnitude_vector[:, None]
            * dense
            / jnp.linalg.norm(dense, axis=1)[:, None]
        )

    return {
        "lora": (low, 0, lambda v: v + low_rank(low), OUT * IN + R * (IN + OUT)),
        "lora conv": (
            conv,
            0,
            lambda v: (
                v + conv.scaling * jnp.einsum("or,rikl->oikl", conv.lora_B[:, :, 0, 0], conv.lora_A)
            ),
            OUT * IN * 9 + R * (IN * 9 + OUT),
        ),
        "dora": (decomposed, 0, dora_formula, OUT * IN + R * (IN + OUT) + OUT),
        "ia3 out": (out_scale, 0, lambda v: v * out_scale.ia3_l, OUT * IN + OUT),
        "ia3 in": (in_scale, 0, lambda v: v * in_scale.ia3_l, OUT * IN + IN),
        "lora embedding": (
            table,
            0,
            lambda v: v + table.scaling * (table.lora_embedding_B @ table.lora_embedding_A).T,
            OUT * IN + R * (OUT + IN),
        ),
        "stacked lora": (
            stacked,
            1,
            lambda v: v + stacked.scaling * stacked.lora_B @ stacked.lora_A,
            2 * (OUT * IN + R * (IN + OUT)),
        ),
        "expert lora": (
            experts,
            0,
            expert_formula,
            EXPERTS * OUT * IN + EXPERTS * R * (IN + OUT),
        ),
        "oft": (rotated, 0, oft_formula, OUT * IN + (IN // 4) * 6),
        # the shared projections are buffers to PEFT, not parameters
        "vera": (shared, 0, vera_formula, OUT * IN + OUT + R),
        "loha": (
            hadamard,
            0,
            lambda v: (
                v
                + 5
                / R
                * (hadamard.hada_w1_a @ hadamard.hada_w1_b)
                * (hadamard.hada_w2_a @ hadamard.hada_w2_b)
            ),
            OUT * IN + 2 * R * (OUT + IN),
        ),
        # OUT = 2·3, IN = 2·4: w1 (2, 2) whole, w2 (3, 4) factored at rank 1
        "lokr": (
            kronecker,
            0,
            lambda v: (
                v + 5 * jnp.kron(kronecker.lokr_w1, kronecker.lokr_w2_a @ kronecker.lokr_w2_b)
            ),
            OUT * IN + 2 * 2 + 3 + 4,
        ),
        "miss": (shared_block, 0, miss_formula(shared_block), OUT * IN + R * OUT),
        "miss mini": (mini_block, 0, miss_formula(mini_block), OUT * IN + R * 2),
        "miss bat": (bat_block, 0, bat_formula, OUT * IN + (OUT // 2) * 2 * 2),
        "shira": (sparse, 0, shira_formula, OUT * IN + R * (OUT + IN)),
        "gralora": (blocks, 0, gralora_formula(blocks), OUT * IN + 2 * 4 * 4 + 2 * 4 * 3),
        "gralora hybrid": (
            hybrid,
            0,
            gralora_formula(hybrid),
            OUT * IN + 2 * 4 * 4 + 2 * 4 * 3 + R * (IN + OUT),
        ),
        "hira": (
            hadamard_low,
            0,
            lambda v: v + v * (hadamard_low.hira_B @ hadamard_low.hira_A),
            OUT * IN + R * (IN + OUT),
        ),
        "nf4": (quantize_nf4(w), 0, None, OUT * IN),
        "int8": (quantize_int8(w), 0, None, OUT * IN),
        "adapter set": (adapter_set(w, {"a": low}, ("a",)), 0, None, OUT * IN + R * (IN + OUT)),
    }


KINDS = [
    "lora",
    "lora conv",
    "dora",
    "ia3 out",
    "ia3 in",
    "lora embedding",
    "stacked lora",
    "expert lora",
    "oft",
    "vera",
    "loha",
    "lokr",
    "miss",
    "miss mini",
    "miss bat",
    "shira",
    "gralora",
    "gralora hybrid",
    "hira",
    "nf4",
    "int8",
    "adapter set",
]


def test_every_kind_is_checked():
    assert set(KINDS) == set(_kinds())


@pytest.mark.parametrize("name", KINDS)
def test_weight_axes_follow_the_weight(name):
    array, stack, _, _ = _kinds()[name]
    assert isinstance(array, AbstractWeight)
    shape = tuple(array.shape)[stack:]
    for field, axes in type(array).weight_axes.items():
        value = getattr(array, field)
        if value is None:
            continue  # an optional part (NF4's nested scales without double quantization)
        own = value.shape[stack:]
        assert value.shape[:stack] == tuple(array.shape)[:stack], field
        if len(own) == 1 and len(shape) > 1 and axes == (0,) and own[0] != shape[0]:
            continue  # a row-major flattening (NF4's codes and block scales)
        assert len(axes) <= len(own), field
        for i, j in enumerate(axes):
            if j is not None:
                assert own[i] in (shape[j], 1), (field, i, j, own, shape)
            else:
                # the only own axis here: the rank (times the experts, for an expert stack)
                assert own[i] in (R, R * EXPERTS), (field, i, own)


@pytest.mark.parametrize("name", [n for n in KINDS if n not in ("nf4", "int8", "adapter set")])
def test_trained_fields_and_merged_formula(name):
    array, stack, formula, _ = _kinds()[name]
    assert isinstance(array, AbstractAdapter)
    keys = type(array).peft_keys
    assert len(set(keys.values())) == len(keys)
    held = [f for f in keys if getattr(array, f) is not None]
    assert held
    for field in held:
        assert jnp.issubdtype(getattr(array, field).dtype, jnp.floating), field
    close(array.merged(array.weight), formula(array.weight), tol=1e-5)
    assert not np.allclose(array.merged(array.weight), array.weight, atol=1e-3)


@pytest.mark.parametrize("name", KINDS)
def test_num_parameters_is_peft_count(name):
    array, _, _, count = _kinds()[name]
    assert array.num_parameters() == count


def test_adapter_set_counts_its_adapters_not_kept_statistics():
    w = _weight(jax.random.key(4))
    d = dora(lora(w, r=R, lora_alpha=5, key=jax.random.key(5)))
    s = adapter_set(w, {"a": d, "b": ia3(w)}, ("a",))
    assert isinstance(s, AdapterSet)
    assert s.num_parameters() == OUT * IN + R * (IN + OUT) + OUT + OUT
    assert math.prod(d.weight_sq_norm.shape) == OUT  # kept, not counted
