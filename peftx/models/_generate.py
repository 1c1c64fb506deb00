"""Text generation for the decoder models: greedy decoding and sampling over a KV cache,
with adapters (one per prompt if asked), compiled once per shape.

One prefill runs over the whole left-padded prompt and fills a cache preallocated for
`prompt + max_new_tokens` slots; then one token per step inside `lax.while_loop`, which
stops as soon as every row has produced an end-of-sequence token.
"""

import math
from collections.abc import Sequence
from numbers import Integral
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..implicit import is_implicit, use_implicit_args
from ..sharding import BATCH_AXES, batch_parts
from ._common import KVCache
from ._gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from ._gpt2 import GPT2LMHeadModel
from ._llama import LlamaForCausalLM
from ._phi3 import Phi3ForCausalLM

CAUSAL_LM_CLASSES = (  # the models `generate` (and `peftx serve`) runs
    LlamaForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Phi3ForCausalLM,
    GPT2LMHeadModel,
)


class _Spec(NamedTuple):
    """Everything static about one compiled generation."""

    max_new_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    do_sample: bool
    top_k: int | None
    use_top_p: bool
    cache_sharding: NamedSharding | None  # where the model's weights lie on a mesh
    restart_step: int | None  # the step that recomputes the cache from the whole sequence


def generate(
    model: Any,
    input_ids: Int[Array | np.ndarray, "batch prompt"],
    max_new_tokens: int,
    *,
    attention_mask: Int[Array | np.ndarray, "batch prompt"] | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: PRNGKeyArray | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    adapter_names: Sequence[str] | None = None,
) -> Int[Array, "batch total"]:
    """Continue each prompt by `max_new_tokens` tokens, as transformers' `generate` does.

    **Arguments:**

    - `model`: a `LlamaForCausalLM` (Llama, Mistral, Qwen2, Qwen3), `Gemma2ForCausalLM`,
      `Gemma3ForCausalLM`, `Phi3ForCausalLM` or `GPT2LMHeadModel`, or a `PeftModel` around
      one (adapters unmerged, on a dense or quantized base). A Phi-3 with LongRoPE runs
      the whole sequence again when it first grows past `original_max_position_embeddings`,
      so that every cached key turns with the long factors, as transformers' `generate`
      does.
    - `input_ids`: the prompts, `(batch, prompt)`, left-padded when their lengths differ.
    - `max_new_tokens`: how many tokens to add (at least 1).
    - `attention_mask`: 1 for real tokens, 0 for padding (default: all real). Padding
      must be on the left: a right-padded prompt would continue after its padding.
      New tokens take positions that continue each row's count of real tokens.
    - `do_sample`: sample (with `key`) instead of taking the most likely token.
    - `temperature`, `top_k`, `top_p`: applied to the logits in transformers' order
      (temperature, then top-k, then the nucleus) when sampling; ignored otherwise.
    - `key`: PRNG key, required when sampling. Token `i` (counted from 0 after the
      prompt) is drawn with `jax.random.categorical(jax.random.fold_in(key, i), ...)`.
    - `eos_token_id`: one id or several; a row that produces one is finished and gets
      `pad_token_id` from then on. Default: the model config's `eos_token_id`.
    - `pad_token_id`: default the config's, else the first end-of-sequence id.
    - `adapter_names`: with a `PeftModel`, one adapter name per prompt (`"__base__"` for
      none): each row generates with its own adapter, all in one batch.

    **Returns:**

    `(batch, prompt + max_new_tokens)` ids: the prompts, then the new tokens. Once every
    row has finished, the remaining columns hold `pad_token_id` (transformers returns
    the shorter array instead).

    Compiled with `eqx.filter_jit`: shapes, `max_new_tokens`, `do_sample`, `top_k`,
    whether `top_p` applies and the model's structure are static (a new value of any
    recompiles); weights, the key, `temperature`, `top_p`, the special ids (up to 4 EOS
    ids share a program) and the adapter of each prompt are traced.

    ```python
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    batch = tokenizer(["Hello", "The capital of France is"], padding=True, return_tensors="np")
    model = peftx.from_pretrained(path)
    ids = peftx.generate(model, batch["input_ids"], 20, attention_mask=batch["attention_mask"])
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    ```
    """
    base = model.base_model if _is_peft_model(model) else model
    if not isinstance(base, CAUSAL_LM_CLASSES):
        names = ", ".join(c.__name__ for c in CAUSAL_LM_CLASSES)
        raise TypeError(
            f"generate runs a causal language model ({names}, or a PeftModel around one), "
            f"got {type(base).__name__}."
        )
    config = base.config
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"input_ids must be integer ids of shape (batch, prompt), got dtype {ids.dtype} "
            f"and shape {tuple(ids.shape)}."
        )
    batch, prompt = ids.shape
    if prompt == 0:
        raise ValueError("input_ids has no tokens; every prompt needs at least one.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
    mask, longest = _checked_mask(attention_mask, ids.shape)
    layers, kv_heads, head_dim, max_positions = cache_dims(config)
    if max_positions is not None and longest + max_new_tokens > max_positions:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the "
            f"{max_positions} positions this {type(base).__name__} has embeddings for."
        )

    if do_sample:
        if key is None:
            raise ValueError(
                "do_sample=True needs a PRNG key: pass key=jax.random.key(seed) (a new "
                "key draws new tokens)."
            )
        if not (
            isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0
        ):  # an infinite temperature would sample every token alike
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}.")
        if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
    else:
        key = None
    vocab = config.vocab_size
    top_k = None if top_k is None or not do_sample else min(top_k, vocab)
    use_top_p = do_sample and top_p is not None and top_p < 1.0

    eos = _eos_ids(config if eos_token_id is None else None, eos_token_id)
    if pad_token_id is None:
        pad_token_id = config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
    if not (isinstance(pad_token_id, Integral) and 0 <= pad_token_id < vocab):
        # a finished row feeds its padding back to the model: it must be a token
        raise ValueError(
            f"pad_token_id {pad_token_id!r} is not an id of this model's {vocab} tokens; "
            "pass pad_token_id= (it defaults to the config's, else the first eos id)."
        )

    route = None
    if adapter_names is not None:
        if not _is_peft_model(model):
            raise TypeError(
                f"adapter_names routes prompts to adapters of a PeftModel; this model is a "
                f"{type(model).__name__}, which has none."
            )
        if isinstance(adapter_names, str) or len(adapter_names) != batch:
            raise ValueError(
                f"adapter_names needs one name per prompt ({batch}), got {adapter_names!r}."
            )
        route = model.adapter_ids(list(adapter_names))  # integer ids: one compiled program

    placed = cache_sharding(model, batch, kv_heads)
    spec = _Spec(
        max_new_tokens,
        layers,
        kv_heads,
        head_dim,
        bool(do_sample),
        top_k,
        use_top_p,
        placed,
        _restart_step(base, prompt, max_new_tokens),
    )
    sampling = jnp.asarray([temperature, 1.0 if top_p is None else top_p], jnp.float32)
    # traced, so other special ids reuse the compiled program: the pad id, then the EOS
    # ids filled with -1 (never a token) to a multiple of 4
    slots = 4 * max(1, math.ceil(len(eos) / 4))
    special = jnp.asarray([int(pad_token_id), *eos, *[-1] * (slots - len(eos))], jnp.int32)
    return _generate(model, ids, mask, route, key, sampling, special, spec)


def _checked_mask(mask: Any, shape: tuple[int, int]) -> tuple[Array, int]:
    """The mask as int32, checked for left padding, and the longest prompt's real length
    (the width when the mask is traced and cannot be read)."""
    if mask is None:
        return jnp.ones(shape, jnp.int32), shape[1]
    mask = jnp.asarray(mask)
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; it must match input_ids {shape}."
        )
    try:
        host = np.asarray(mask)
    except jax.errors.TracerArrayConversionError:
        return mask.astype(jnp.int32), shape[1]  # traced under the caller's jit
    if not np.isin(host, (0, 1)).all():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens) only.")
    rows = np.flatnonzero(np.diff(host.astype(np.int8), axis=-1).min(axis=-1, initial=0) < 0)
    if rows.size:
        raise ValueError(
            f"prompts {rows.tolist()} are right-padded (a real token before padding); "
            "generate continues from the last column, so pad on the left (e.g. "
            "tokenizer.padding_side = 'left')."
        )
    empty = np.flatnonzero(host.sum(axis=-1) == 0)
    if empty.size:
        raise ValueError(f"prompts {empty.tolist()} are all padding; each needs a real token.")
    return mask.astype(jnp.int32), int(host.sum(axis=-1).max())


def cache_sharding(model: Any, batch: int, kv_heads: int) -> NamedSharding | None:
    """For a model on a mesh (`peftx.sharding`), the KV cache's placement: its rows split
    as a batch is (`data`, `fsdp`) and its heads over `tensor`, as tensor-parallel key and
    value projections give them, each where the axis divides; else None (so too under a
    caller's `jit`, whose traced weights do not say where they lie)."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(model)]
    mesh = next(
        (s.mesh for s in shardings if isinstance(s, NamedSharding) and s.mesh.size > 1), None
    )
    if mesh is None:
        return None
    rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    rows_split = rows if batch % batch_parts(mesh) == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
    return NamedSharding(mesh, PartitionSpec(None, rows_split or None, None, heads))


def cache_dims(config: Any) -> tuple[int, int, int, int | None]:
    """`(layers, kv_heads, head_dim, max_positions)` of the KV cache a config's model fills
    (`max_positions` where position embeddings are a table, else None)."""
    if config.model_type == "gpt2":
        return config.n_layer, config.n_head, config.n_embd // config.n_head, config.n_positions
    return config.num_hidden_layers, config.num_key_value_heads, config.head_dim, None


def _restart_step(model: Any, prompt: int, max_new_tokens: int) -> int | None:
    """The decode step whose sequence (`prompt + step` columns) is the first longer than a
    LongRoPE Phi-3's `original_max_position_embeddings`, where transformers drops the
    cache and runs the whole sequence (`Phi3ForCausalLM.prepare_inputs_for_generation`);
    None when no step crosses, or the rope does not depend on the length."""
    if not isinstance(model, Phi3ForCausalLM) or model.config.longrope_switch is None:
        return None
    step = model.config.longrope_switch + 1 - prompt
    return step if 1 <= step < max_new_tokens else None


def _eos_ids(config: Any, eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    if config is not None:
        eos_token_id = config.hf_dict().get("eos_token_id")
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, Integral) else tuple(eos_token_id)
    if not all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}.")
    return tuple(int(i) for i in ids)


def _has_implicit(tree: Any) -> bool:
    return any(is_implicit(x) for x in jax.tree.leaves(tree, is_leaf=is_implicit))


def _is_peft_model(model: Any) -> bool:
    """Whether `model` is a `PeftModel`, known by its interface (`base_model`, and
    `prepared` for routing): `peftx.models` sits below the PEFT layer and imports none of
    it."""
    return hasattr(model, "base_model") and callable(getattr(model, "prepared", None))


def routed_forward(model: Any, route: Array | None) -> Any:
    """`f(ids, mask, positions, cache) -> CausalLMOutput` for a plain, quantized or
    adapted model (a `PeftModel` routes each row by `route` when given)."""
    if _is_peft_model(model):
        return lambda *args, **kwargs: model(*args, adapter_names=route, **kwargs)
    if _has_implicit(model):
        call = use_implicit_args(lambda m, *args, **kwargs: m(*args, **kwargs))
        return lambda *args, **kwargs: call(model, *args, **kwargs)
    return model


def nucleus(
    scores: Float[Array, "batch vocab"], top_p: Float[Array, ""] | Float[Array, "batch 1"]
) -> Float[Array, "batch vocab"]:
    """transformers' `TopPLogitsWarper`: the scores with the least likely tokens whose
    cumulative probability stays within `1 - top_p` set to -inf, keeping at least the most
    likely one (`top_p`: one for every row, or each row's own)."""
    order = jnp.argsort(scores, axis=-1)
    ascending = jnp.take_along_axis(scores, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (cumulative <= 1 - top_p).at[:, -1].set(False)
    drop = jnp.take_along_axis(drop, jnp.argsort(order, axis=-1), axis=-1)
    return jnp.where(drop, -jnp.inf, scores)


def _choose(
    logits: Array, step: Array, key: Any, sampling: Array, spec: _Spec
) -> Int[Array, " batch"]:
    """The next token of each row from its float32 logits: argmax, or a draw after
    transformers' warpers (temperature, top-k, top-p)."""
    if not spec.do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scores = logits / sampling[0]
    if spec.top_k is not None:
        kth = lax.top_k(scores, spec.top_k)[0][:, -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if spec.use_top_p:
        scores = nucleus(scores, sampling[1])
    draw = jax.random.categorical(jax.random.fold_in(key, step), scores, axis=-1)
    return draw.astype(jnp.int32)


@eqx.filter_jit
def _generate(
    model: Any,
    input_ids: Array,
    mask: Array,
    route: Array | None,
    key: Any,
    sampling: Array,
    special: Array,
    spec: _Spec,
) -> Array:
    batch, prompt = input_ids.shape
    forward = routed_forward(model, route)
    pad, eos = special[0], special[1:]
    real = jnp.sum(mask, axis=-1)  # each row's real tokens: the next position
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)

    first = jax.eval_shape(lambda: forward(input_ids[:, :1], mask[:, :1], positions[:, :1]))
    empty = KVCache.empty(
        spec.layers,
        batch,
        prompt + spec.max_new_tokens,
        spec.kv_heads,
        spec.head_dim,
        first.logits.dtype,
    )
    out = forward(input_ids, mask, positions, cache=_placed(empty, spec.cache_sharding))

    def pick(logits: Array, step: Array, done: Array) -> tuple[Array, Array]:
        token = _choose(logits[:, -1].astype(jnp.float32), step, key, sampling, spec)
        token = jnp.where(done, pad, token)
        done = done | jnp.any(token[:, None] == eos[None, :], axis=-1)
        return token, done

    token, done = pick(out.logits, jnp.zeros((), jnp.int32), jnp.zeros((batch,), bool))
    tokens = jnp.full((batch, spec.max_new_tokens), pad, jnp.int32).at[:, 0].set(token)

    def cond(state: tuple) -> Array:
        step, _, _, _, done = state
        return (step < spec.max_new_tokens) & ~jnp.all(done)

    def advance(step: Array, cache: KVCache, tokens: Array, token: Array) -> tuple:
        ones = jnp.ones((batch, 1), jnp.int32)
        out = forward(token[:, None], ones, (real + step - 1)[:, None], cache=cache)
        return out.logits, out.cache

    def restart(step: Array, cache: KVCache, tokens: Array, token: Array) -> tuple:
        # the prompt and every token so far (a static width), into a fresh cache
        ids = jnp.concatenate([input_ids, tokens[:, : spec.restart_step]], axis=1)
        ids_mask = jnp.concatenate([mask, jnp.ones((batch, spec.restart_step), jnp.int32)], 1)
        every = jnp.maximum(jnp.cumsum(ids_mask, axis=-1) - 1, 0)
        out = forward(ids, ids_mask, every, cache=_placed(empty, spec.cache_sharding))
        return out.logits[:, -1:], out.cache

    def body(state: tuple) -> tuple:
        step, cache, tokens, token, done = state
        if spec.restart_step is None:
            logits, cache = advance(step, cache, tokens, token)
        else:
            restarts = step == spec.restart_step
            logits, cache = lax.cond(restarts, restart, advance, step, cache, tokens, token)
        token, done = pick(logits, step, done)
        tokens = lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, axis=1)
        return step + 1, _placed(cache, spec.cache_sharding), tokens, token, done

    state = (jnp.ones((), jnp.int32), out.cache, tokens, token, done)
    tokens = lax.while_loop(cond, body, state)[2]
    return jnp.concatenate([input_ids, tokens.astype(input_ids.dtype)], axis=1)


def _placed(cache: KVCache, sharding: NamedSharding | None) -> KVCache:
    """`cache` with its keys and values constrained to `sharding` (if any)."""
    if sharding is None:
        return cache
    key, value = (lax.with_sharding_constraint(x, sharding) for x in (cache.key, cache.value))
    return eqx.tree_at(lambda c: (c.key, c.value), cache, (key, value))
