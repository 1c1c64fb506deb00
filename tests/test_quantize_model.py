"""`QuantizationConfig` and `quantize_model`: the weights chosen, the formats, QLoRA on top."""

import bitsandbytes as bnb
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_select import CausalLM

import peftx
from peftx import LoraConfig, QuantizationConfig, get_peft_model, partition, quantize_model
from peftx.adapters import Int8Array, NF4Array, quantize_nf4
from peftx.implicit import materialize, strict


def _linear_weights(model):
    sel = peftx.select(model).at(peftx.of_type(eqx.nn.Linear))
    return dict(zip(sel.paths(), (n.weight for n in sel.get())))


def _run(model, x):
    def body(m, x):
        h = jax.vmap(m.model.embed_tokens)(x)
        for layer in m.model.layers:
            attn = layer.self_attn
            h = h + jax.vmap(lambda v: attn.o_proj(attn.v_proj(v) + attn.q_proj(v)))(h)
            h = h + jax.vmap(
                lambda v: layer.mlp["down_proj"](jax.nn.gelu(layer.mlp["up_proj"](v)))
            )(h)
        return jax.vmap(m.lm_head)(h)

    if isinstance(model, peftx.PeftModel):
        model = model.prepared()
    return peftx.use_implicit_args(body)(model, x)


def _dequantized(model):
    """`model` with each NF4 weight replaced by its dense values."""
    is_nf4 = lambda w: isinstance(w, NF4Array)  # noqa: E731
    return jax.tree.map(lambda w: materialize(w) if is_nf4(w) else w, model, is_leaf=is_nf4)


def test_4bit_quantizes_every_linear_but_the_head():
    lm = CausalLM(d=64)
    q = quantize_model(lm, QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True))
    weights = _linear_weights(q)
    assert not isinstance(weights.pop("lm_head"), NF4Array)
    assert len(weights) == 24 and all(isinstance(w, NF4Array) for w in weights.values())
    w = weights["model.layers.2.self_attn.v_proj"]
    want = quantize_nf4(lm.model.layers[2].self_attn.v_proj.weight, double_quant=True)
    np.testing.assert_array_equal(materialize(w), materialize(want))
    # embeddings and biases stay dense
    assert isinstance(q.model.embed_tokens.weight, jax.Array)
    assert isinstance(q.model.layers[0].mlp["up_proj"].bias, jax.Array)


def test_8bit_skip_modules_and_compute_dtype():
    lm = CausalLM(d=64)
    config = QuantizationConfig(load_in_8bit=True, llm_int8_skip_modules=["down_proj", "lm_head"])
    weights = _linear_weights(quantize_model(lm, config))
    assert {p for p, w in weights.items() if not isinstance(w, Int8Array)} == {
        "lm_head",
        *(f"model.layers.{i}.mlp.down_proj" for i in range(4)),
    }
    half = quantize_model(
        lm, QuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16")
    )
    assert _linear_weights(half)["model.layers.0.mlp.up_proj"].dtype == jnp.bfloat16


@pytest.mark.parametrize("stored,compute", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_4bit_quantizes_the_stored_weight_as_bitsandbytes(stored, compute):
    """As bitsandbytes' `Linear4bit`: the weight is quantized as stored, the state dict
    records the stored dtype, and the matmul dequantizes to the compute dtype."""
    lm = jax.tree.map(lambda x: x.astype(stored) if eqx.is_inexact_array(x) else x, CausalLM(d=64))
    config = QuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute)
    ours = _linear_weights(quantize_model(lm, config))["model.layers.1.mlp.up_proj"]
    assert (ours.stored_dtype, ours.dtype) == (stored, compute)
    dense = lm.model.layers[1].mlp["up_proj"].weight
    out_features, in_features = dense.shape
    t_stored, t_compute = getattr(torch, stored), getattr(torch, compute)
    theirs = bnb.nn.Linear4bit(
        in_features, out_features, bias=False, compute_dtype=t_compute, compress_statistics=False
    )
    theirs.weight = bnb.nn.Params4bit(
        torch.tensor(np.asarray(dense, np.float32)).to(t_stored),
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=False,
    )
    theirs = theirs.to("cpu")  # quantizes, as transformers loads a 4-bit layer
    want = {k: v.numpy() for k, v in theirs.state_dict().items()}
    got = ours.to_bnb_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    # linear(I, W) is exactly W: the weight bitsandbytes' matmul multiplies by
    eye = torch.eye(in_features, dtype=t_compute)
    weight = bnb.matmul_4bit(eye, theirs.weight.t(), quant_state=theirs.weight.quant_state)
    assert weight.dtype == t_compute
    np.testing.assert_array_equal(
        np.asarray(materialize(ours), np.float32), weight.float().numpy().T
    )


def test_qlora_on_a_quantized_model_trains_only_the_adapters():
    lm = CausalLM(d=64)
    q = quantize_model(lm, QuantizationConfig(load_in_4bit=True))
    peft_model = get_peft_model(
        q,
        LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False),
        key=jax.random.key(0),
    )
    x = jnp.array([1, 2, 3, 4])
    with strict():
        out = _run(peft_model, x)
    # the same adapters over the dequantized weights give the same output
    dense = _dequantized(peft_model)
    np.testing.assert_allclose(out, _run(dense, x), rtol=1e-5, atol=1e-5)
    trainable, _ = partition(peft_model)
    leaves = jax.tree.leaves(trainable)
    assert len(leaves) == 2 * 2 * 4 and all(leaf.dtype == jnp.float32 for leaf in leaves)


def test_config_round_trip_and_errors(tmp_path):
    config = QuantizationConfig(
        load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16"
    )
    d = config.to_dict()
    assert d["quant_method"] == "bitsandbytes" and d["bnb_4bit_quant_type"] == "nf4"
    assert QuantizationConfig.from_dict(d) == config
    import transformers

    theirs = transformers.BitsAndBytesConfig(**config.to_dict()).to_dict()
    for key, value in d.items():
        assert theirs[key] == value, key
    with pytest.warns(UserWarning, match=r"\['llm_int8_threshold'\] have no effect"):
        QuantizationConfig.from_dict({"load_in_8bit": True, "llm_int8_threshold": 4.0})
    with pytest.raises(ValueError, match=r"exactly one of load_in_4bit and load_in_8bit"):
        QuantizationConfig()
    with pytest.raises((ValueError, TypeError), match=r"fp4"):
        QuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4")
    with pytest.raises(ValueError, match=r"bnb_4bit_compute_dtype must be one of"):
        QuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="int4")
    path = tmp_path / "qlora.toml"
    path.write_text("[lora]\nr = 8\n\n[quantization]\nload_in_4bit = true\n")
    assert QuantizationConfig.from_toml(path) == QuantizationConfig(load_in_4bit=True)
    assert peftx.from_toml(path).r == 8
    path.write_text("[lora]\nr = 8\n")
    assert QuantizationConfig.from_toml(path) is None


@pytest.mark.parametrize(
    "quant",
    [
        dict(load_in_4bit=True),
        dict(load_in_4bit=True, bnb_4bit_use_double_quant=True),
        dict(load_in_8bit=True),
    ],
)
def test_quantized_weights_count_as_the_parameters_they_stand_for(quant):
    # PEFT counts a 4-bit weight as two values per stored byte and an int8 weight by its
    # codes, so a quantized model has as many parameters as the dense one it came from.
    import peft
    import transformers

    sizes = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = peftx.models.LlamaForCausalLM(peftx.models.LlamaConfig(**sizes), key=jax.random.key(0))
    config = LoraConfig(r=4, target_modules="all-linear")
    dense = get_peft_model(model, config, key=jax.random.key(1))
    quantized = get_peft_model(
        quantize_model(model, QuantizationConfig(**quant)), config, key=jax.random.key(1)
    )
    torch_model = peft.get_peft_model(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)),
        peft.LoraConfig(r=4, target_modules="all-linear"),
    )
    assert dense.get_nb_trainable_parameters() == torch_model.get_nb_trainable_parameters()
    assert quantized.get_nb_trainable_parameters() == dense.get_nb_trainable_parameters()


ZOO = {
    "qwen3": lambda: peftx.models.LlamaForCausalLM(
        peftx.models.LlamaConfig(
            model_type="qwen3", qk_norm=True, head_dim=16, sliding_windows=(4, None), **_SIZES
        ),
        key=jax.random.key(0),
    ),
    "gemma2": lambda: peftx.models.Gemma2ForCausalLM(
        peftx.models.Gemma2Config(
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            sliding_windows=(4, None),
            **_SIZES,
        ),
        key=jax.random.key(0),
    ),
    "gemma3": lambda: peftx.models.Gemma3ForCausalLM(
        peftx.models.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=24, sliding_windows=(4, None), **_SIZES
        ),
        key=jax.random.key(0),
    ),
    "mixtral": lambda: peftx.models.LlamaForCausalLM(
        peftx.models.LlamaConfig(
            model_type="mixtral", num_experts=4, num_experts_per_tok=2, **_SIZES
        ),
        key=jax.random.key(0),
    ),
    "qwen3_moe": lambda: peftx.models.LlamaForCausalLM(
        peftx.models.LlamaConfig(
            model_type="qwen3_moe",
            qk_norm=True,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            **_SIZES,
        ),
        key=jax.random.key(0),
    ),
    "phi3": lambda: peftx.models.Phi3ForCausalLM(
        peftx.models.Phi3Config(
            rope=(
                ("long_factor", (3.0, 11.0, 2.0, 5.0)),
                ("partial_rotary_factor", 0.5),
                ("rope_theta", 10000.0),
                ("rope_type", "longrope"),
                ("short_factor", (1.0, 1.7, 1.2, 1.1)),
            ),
            original_max_position_embeddings=4,  # the ids are longer: the long factors
            sliding_window=4,
            **_SIZES,
        ),
        key=jax.random.key(0),
    ),
}
# the adapted weights of a block: q, k, v, o, gate, up, down; Phi-3 fuses q, k, v and gate,
# up; Mixtral's all-linear is q, k, v, o, the router and the two expert stacks
LINEARS = {"qwen3": 7, "gemma2": 7, "gemma3": 7, "mixtral": 7, "qwen3_moe": 7, "phi3": 4}
_SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)


@pytest.mark.parametrize(
    "name",
    [
        n if i == 0 else pytest.param(n, marks=pytest.mark.zoo_sweep)
        for i, n in enumerate(sorted(ZOO))
    ],
)
def test_qlora_on_each_new_architecture(name):
    """QLoRA on every linear layer (and expert stack) of each newer stacked model: none is made
    dense (`strict`), the logits equal the same adapters over the dequantized weights
    (whose NF4 codes equal bitsandbytes' above), and a gradient reaches every adapter
    factor and nothing else."""
    q = quantize_model(ZOO[name](), QuantizationConfig(load_in_4bit=True))
    config = LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False)
    peft_model = get_peft_model(q, config, key=jax.random.key(1))
    ids = jnp.array([[3, 9, 27, 5, 14, 2]])
    trainable, frozen = partition(peft_model)

    @eqx.filter_jit  # the logits and the gradients in one compile
    def grads_and_logits(trainable):
        def loss(t):
            logits = eqx.combine(t, frozen)(ids).logits
            return jnp.sum(logits[0, -1] ** 2), logits

        return jax.grad(loss, has_aux=True)(trainable)

    with strict():
        grads, got = grads_and_logits(trainable)
    want = eqx.filter_jit(lambda m: _dequantized(m)(ids).logits)(peft_model)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    is_nf4 = lambda w: isinstance(w, NF4Array)  # noqa: E731
    nf4 = [w for w in jax.tree.leaves(frozen, is_leaf=is_nf4) if is_nf4(w)]
    assert nf4
    if name in (
        "mixtral",
        "qwen3_moe",
    ):  # both expert stacks, (layers, experts, out, in), each expert's own
        assert sum(w.ndim == 4 for w in nf4) == 2
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == 2 * LINEARS[name]  # A and B of each (stacked)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)
