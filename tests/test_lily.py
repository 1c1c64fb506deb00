"""Lily against a dense formula written out here and against HF PEFT 0.21.2 in PyTorch:
one layer's outputs and gradients (float32, and a bfloat16 base with float32 factors),
files both ways on a tiny stacked Llama (the shared factors written under every layer's
key, as PEFT writes them), gradients of every factor (one per shared factor), no dense
update in a training step, forward mode, the refusals (unrolled layout, merge), and a
`[lily]` job whose adapter PEFT reads.

Lily's router averages over every token of the batch, padding included, and the two
frameworks leave different values at padded positions: the batches here are unpadded."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from helpers import close
from safetensors.numpy import load_file
from test_peft_interop import (
    WEIGHTS,
    assert_job_adapter_reads_in_peft,
    assert_layer_matches_peft,
    assert_same,
    assert_same_files,
    assert_step_builds_no_dense_and_jvp,
    jax_out,
    randomized,
    torch_base,
    torch_out,
)

import peftx
from peftx.adapters import LilyArray, lily
from peftx.implicit import strict, use_implicit_args

OUT, IN, R, NUM_B = 8, 12, 4, 3
FIELDS = ("lily_A", "lily_B", "lily_router")


def _dense_update(a, x):
    """PEFT's forward written out for one layer: `scaling · h·Σ_e p_e B_e`."""
    h = x @ a.lily_A.T
    p = jax.nn.softmax(h @ a.lily_router.T, axis=-1).reshape(-1, a.num_B).mean(0)
    b = a.lily_B.reshape(a.num_B, -1, a.lily_B.shape[-1])
    return a.scaling * h @ jnp.einsum("e,eio->io", p, b)


def _with(a, values):
    return eqx.tree_at(lambda a: [getattr(a, f) for f in FIELDS], a, list(values))


def test_matches_dense_formula_and_jvp(getkey):
    """Values, gradients of every factor and of `x`, and jvp against the formula; the
    update moves the output; `merged` refuses (no dense weight)."""
    w = jax.random.normal(getkey(), (OUT, IN)) / 4
    a = lily(w, r=R, num_B=NUM_B, scaling=0.7, init_weights=False, key=getkey())
    x = jax.random.normal(getkey(), (2, 3, IN))
    factors = [getattr(a, f) for f in FIELDS]

    def loss(factors, x, implicit):
        b = _with(a, factors)
        if implicit:
            return jnp.sum(jnp.sin(use_implicit_args(lambda b, x: x @ b.T)(b, x)))
        return jnp.sum(jnp.sin(x @ w.T + _dense_update(b, x)))

    with strict():
        got = jax.jit(use_implicit_args(lambda b, x: x @ b.T))(a, x)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(factors, x, True)
        tangent = [jax.random.normal(getkey(), f.shape) for f in factors]
        _, jvp = jax.jit(lambda t: jax.jvp(lambda f: loss(f, x, True), (factors,), (t,)))(tangent)
    close(got, x @ w.T + _dense_update(a, x), tol=1e-5)
    assert not np.allclose(got, x @ w.T, atol=1e-2)
    close(grads, jax.grad(loss, argnums=(0, 1))(factors, x, False), tol=1e-4)
    _, want = jax.jvp(lambda f: loss(f, x, False), (factors,), (tangent,))
    close(jvp, want, tol=1e-4)
    with pytest.raises(ValueError, match="Lily has no dense weight"):
        a.merged(w)


def test_stack_shares_one_factor_per_block(getkey):
    """A stack `(L, out, in)` stores `lily_A` once per block of `stride_A` layers and
    `lily_B` once; run by `lax.scan` after `for_layers`, each layer computes the formula
    with its block's factors, and the gradient of a shared factor is the sum of its
    layers'."""
    weights = jax.random.normal(getkey(), (5, IN, IN)) / 4
    a = lily(weights, r=R, num_B=NUM_B, stride_A=2, init_weights=False, key=getkey())
    assert a.lily_A.shape == (3, R, IN) and a.lily_B.shape == (1, NUM_B * R, IN)
    assert a.lily_router.shape == (5, NUM_B, R)
    assert a.layer_rows("lily_A") == (0, 0, 1, 1, 2) and a.layer_rows("lily_B") == (0,) * 5
    x = jax.random.normal(getkey(), (4, IN))

    def scanned(factors):
        layers = _with(a, factors).for_layers()
        step = use_implicit_args(lambda h, w: (jnp.tanh(h @ w.T), None))
        return jnp.sum(jax.lax.scan(step, x, layers)[0] ** 2)

    def dense(factors):
        stacked = _with(a, factors)
        h = x
        for i in range(5):
            layer = LilyArray(
                weights[i],
                stacked.lily_A[i // 2],
                stacked.lily_B[0],
                stacked.lily_router[i],
                stride_A=2,
            )
            h = jnp.tanh(h @ weights[i].T + _dense_update(layer, h))
        return jnp.sum(h**2)

    factors = [getattr(a, f) for f in FIELDS]
    with strict():
        got, grads = jax.jit(jax.value_and_grad(scanned))(factors)
    want, want_grads = jax.value_and_grad(dense)(factors)
    close((got, grads), (want, want_grads), tol=1e-4)


# ---------------------------------------------------------------- one layer against PEFT


class _Torch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT)


class _Proj(eqx.Module):
    proj: eqx.nn.Linear

    def __call__(self, x):
        # one product over every token, as the zoo's models apply a Linear
        return x @ self.proj.weight.T + self.proj.bias[None, None]


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16 base", marks=pytest.mark.variant_sweep)]
)
def test_layer_matches_peft(dtype):
    """The output and the gradients of every factor and of the input equal PEFT's for
    the same weights and loss; a bfloat16 base keeps float32 factors and gradients."""
    kwargs = dict(r=R, num_B=NUM_B, scaling=0.5, target_modules=["proj"])
    torch.manual_seed(0)
    theirs = peft.get_peft_model(_Torch(), peft.LilyConfig(**kwargs, init_weights=False))
    layer = theirs.base_model.model.proj
    ours = peftx.LilyConfig(**kwargs)
    assert_layer_matches_peft(layer, ours, FIELDS, (2, 3, IN), dtype, _Proj, grad_terms=6 * IN)


# ---------------------------------------------------------------- whole models, both ways


CONFIG = dict(r=4, stride_A=2, num_B=3, target_modules=["q_proj", "v_proj", "down_proj"])


def _unpadded():
    ids = np.random.RandomState(1).randint(3, 97, (2, 8))
    return ids, np.ones_like(ids)


# peft_to_peftx's test writes PEFT's file back key for key: the fast tier's round trip
@pytest.mark.torch_round_trip
def test_peftx_to_peft(tiny_llama, tmp_path):
    """A stacked peftx adapter with random factors: PEFT's state dict is the file, every
    layer's key holding its block's `lily_A` and the one `lily_B`, float32; PEFT's logits
    are peftx's; the counts are PEFT's (each shared factor once)."""
    path, base = tiny_llama
    ours = peftx.get_peft_model(base(), peftx.LilyConfig(**CONFIG), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state)
    assert len(file) == 3 * 3 * 3  # 3 layers, 3 targets, 3 tensors
    for k, v in state.items():
        assert v.dtype == torch.float32 and file[k].dtype == np.float32, k
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lily_{}.weight"
    np.testing.assert_array_equal(file[key.format(0, "A")], file[key.format(1, "A")])
    assert not np.array_equal(file[key.format(1, "A")], file[key.format(2, "A")])
    np.testing.assert_array_equal(file[key.format(0, "B")], file[key.format(2, "B")])
    ids, mask = _unpadded()
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    mine = peft.get_peft_model(torch_base(path, "llama"), peft.LilyConfig(**CONFIG))
    assert ours.get_nb_trainable_parameters()[0] == mine.get_nb_trainable_parameters()[0]


def test_peft_to_peftx_files_and_gradients(tiny_llama, tmp_path):
    """A PEFT adapter (random factors, its sharing) loads to PEFT's logits and is written
    back exactly; each factor's gradient is PEFT's (a shared factor's, PEFT's one
    parameter's, under every key that holds it); a file whose layers disagree on a
    shared factor is refused."""
    path, base = tiny_llama
    torch.manual_seed(3)
    theirs = peft.get_peft_model(
        torch_base(path, "llama"), peft.LilyConfig(**CONFIG, init_weights=False)
    )
    theirs.save_pretrained(tmp_path / "peft")
    ours = peftx.PeftModel.from_pretrained(base(), tmp_path / "peft", is_trainable=True)
    ids, mask = _unpadded()
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    c = np.random.RandomState(2).standard_normal(reference.shape[-1]).astype(np.float32)
    (theirs(input_ids=torch.tensor(ids)).logits * torch.tensor(c)).sum().backward()
    trainable, frozen = peftx.partition(ours)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(trainable):
        logits = eqx.combine(trainable, frozen)(jnp.asarray(ids), jnp.asarray(mask)).logits
        return jnp.sum(logits * jnp.asarray(c)[None, None])

    eqx.combine(grads(trainable), frozen).save_pretrained(tmp_path / "grads")
    got = load_file(str(tmp_path / "grads" / WEIGHTS))
    # named_parameters lists a shared parameter once, under its first layer's key
    by_id = {}
    for k, p in theirs.named_parameters(remove_duplicate=False):
        if "lily_" in k:
            by_id.setdefault(id(p), (p, []))[1].append(k.replace(".default", ""))
    assert len(by_id) == 3 * (2 + 1 + 3)  # per target: 2 A blocks, 1 B, 3 routers
    assert sorted(k for _, keys in by_id.values() for k in keys) == sorted(got)
    for p, keys in by_id.values():
        g = p.grad.numpy()
        assert np.abs(g).max() > 0, keys
        for k in keys:
            np.testing.assert_allclose(got[k], g, atol=1e-4 * np.abs(g).max(), err_msg=k)

    with pytest.raises(ValueError, match="Lily has no dense weight"):
        ours.merge_and_unload()
    tampered = load_file(str(tmp_path / "peft" / WEIGHTS))
    key = "base_model.model.model.layers.1.self_attn.q_proj.lily_A.weight"
    tampered[key] = tampered[key] + 1
    from safetensors.numpy import save_file

    save_file(tampered, str(tmp_path / "peft" / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(peftx.CheckpointError, match="which share one tensor"):
        peftx.PeftModel.from_pretrained(base(), tmp_path / "peft")


def test_training_step_builds_no_dense_update_and_jvp(tiny_llama):
    """A training step of the stacked model builds no weight-sized array; forward mode
    agrees with reverse mode."""
    _, base = tiny_llama
    model = peftx.get_peft_model(base(), peftx.LilyConfig(**CONFIG), key=jax.random.key(0))
    assert_step_builds_no_dense_and_jvp(randomized(model, jax.random.key(4)))


def test_refusals(tiny_llama):
    """Layers that share factors must be one stack segment; PEFT's config checks."""
    _, base = tiny_llama
    with pytest.raises(ValueError, match="load the model with layout='stacked'"):
        peftx.get_peft_model(base("unrolled"), peftx.LilyConfig(**CONFIG), key=jax.random.key(0))
    with pytest.raises(ValueError, match="load the model with layout='stacked'"):
        peftx.get_peft_model(
            base(), peftx.LilyConfig(**CONFIG, layers_to_transform=[0, 2]), key=jax.random.key(0)
        )
    with pytest.raises(ValueError, match="`num_B` must be at least 2"):
        peftx.LilyConfig(num_B=1)
    with pytest.raises(ValueError, match="`stride_A` must be a positive integer"):
        peftx.LilyConfig(stride_A=0)


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text('[lily]\nr = 16\nstride_A = 3\nnum_B = 4\ntarget_modules = ["up_proj"]\n')
    assert peftx.from_toml(file) == peftx.LilyConfig(
        r=16, stride_A=3, num_B=4, target_modules=("up_proj",)
    )


@pytest.mark.command_run
def test_lily_job_trains_and_writes_what_peft_reads(llama, tmp_path, capsys):
    """A `[lily]` job trains and writes PEFT's adapter, which PEFT reads to peftx's
    logits."""
    table = '[lily]\nr = 4\nstride_A = 2\nnum_B = 2\ntarget_modules = ["q_proj", "v_proj"]'
    assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, "LILY")
