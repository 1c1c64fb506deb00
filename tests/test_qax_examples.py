"""The examples of qax's README, run as written there.

Only what qax and peftx spell differently is changed, each time with a comment: the
names (`qax.X` is `X` from `peftx.implicit`), the class definitions (qax's `ImplicitArray`
is a dataclass with `shape` and `dtype` fields, peftx's an `eqx.Module` whose subclasses
declare their fields), and `aval`, a method here. The handler bodies are qax's. Where the
README runs a Hugging Face model (GPT-2, T5), a small function of a parameter dict of the
same shape stands in for it, since tests have no network.
"""

import warnings
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from peftx.implicit import (
    ImplicitArray,
    MaterializationWarning,
    default_handler,
    materialization_policy,
    primitive_handler,
    strict,
    use_implicit_args,
)


@pytest.fixture(autouse=True)
def _numpy_defaults():
    """The README's code relies on JAX's default promotion (`(2, 3) + (3,)`, and optax's
    int32 step count with float32), which the suite otherwise forbids."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


# ---------------------------------------------------------------- symbolic zeros


def define_zeros() -> type:
    class Zeros(ImplicitArray):
        # qax: `default_dtype = jnp.float32`, and `shape`/`dtype` fields from qax's base
        _shape: tuple[int, ...] = eqx.field(static=True)
        _dtype: Any = eqx.field(static=True)

        def __init__(self, shape, dtype=jnp.float32):
            self._shape, self._dtype = tuple(shape), jnp.dtype(dtype)

        def aval(self):
            return jax.core.ShapedArray(self._shape, self._dtype)

        def materialize(self):
            # self.shape and self.dtype will be
            # populated by the ImplicitArray constructor
            return jnp.zeros(self.shape, self.dtype)

        def __str__(self):
            return f"Zeros({self.shape}, {self.dtype})"

    return Zeros


def get_binop_result_shape_dtype(a, b):
    out_shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    out_dtype = jnp.result_type(a.dtype, b.dtype)
    return out_shape, out_dtype


def register_add(Zeros):
    # primitive_handler() takes a string, JAX primitive, or a list of those types
    # strings are used to find the corresponding primitive from `jax.lax`
    @primitive_handler("add")
    def my_add_handler(primitive, a: Zeros, b):
        # Handlers will receive as arguments:
        # - primitive: a jax.core.Primitive instance (often can be ignored if the handler is
        #   just for one op)
        # Any number of arguments which are either JAX values or ImplicitArrays
        # Keyword arguments specifying parameters of the operation (e.g. axes for reduction
        # operations)
        out_shape, out_dtype = get_binop_result_shape_dtype(a, b)
        if isinstance(b, Zeros):
            # We can return further ImplicitArray instances if we want
            return Zeros(shape=out_shape, dtype=out_dtype)
        # Return b, possibly modifying its shape or dtype
        return jnp.broadcast_to(b, out_shape).astype(out_dtype)


def register_mul(Zeros):
    @primitive_handler("mul")
    def handle_mul(primitive, a: Zeros, b):
        out_shape, out_dtype = get_binop_result_shape_dtype(a, b)
        return Zeros(shape=out_shape, dtype=out_dtype)


def register_broadcast(Zeros):
    @primitive_handler("broadcast_in_dim")
    def broadcast(primitive, a: Zeros, *, shape, broadcast_dimensions):
        # The biases get broadcast in order to add them to the activations
        # so we need to handle that case
        # Sometimes the simplest thing to do is use jax.eval_shape
        # to figure out what shape to return
        result_shape = jax.eval_shape(
            partial(
                jax.lax.broadcast_in_dim, shape=shape, broadcast_dimensions=broadcast_dimensions
            ),
            a.aval(),  # qax: `a.aval`, a property
        ).shape
        return Zeros(shape=result_shape, dtype=a.dtype)


def test_symbolic_zeros():
    Zeros = define_zeros()
    z = Zeros(shape=(2, 3))

    @use_implicit_args
    def f(x, y):
        return (x + y)[0, 0]

    with materialization_policy("warn"), pytest.warns(MaterializationWarning, match="`add`"):
        assert f(z, jnp.ones(3)) == 1.0

    register_add(Zeros)
    with strict():
        assert f(z, jnp.ones(3)) == 1.0

    register_mul(Zeros)

    @jax.jit
    @use_implicit_args
    def g(x, y):
        return (1 + x) * y

    with strict():
        assert str(g(z, z)) == "Zeros((2, 3), float32)"


# Helper function to switch all the biases
# in the params out for some other value
def replace_biases(params, replacer):
    def maybe_replace_val(path, val):
        if val.ndim != 1:
            return val
        # Skip layernorms
        if any(isinstance(p, jax.tree_util.DictKey) and p.key.startswith("ln") for p in path):
            return val
        return replacer(shape=val.shape, dtype=val.dtype)

    return jax.tree_util.tree_map_with_path(maybe_replace_val, params)


def _gpt2_params(key):
    """GPT-2-like parameters: attention and MLP weights with biases, and a layer norm."""
    k = jax.random.split(key, 6)
    return {
        "transformer": {
            "h": {
                "0": {
                    "attn": {
                        "c_attn": {
                            "kernel": jax.random.normal(k[0], (8, 24)),
                            "bias": jax.random.normal(k[1], (24,)),
                        }
                    },
                    "mlp": {
                        "c_fc": {
                            "kernel": jax.random.normal(k[2], (24, 8)),
                            "bias": jax.random.normal(k[3], (8,)),
                        }
                    },
                }
            },
            "ln_f": {
                "scale": 1 + jax.random.normal(k[4], (8,)),
                "bias": jax.random.normal(k[5], (8,)),
            },
        }
    }


def _gpt2_logits(inputs, params):
    t, layer = params["transformer"], params["transformer"]["h"]["0"]
    h = jnp.tanh(inputs @ layer["attn"]["c_attn"]["kernel"] + layer["attn"]["c_attn"]["bias"])
    h = h @ layer["mlp"]["c_fc"]["kernel"] + layer["mlp"]["c_fc"]["bias"]
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return h * t["ln_f"]["scale"] + t["ln_f"]["bias"]


def test_symbolic_zero_biases(getkey):
    Zeros = define_zeros()
    register_add(Zeros)
    register_broadcast(Zeros)
    params = _gpt2_params(getkey())
    inputs = jax.random.normal(getkey(), (1, 9, 8))

    # Replace the biases with dense zero arrays:
    params_with_zeros = replace_biases(params, jnp.zeros)
    output = _gpt2_logits(inputs, params=params_with_zeros)

    # Now let's try replacing them with our symbolic zeros instead:
    symbolic = replace_biases(params, Zeros)
    assert isinstance(symbolic["transformer"]["h"]["0"]["attn"]["c_attn"]["bias"], Zeros)
    assert not isinstance(symbolic["transformer"]["ln_f"]["bias"], Zeros)
    with strict():
        symbolic_output = use_implicit_args(_gpt2_logits)(inputs, params=symbolic)
    np.testing.assert_allclose(symbolic_output, output, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- LoRA


class LoraMatrix(ImplicitArray):
    """Represent W + A B^T"""

    # qax: a `@dataclass` with fields of type `qax.ArrayValue`
    w: Any
    a: Any
    b: Any

    # auxiliary data example
    is_array_happy: bool = eqx.field(static=True, default=True)  # qax: qax.aux_field

    def __post_init__(self):
        # If you need to do any validation, you can override the __post_init__ method
        # This example is purely for error checking, but you can also
        # add manipulations of the attributes
        # (qax: `super().__post_init__()` first; `jax.core.get_aval`, gone from JAX, is
        # `get_aval` below)
        w_aval = get_aval(self.w)
        a_aval = get_aval(self.a)
        b_aval = get_aval(self.b)
        assert w_aval.ndim == a_aval.ndim == b_aval.ndim == 2
        assert a_aval.shape[1] == b_aval.shape[1]
        assert a_aval.shape[0] == w_aval.shape[0]
        assert b_aval.shape[0] == w_aval.shape[1]
        assert a_aval.dtype == b_aval.dtype == w_aval.dtype

    def materialize(self):
        return self.w + self.a @ self.b.T


def get_aval(x):
    return x.aval() if isinstance(x, ImplicitArray) else jax.typeof(x)


@primitive_handler("dot_general")
def f(primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **kwargs):
    # For this example, we'll only handle the simple case of of x @ w, rather than
    # all possible dot_general invocations
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers

    # This check just makes sure that all that's happening is a simple matmul
    if not (
        len(w.shape) == 2
        and lhs_contract == (x.ndim - 1,)
        and rhs_contract == (0,)
        and lhs_batch == ()
        and rhs_batch == ()
    ):
        # If we want to only partially handle a particular primitive,
        # we can fall back to the default logic by returning NotImplemented
        return NotImplemented

    kwargs = {**kwargs, "dimension_numbers": dimension_numbers}
    # In order to defer to the default implementation of the primitive,
    # use the qax.default_handler helper:
    result = default_handler(
        primitive,  # pass the primitive
        x,
        w.w,  # Any number of positional arguments,
        **kwargs,  # Then the primitive's keyword args
    )

    xa = default_handler(primitive, x, w.a, **kwargs)

    xab = default_handler(primitive, xa, w.b.T, **kwargs)

    result += xab
    return result


def lora_from_tree(tree, key, lora_dim=8):
    """
    Helper function for replacing non-embedding weight
    matrices in T5 with LoraMatrix instances.
    """

    def iter_keys(key):
        while True:
            key, k2 = jax.random.split(key)
            yield k2

    key_it = iter_keys(key)

    def map_fn(path, val):
        if val.ndim != 2:
            return val

        # Skip embedding params
        if any(isinstance(p, jax.tree_util.DictKey) and p.key == "embedding" for p in path):
            return val

        a = jax.random.normal(next(key_it), (val.shape[0], lora_dim), val.dtype)
        b = jnp.zeros((val.shape[1], lora_dim), val.dtype)
        return LoraMatrix(val, a, b)

    return jax.tree_util.tree_map_with_path(map_fn, tree)


def _t5_params(key):
    """T5-like parameters: an embedding (left dense by `lora_from_tree`) and two layers."""
    k = jax.random.split(key, 4)
    return {
        "shared": {"embedding": jax.random.normal(k[0], (20, 8))},
        "encoder": {"kernel": jax.random.normal(k[1], (8, 8)) / 3},
        "decoder": {"kernel": jax.random.normal(k[2], (8, 8)) / 3, "bias": jnp.zeros(8)},
        "lm_head": {"kernel": jax.random.normal(k[3], (8, 20)) / 3},
    }


def _t5_logits(input_ids, decoder_input_ids, params):
    embed = params["shared"]["embedding"]
    context = jnp.tanh(embed[input_ids] @ params["encoder"]["kernel"]).mean(1, keepdims=True)
    h = embed[decoder_input_ids] + context
    h = jnp.tanh(h @ params["decoder"]["kernel"] + params["decoder"]["bias"])
    return h @ params["lm_head"]["kernel"]


def test_lora(getkey):
    params = _t5_params(getkey())
    encoder_inputs = jnp.asarray([[3, 1, 4, 1, 5]])
    decoder_inputs = jnp.asarray([[0, 9, 2, 6, 5, 3]])

    lora_params = lora_from_tree(params, jax.random.PRNGKey(1234))
    assert isinstance(lora_params["encoder"]["kernel"], LoraMatrix)
    assert not isinstance(lora_params["shared"]["embedding"], LoraMatrix)

    orig_output = _t5_logits(
        input_ids=encoder_inputs, decoder_input_ids=decoder_inputs, params=params
    )
    with strict():
        lora_output = use_implicit_args(_t5_logits)(
            input_ids=encoder_inputs, decoder_input_ids=decoder_inputs, params=lora_params
        )
    assert jnp.max(jnp.abs(lora_output - orig_output)) == 0.0

    # qax: `qax.utils.freeze_keys(optimizer, LoraMatrix, ['w'])`; the same with optax
    def labels(tree):
        return jax.tree.map(
            lambda x: (
                eqx.tree_at(lambda m: m.w, jax.tree.map(lambda _: "train", x), "freeze")
                if isinstance(x, LoraMatrix)
                else jax.tree.map(lambda _: "train", x)
            ),
            tree,
            is_leaf=lambda x: isinstance(x, LoraMatrix),
        )

    # (qax: `optax.adam(3e-4)`; a larger step for the small stand-in model)
    optimizer = optax.multi_transform(
        {"train": optax.adam(3e-2), "freeze": optax.set_to_zero()}, labels
    )

    # We're only using a single example so we'll just close over the training data
    # There are no code changes from an ordinary training loop other than decorating
    # loss_fn with @use_implicit_args
    @use_implicit_args
    def loss_fn(params):
        decoder_ids = decoder_inputs[:, :-1]
        targets = decoder_inputs[:, 1:]
        logits = _t5_logits(input_ids=encoder_inputs, decoder_input_ids=decoder_ids, params=params)
        logprobs = jax.nn.log_softmax(logits)
        target_logprobs = jnp.take_along_axis(logprobs, targets[:, :, None], axis=-1)
        loss = -jnp.sum(target_logprobs)
        return loss

    grad_fn = jax.value_and_grad(loss_fn)

    @jax.jit
    def update(params, opt_state):
        loss, grads = grad_fn(params)
        updates, new_opt_state = optimizer.update(grads, opt_state, params=params)
        new_params = optax.apply_updates(updates, params)
        return loss, new_params, new_opt_state

    opt_state = optimizer.init(lora_params)
    losses = []
    with strict():
        for step in range(20):
            loss, lora_params, opt_state = update(lora_params, opt_state)
            losses.append(float(loss))  # qax: print(f'{step}. {loss:.3f}')
    assert losses[-1] < losses[0] / 4
    frozen = lora_params["encoder"]["kernel"].w
    np.testing.assert_array_equal(frozen, params["encoder"]["kernel"])


def test_nested_implicit_arrays():
    Zeros = define_zeros()

    @use_implicit_args
    def g(w, x):
        return jnp.sum(x @ w)

    w = jnp.ones((3, 5))
    x = jnp.arange(3, dtype=jnp.float32)

    lora_with_symbolic_zero = LoraMatrix(
        w=w, a=Zeros(shape=(w.shape[0], 6)), b=Zeros(shape=(w.shape[1], 6))
    )
    assert g(w, x) == 15.0
    with warnings.catch_warnings(record=True) as record, materialization_policy("warn"):
        warnings.simplefilter("always")
        assert g(lora_with_symbolic_zero, x) == 15.0
    # qax warns for `dot_general` and `transpose` on Zeros; peftx keeps `w.b.T` lazy (a
    # `Transposed`), so both materializations are `dot_general`'s.
    messages = {str(r.message).split(" as a dense")[0] for r in record}
    assert messages == {
        "primitive `dot_general` needs Zeros",
        "primitive `dot_general` needs Transposed",
    }
