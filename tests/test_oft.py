"""OFT against dense formulas written out here and against HF PEFT 0.21.2 in PyTorch."""

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
    assert_same,
    assert_same_files,
    base,  # noqa: F401  (a fixture)
    batch,
    checkpoint,  # noqa: F401  (a fixture)
    jax_out,
    randomized,
    torch_base,
    torch_out,
)

import peftx
from peftx.adapters import OFTArray, oft
from peftx.implicit import assert_no_dense, strict, use_implicit_args

OUT, IN, B = 6, 12, 4  # three blocks of four input features


def _cayley(q_vec, b, neumann_terms):
    """PEFT's rotation of one block written out in numpy: the skew matrix from its upper
    triangle, then the exact `(I - Q)(I + Q)⁻¹` or the series `I + 2Q + … + Q^m`."""
    q = np.zeros((b, b))
    q[np.triu_indices(b, 1)] = q_vec
    q = q - q.T
    eye = np.eye(b)
    if neumann_terms is None:
        return (eye - q) @ np.linalg.inv(eye + q)
    m = max(neumann_terms - 2, 2)
    return (
        eye
        + 2 * sum(np.linalg.matrix_power(q, k) for k in range(1, m + 1))
        + (np.linalg.matrix_power(q, m + 1))
    )


def _dense_oft(weight, oft_r, neumann_terms=5):
    """`W @ BD(R)ᵀ` with the block-diagonal `BD` assembled in full (one row of `oft_r`
    shared by all blocks when it has one row)."""
    blocks = weight.shape[-1] // B
    rows = [np.asarray(oft_r[0 if len(oft_r) == 1 else d], np.float64) for d in range(blocks)]
    bd = np.zeros((weight.shape[-1],) * 2)
    for d, row in enumerate(rows):
        bd[d * B : (d + 1) * B, d * B : (d + 1) * B] = _cayley(row, B, neumann_terms)
    return np.asarray(weight, np.float64) @ bd.T


def _random_oft(key, shape=(OUT, IN), **kwargs):
    kw, ka = jax.random.split(key)
    return oft(jax.random.normal(kw, shape), block_size=B, key=ka, **kwargs)


LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (input axis kept)": lambda w, x: (x @ w.T) @ w,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_oft_matches_dense_formula(getkey, layout):
    """Values, gradients of `oft_R` and `x`, and jvp against `W @ BD(R)ᵀ` built in full."""
    fn = LAYOUTS[layout]
    w = _random_oft(getkey())
    x = jax.random.normal(getkey(), (3, IN))
    dense = jnp.asarray(_dense_oft(w.weight, w.oft_R), jnp.float32)
    close(w.merged(w.weight), dense)

    def loss(oft_r, x, implicit):
        matrix = eqx.tree_at(lambda a: a.oft_R, w, oft_r) if implicit else w.merged(w.weight)
        return jnp.sum(jnp.sin(use_implicit_args(fn)(matrix, x)))

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(w.oft_R, x, True)
        tangent = jax.random.normal(getkey(), w.oft_R.shape)
        _, jvp = jax.jit(lambda r, t: jax.jvp(lambda r: loss(r, x, True), (r,), (t,)))(
            w.oft_R, tangent
        )
    close(got, fn(dense, x), tol=1e-4)
    assert not np.allclose(got, fn(w.weight, x), atol=1e-2)  # the rotation matters

    def dense_loss(oft_r, x):
        return jnp.sum(jnp.sin(fn(eqx.tree_at(lambda a: a.oft_R, w, oft_r).merged(w.weight), x)))

    close(grads, jax.jit(jax.grad(dense_loss, argnums=(0, 1)))(w.oft_R, x), tol=1e-4)
    dense_jvp = jax.jit(lambda r, t: jax.jvp(lambda r: dense_loss(r, x), (r,), (t,))[1])
    close(jvp, dense_jvp(w.oft_R, tangent), tol=1e-4)


def test_stacked_oft_under_scan_and_unmerge(getkey):
    """A stack of layers (`eqx.filter_vmap`) run by `lax.scan`, each its own rotation;
    `unmerged` gives the base weight back from the merged one."""
    stacked = eqx.filter_vmap(lambda k: _random_oft(k))(jax.random.split(getkey(), 2))
    x = jax.random.normal(getkey(), (3, IN))
    h = jax.random.normal(getkey(), (IN, IN))

    def run(layers, x):
        def body(x, layer):
            return jnp.tanh(x @ layer.T @ h[:OUT]), None

        return jax.lax.scan(use_implicit_args(body), x, layers)[0]

    with strict():
        got = run(stacked, x)
    dense = jnp.stack([_dense_oft(stacked.weight[i], stacked.oft_R[i]) for i in range(2)])
    close(got, run(dense.astype(jnp.float32), x), tol=1e-4)
    merged = stacked.merged(stacked.weight)
    close(stacked.unmerged(merged), stacked.weight, tol=1e-5)
    assert not np.allclose(merged, stacked.weight, atol=1e-2)


# ---------------------------------------------------------------- one layer against PEFT

VARIANTS = {
    "default": dict(),
    "exact cayley": dict(use_cayley_neumann=False),
    "3 neumann terms": dict(num_cayley_neumann_terms=3),
    "block_share": dict(block_share=True),
    "coft": dict(coft=True, eps=0.05),
}


def _peft_linear(dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    config = peft.OFTConfig(oft_block_size=B, target_modules=["0"], init_weights=False, **kwargs)
    layer = peft.get_peft_model(module, config).base_model.model[0]
    layer.base_layer.to(dtype)
    return layer


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_layer_matches_peft(variant, base_dtype):
    """Outputs and the gradient of `oft_R` equal PEFT's, fp32 and on a bf16 base with fp32
    `oft_R` (PEFT rotates in fp32 and rounds the rotated input to bf16). Each variant's
    setting changes the outputs."""
    kwargs = VARIANTS[variant]
    torch_dtype = getattr(torch, base_dtype)
    layer = _peft_linear(torch_dtype, **kwargs)
    oft_r = layer.oft_R["default"].weight.detach().numpy().copy()  # before COFT projects it
    weight = layer.base_layer.weight.detach().float().numpy()
    bias = layer.base_layer.bias.detach().float().numpy()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1)).to(torch_dtype)
    y = layer(x)
    (y.float() * torch.arange(OUT)).sin().sum().backward()
    want_grad = layer.oft_R["default"].weight.grad.numpy()

    dtype = jnp.dtype(base_dtype)
    w = oft(jnp.asarray(weight, dtype), block_size=B, **kwargs)
    w = eqx.tree_at(lambda a: a.oft_R, w, jnp.asarray(oft_r))
    xj = jnp.asarray(x.float().numpy(), dtype)

    def forward(w):
        return use_implicit_args(lambda w, x: x @ w.T)(w, xj) + jnp.asarray(bias, dtype)[None]

    def loss(oft_r):
        out = forward(eqx.tree_at(lambda a: a.oft_R, w, oft_r)).astype(jnp.float32)
        return jnp.sum(jnp.sin(out * jnp.arange(OUT, dtype=jnp.float32)[None]))

    with strict():
        got, grad = forward(w), jax.grad(loss)(w.oft_R)
    assert grad.dtype == jnp.float32
    tol = 1e-5 if base_dtype == "float32" else 4 * float(jnp.finfo(jnp.bfloat16).eps)
    scale = float(np.abs(y.detach().float().numpy()).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), y.detach().float(), atol=tol * scale)
    grad_tol = 1e-5 if base_dtype == "float32" else 0.05
    np.testing.assert_allclose(grad, want_grad, atol=grad_tol * np.abs(want_grad).max())
    if base_dtype == "float32" and variant not in ("default", "block_share"):
        # the setting matters: without it the same oft_R computes something else
        plain = eqx.tree_at(lambda a: a.oft_R, oft(w.weight, block_size=B), w.oft_R)
        assert not np.allclose(forward(plain), got, atol=1e-3)


def test_bad_oft_input():
    w = jnp.ones((OUT, IN))
    with pytest.raises(ValueError, match="block_size 5 must divide"):
        oft(w, block_size=5)
    with pytest.raises(ValueError, match="oft_R of shape"):
        OFTArray(w, jnp.zeros((2, 6)), False, 6e-5, False, True, 5)
    with pytest.raises(ValueError, match="exactly one of `r`"):
        peftx.OFTConfig(r=4, oft_block_size=8)
    with pytest.raises(ValueError, match="exactly one of `r`"):
        peftx.OFTConfig(oft_block_size=0)
    with pytest.raises(ValueError, match="bias.*'oft_only'"):
        peftx.OFTConfig.from_dict({"bias": "lora_only"})
    with pytest.raises(ValueError, match="bias"):
        peftx.LoraConfig.from_dict({"bias": "oft_only"})
    with pytest.raises(ValueError, match="num_cayley_neumann_terms"):
        peftx.OFTConfig(num_cayley_neumann_terms=1)
    with pytest.raises(ValueError, match="eps"):
        peftx.OFTConfig(coft=True, eps=0.0)
    with pytest.raises(ValueError, match="module_dropout"):
        peftx.OFTConfig(module_dropout=1.0)


# ---------------------------------------------------------------- a tiny Llama, both ways

TARGETS = ["q_proj", "v_proj", "down_proj"]  # down_proj: 64 input features


def _randomize_oft(model, seed):
    gen = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "oft_R" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
                count += 1
    assert count
    return model


def test_peftx_to_peft(checkpoint, base, tmp_path):  # noqa: F811
    """A stacked peftx OFT adapter with random `oft_R` loads in PEFT with equal logits,
    and PEFT's state dict equals the file; counts are PEFT's."""
    config = dict(oft_block_size=8, target_modules=TARGETS)
    ours = peftx.get_peft_model(
        base("llama", "stacked"), peftx.OFTConfig(**config), key=jax.random.key(0)
    )
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    path = checkpoint("llama")
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state) and all(k.endswith(".oft_R.weight") for k in file)
    for k, v in state.items():
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    fresh = peft.get_peft_model(torch_base(path, "llama"), peft.OFTConfig(**config))
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()


def test_peft_to_peftx_gradients_and_merge(checkpoint, base, tmp_path):  # noqa: F811
    """A PEFT OFT adapter (exact Cayley, shared blocks, by `r`) loads into an unrolled
    peftx model: equal logits, the same file written back, the same gradient of every
    `oft_R` for one loss, and merged logits equal to the unmerged ones."""
    config = peft.OFTConfig(
        r=4, oft_block_size=0, block_share=True, use_cayley_neumann=False, target_modules=TARGETS
    )
    path = checkpoint("llama")
    theirs = _randomize_oft(peft.get_peft_model(torch_base(path, "llama"), config), seed=3)
    theirs.save_pretrained(tmp_path / "peft")
    ours = peftx.PeftModel.from_pretrained(
        base("llama", "unrolled"), tmp_path / "peft", is_trainable=True
    )
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    # gradients: loss = Σ logits · c over the real tokens
    c = np.random.RandomState(2).standard_normal(peftx_vocab := reference.shape[-1])
    weights = mask[..., None] * c[None, None, :peftx_vocab]
    kwargs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    (theirs(**kwargs).logits * torch.tensor(weights, dtype=torch.float32)).sum().backward()
    trainable, frozen = peftx.partition(ours)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(trainable):
        logits = eqx.combine(trainable, frozen)(jnp.asarray(ids), jnp.asarray(mask)).logits
        return jnp.sum(logits * jnp.asarray(weights, jnp.float32))

    # the gradient in the place of the adapter, saved: PEFT's names for each tensor
    eqx.combine(grads(trainable), frozen).save_pretrained(tmp_path / "grads")
    got = load_file(str(tmp_path / "grads" / WEIGHTS))
    want = {
        k.replace(".default", ""): p.grad.numpy()
        for k, p in theirs.named_parameters()
        if "oft_R" in k
    }
    assert sorted(got) == sorted(k.removeprefix("") for k in want)
    for k, g in want.items():
        np.testing.assert_allclose(got[k], g, atol=1e-4 * np.abs(g).max(), err_msg=k)
        assert np.abs(g).max() > 0, k

    merged = ours.merge_and_unload()
    assert_same(jax_out(merged, ids, mask), jax_out(ours, ids, mask), mask)


def test_train_step_builds_no_dense_weight(base):  # noqa: F811
    """The forward, backward and optimizer update of a stacked OFT model rotate
    activations only: no weight-sized array is built."""
    import optax

    model = peftx.get_peft_model(
        base("llama", "stacked"),
        peftx.OFTConfig(oft_block_size=8, target_modules=TARGETS, coft=True),
        key=jax.random.key(0),
    )
    trainable, frozen = peftx.partition(model)
    optim = optax.adamw(1e-3)
    opt_state = eqx.filter_eval_shape(optim.init, trainable)
    ids = jnp.ones((3, 5), jnp.int32)

    @eqx.filter_jit
    def step(trainable, frozen, opt_state, ids):
        def loss(trainable):
            return jnp.mean(eqx.combine(trainable, frozen)(ids).logits ** 2)

        grads = eqx.filter_grad(loss)(trainable)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state

    with jax.numpy_dtype_promotion("standard"), strict():
        assert_no_dense(step, trainable, frozen, opt_state, ids)


def test_two_adapters_switch_and_refuse_mixed_batches(base):  # noqa: F811
    model = peftx.get_peft_model(
        base("llama", "stacked"),
        peftx.OFTConfig(oft_block_size=8, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(0),
    )
    model = model.add_adapter(
        "b",
        peftx.OFTConfig(oft_block_size=4, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(1),
    )
    ids, mask = batch("llama")
    first = jax_out(model, ids, mask)
    second = jax_out(model.set_adapter("b"), ids, mask)
    assert np.abs(first - second).max() > 1e-3  # N(0, 0.1²) rotations: small, far above TOL
    with pytest.raises(ValueError, match="within a batch, which PEFT does not do for OFT"):
        model(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])


def test_module_dropout_warns_it_does_nothing_as_in_peft(base):  # noqa: F811
    """PEFT 0.21.2 builds `MultiplicativeDropoutLayer` but its `forward` never calls it:
    a training-mode PEFT forward with module_dropout is the one without it."""
    layer = _peft_linear(module_dropout=0.5).train()
    x = torch.randn(4, IN)
    with torch.no_grad():
        trained = layer(x)
        layer.oft_dropout["default"].p = 0.0
        np.testing.assert_array_equal(layer(x), trained)
    assert isinstance(
        layer.oft_dropout["default"], peft.tuners.oft.layer.MultiplicativeDropoutLayer
    )
    with pytest.warns(UserWarning, match="module_dropout=0.5 has no effect"):
        peftx.get_peft_model(
            base("llama", "stacked"),
            peftx.OFTConfig(target_modules=["q_proj"], module_dropout=0.5),
            key=jax.random.key(0),
        )


def test_oft_table_in_a_job(tmp_path):
    """`[oft]` in a TOML file gives an OFTConfig (what `peftx finetune` reads)."""
    toml = tmp_path / "job.toml"
    toml.write_text('[oft]\noft_block_size = 8\ncoft = true\ntarget_modules = ["q_proj"]\n')
    assert peftx.from_toml(toml) == peftx.OFTConfig(
        oft_block_size=8, coft=True, target_modules=("q_proj",)
    )
    toml.write_text("[oft]\nblock_size = 8\n")
    with pytest.raises(ValueError, match="did you mean 'oft_block_size'"):
        peftx.from_toml(toml)
