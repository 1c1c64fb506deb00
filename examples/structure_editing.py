"""Structure editing: find layers of a zoo model by type, attributes and position, replace them.

On a tiny random `peftx.models.LlamaForCausalLM`:

1. `peftx.select` lists layers by type and attributes (every `Linear` wider than N);
2. every attention output and MLP down projection in layers 2-3 is replaced by a new
   `Linear` of zeros (`Selection.apply`, i.e. `eqx.tree_at`): those layers then write
   nothing to the residual stream, so the edited model must equal a 2-layer model built
   from layers 0-1, which is checked;
3. the same edit on the default stacked layout (`layers.0-3.…`, one block with a leading
   layer axis): `split_stack` cuts the stack so that layers 2-3 are addressable;
4. the activation: zoo models read it from their config (`hidden_act`, a static field),
   so swapping it means moving the arrays into a model built with the other config; the
   result equals a model built with GELU from the start.

Run with `python examples/structure_editing.py`; exits non-zero if a check fails.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

import peftx
from peftx.models import LlamaConfig, LlamaForCausalLM, split_stack


def zero_linear(layer: eqx.nn.Linear) -> eqx.nn.Linear:
    """A new `Linear` of the same shape (stacked too), without bias, all zeros."""
    *_, out_features, in_features = layer.weight.shape
    new = eqx.nn.Linear(in_features, out_features, use_bias=False, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.weight, new, jnp.zeros_like(layer.weight))


def main(*, layers: int = 4, wider_than: int = 48, seq: int = 10) -> int:
    key = jax.random.key(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config, key=key, layout="unrolled")
    ids = jax.random.randint(jax.random.key(1), (2, seq), 0, config.vocab_size)
    logits = eqx.filter_jit(lambda m, x: m(x).logits)
    ok = True

    # 1. by type and attributes
    wide = peftx.of_type(eqx.nn.Linear) & peftx.where(lambda m: m.weight.shape[0] > wider_than)
    print(f"every Linear wider than {wider_than}:")
    print(peftx.select(model).at(wide).table())

    # 2. by type, name and position; replaced by new modules
    residual_writes = peftx.of_type(eqx.nn.Linear) & peftx.named("o_proj", "down_proj")
    selection = peftx.select(model).at(residual_writes & peftx.in_layers([2, 3]))
    print(f"replacing {selection.paths()}")
    edited = selection.apply(zero_linear)

    short = dataclasses.replace(config, num_hidden_layers=2)
    two = LlamaForCausalLM(short, key=key, layout="unrolled")
    two = eqx.tree_at(
        lambda m: (m.model.embed_tokens, m.model.layers, m.model.norm, m.lm_head),
        two,
        (model.model.embed_tokens, model.model.layers[:2], model.model.norm, model.lm_head),
    )
    change = float(jnp.max(jnp.abs(logits(edited, ids) - logits(model, ids))))
    err = float(jnp.max(jnp.abs(logits(edited, ids) - logits(two, ids))))
    print(f"edit changed the logits by up to {change:.3f}; |edited - 2-layer model|: {err:.1e}")
    ok &= change > 0.1 and err < 1e-5

    # 3. the same edit on the stacked layout
    stacked = LlamaForCausalLM(config, key=key)
    print(f"stacked paths: {peftx.select(stacked).at(residual_writes).paths()}")
    stacked = eqx.tree_at(lambda m: m.model.layers, stacked, split_stack(stacked.model.layers, [2]))
    selection = peftx.select(stacked).at(residual_writes & peftx.in_layers([2, 3]))
    print(f"after split_stack(layers, [2]): replacing {selection.paths()}")
    err = float(jnp.max(jnp.abs(logits(selection.apply(zero_linear), ids) - logits(two, ids))))
    print(f"stacked edit: |edited - 2-layer model|: {err:.1e}")
    ok &= err < 1e-5

    # 4. the activation: the same arrays in a model whose config says GELU
    gelu = dataclasses.replace(config, hidden_act="gelu")
    skeleton = eqx.filter_eval_shape(LlamaForCausalLM, gelu, key=key, layout="unrolled")
    swapped = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
    built = LlamaForCausalLM(gelu, key=key, layout="unrolled")
    change = float(jnp.max(jnp.abs(logits(swapped, ids) - logits(model, ids))))
    err = float(jnp.max(jnp.abs(logits(swapped, ids) - logits(built, ids))))
    print(f"SiLU -> GELU changed the logits by up to {change:.3f}; |swapped - built|: {err:.1e}")
    ok &= change > 0.01 and err == 0.0

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
