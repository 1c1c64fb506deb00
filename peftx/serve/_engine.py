"""The serving engine: one base model, its adapters in a bank, and a fixed batch of decode
rows that requests join and leave one token at a time (continuous batching).

Every device computation is one of the programs compiled at start: a decode step over all
rows, and a prefill per prompt-length bucket. Which adapter a row uses, its sampling
parameters and its place in the KV cache are data, so serving compiles nothing after
warm-up, whatever the traffic and whatever adapters come and go. One thread (the engine's)
runs the device and owns the model; the HTTP side submits requests and commands to it.
"""

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, UInt32

from .._bank import PeftBankModel
from .._peft_model import PeftModel
from .._targets import BASE
from ..models import (
    CAUSAL_LM_CLASSES,
    KVCache,
    cache_dims,
    cache_sharding,
    nucleus,
    routed_forward,
)

# Prompts are padded to the next of these lengths (and max_model_len), so that a handful
# of prefill programs serve every prompt.
SMALLEST_BUCKET = 16


class EngineError(Exception):
    """A request or command the engine refuses; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


@dataclasses.dataclass(eq=False)
class Request:
    """One completion: the prompt's token ids and how to continue it. `emit(delta,
    finish_reason)` is called from the engine's thread with each new piece of text, and
    once with a `finish_reason` ("stop" or "length") at the end; `tokens` and `text` grow
    as it decodes."""

    prompt: list[int]
    adapter: str  # an adapter's name, or BASE
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    emit: Callable[[str, str | None], None] = lambda delta, finish: None
    cancelled: bool = False  # set by the server when its client leaves
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # the text emitted so far
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What is static about the compiled programs."""

    max_batch: int
    max_model_len: int
    prefill_batch: int
    buckets: tuple[int, ...]
    layers: int
    kv_heads: int
    head_dim: int
    cache_dtype: Any
    cache_sharding: NamedSharding | None  # on a mesh: where the KV cache's arrays lie


def _placements(spec: EngineSpec) -> KVCache | None:
    """On a mesh, where each array of the KV cache lies (keys and values as
    `peftx.generate` places them, the rest whole); else None."""
    if spec.cache_sharding is None:
        return None
    whole = NamedSharding(spec.cache_sharding.mesh, PartitionSpec())
    return KVCache(spec.cache_sharding, spec.cache_sharding, whole, whole)


def _pinned(cache: KVCache, spec: EngineSpec) -> KVCache:
    """`cache` where every program leaves it, so that no call meets a new placement and
    compiles again."""
    placements = _placements(spec)
    if placements is None:
        return cache
    return jax.tree.map(lax.with_sharding_constraint, cache, placements)


Data = Array | np.ndarray  # host arrays going in, tracers inside the programs


def prompt_buckets(max_model_len: int) -> tuple[int, ...]:
    """Powers of two from `SMALLEST_BUCKET`, and `max_model_len` itself."""
    sizes, size = [], SMALLEST_BUCKET
    while size < max_model_len:
        sizes.append(size)
        size *= 2
    return (*sizes, max_model_len)


def sample(
    logits: Float[Data, "rows vocab"],
    temperature: Float[Data, " rows"],
    top_p: Float[Data, " rows"],
    seeds: UInt32[Data, " rows"],
    counts: Int[Data, " rows"],
) -> Int[Array, " rows"]:
    """Each row's next token: the argmax where its temperature is 0, else a draw at its
    temperature from its nucleus (`top_p`), keyed by its seed and its count of tokens so
    far, so that a request's tokens depend on its own parameters only."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    warm = temperature > 0
    scores = logits / jnp.where(warm, temperature, 1.0)[:, None]

    top_p = jnp.asarray(top_p)[:, None]
    scores = lax.cond(
        jnp.any(warm[:, None] & (top_p < 1)), lambda s: nucleus(s, top_p), lambda s: s, scores
    )

    def draw(seed: Array, count: Array, row: Array) -> Array:
        return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), count), row)

    drawn = jax.vmap(draw)(seeds, counts, scores).astype(jnp.int32)
    return jnp.where(warm, drawn, greedy)


class Rows(eqx.Module):
    """The per-row inputs of a decode step (host arrays, one entry per row)."""

    tokens: Int[Data, " rows"]  # the last token of each row, fed to the model
    active: Bool[Data, " rows"]  # rows holding a request
    routes: Int[Data, " rows"]  # each row's adapter slot (the bank's size: the base)
    temperature: Float[Data, " rows"]
    top_p: Float[Data, " rows"]
    seeds: UInt32[Data, " rows"]
    counts: Int[Data, " rows"]  # tokens generated so far


def _route(model: Any, routes: Array) -> Array | None:
    return routes if isinstance(model, PeftBankModel) else None


def _decode(inputs: tuple[Any, Rows, EngineSpec], cache: KVCache) -> tuple[KVCache, Array]:
    model, rows, spec = inputs
    # a free row decodes from an empty cache (its output is never read), so its index
    # never runs past the end however long it stays free
    cache = KVCache(
        cache.key,
        cache.value,
        cache.valid & rows.active[:, None],
        jnp.where(rows.active, cache.index, 0),
    )
    forward = routed_forward(model, _route(model, rows.routes))
    tokens = rows.tokens[:, None]
    out = forward(tokens, jnp.ones_like(tokens), cache=cache)
    logits = out.logits[:, -1].astype(jnp.float32)
    nxt = sample(logits, rows.temperature, rows.top_p, rows.seeds, rows.counts)
    return _pinned(out.cache, spec), nxt


class Prompts(eqx.Module):
    """A prefill's inputs: prompts right-padded to one bucket, and where each goes."""

    ids: Int[Data, "prompts bucket"]
    lengths: Int[Data, " prompts"]
    rows: Int[Data, " prompts"]  # the decode row each fills (`max_batch`: none, padding)
    routes: Int[Data, " prompts"]
    temperature: Float[Data, " prompts"]
    top_p: Float[Data, " prompts"]
    seeds: UInt32[Data, " prompts"]


def _prefill(inputs: tuple[Any, Prompts, EngineSpec], cache: KVCache) -> tuple[KVCache, Array]:
    model, p, spec = inputs
    n, width = p.ids.shape
    mask = (jnp.arange(width)[None, :] < p.lengths[:, None]).astype(jnp.int32)
    fresh = KVCache.empty(spec.layers, n, width, spec.kv_heads, spec.head_dim, spec.cache_dtype)
    out = routed_forward(model, _route(model, p.routes))(p.ids, mask, cache=fresh)
    last = jnp.take_along_axis(out.logits, (p.lengths - 1)[:, None, None], axis=1)[:, 0]
    first = sample(
        last.astype(jnp.float32), p.temperature, p.top_p, p.seeds, jnp.zeros_like(p.lengths)
    )
    # each prompt's keys and values into its row, from column 0; the rest of the row is
    # marked empty, and the row continues from the prompt's length
    key = cache.key.at[:, p.rows, :width].set(out.cache.key, mode="drop")
    value = cache.value.at[:, p.rows, :width].set(out.cache.value, mode="drop")
    valid = jnp.zeros((n, cache.valid.shape[1]), bool).at[:, :width].set(mask.astype(bool))
    valid = cache.valid.at[p.rows].set(valid, mode="drop")
    index = cache.index.at[p.rows].set(p.lengths, mode="drop")
    return _pinned(KVCache(key, value, valid, index), spec), first


def _programs(backend: str) -> tuple[Callable, Callable]:
    """The decode step and the prefill, compiled for `backend`. Off the CPU they update
    the KV cache in place (donated); on XLA:CPU donating it made the decode step 1.8x
    slower (25 against 14 ms, Llama hidden 512 with 32 rows), so there the step writes a
    new cache and the old one is freed."""
    donate = "none" if backend == "cpu" else "all-except-first"
    return eqx.filter_jit(_decode, donate=donate), eqx.filter_jit(_prefill, donate=donate)


class Engine:
    """Continuous batching over a model with adapters in a bank.

    - `model`: a causal LM `peftx.generate` runs (plain or NF4-quantized), or a
      `PeftBankModel` around one;
    - `tokenizer`: its transformers tokenizer (text in the stream is decoded with it);
    - `max_batch`: decode rows; `max_model_len`: the KV cache's length per row (a prompt
      plus its `max_tokens` must fit); `max_adapters`, `max_rank`: the bank's size when
      the first adapter is loaded into a model that has none yet.

    `start()` compiles every program and starts the engine's thread; `submit` queues a
    request; `load_adapter`/`unload_adapter` fill and free slots between steps; `drain()`
    lets running requests finish and refuses new ones; `stop()` ends the thread.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_model_len: int = 512,
        max_adapters: int = 16,
        max_rank: int | None = None,
        prefill_batch: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        base = model.base_model if isinstance(model, PeftBankModel) else model
        if not isinstance(base, CAUSAL_LM_CLASSES):
            names = ", ".join(c.__name__ for c in CAUSAL_LM_CLASSES)
            raise TypeError(f"serving needs a causal LM ({names}), got {type(base).__name__}")
        if isinstance(model, PeftModel):
            raise TypeError(
                "serving holds adapters in a bank: load them with PeftModel.from_pretrained("
                "..., max_adapters=N) (a PeftBankModel), not as a PeftModel"
            )
        for name, value, low in (
            ("max_batch", max_batch, 1),
            ("max_model_len", max_model_len, 2),
            ("max_adapters", max_adapters, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int of at least {low}, got {value!r}")
        layers, kv_heads, head_dim, positions = cache_dims(base.config)
        positions = positions or base.config.max_position_embeddings
        if max_model_len > positions:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the {positions} positions this "
                f"{type(base).__name__} has (max_position_embeddings)"
            )
        switch = getattr(base.config, "longrope_switch", None)
        if switch is not None and max_model_len > switch + 1:
            raise ValueError(
                f"max_model_len {max_model_len}: this Phi-3's LongRoPE switches factors past "
                f"{switch + 1} tokens, which a served row cannot recompute; give at most "
                f"{switch + 1}"
            )
        probe = jax.eval_shape(
            lambda: routed_forward(model, None)(
                jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)
            )
        )
        self.spec = EngineSpec(
            max_batch,
            max_model_len,
            prefill_batch or min(max_batch, 8),
            prompt_buckets(max_model_len),
            layers,
            kv_heads,
            head_dim,
            probe.logits.dtype,
            cache_sharding(model, max_batch, kv_heads),
        )
        self._decode, self._prefill = _programs(jax.default_backend())
        self.model = model
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self._pending: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._rows: list[Request | None] = [None] * max_batch
        self._waiting: list[Request] = []
        self._unloading: set[str] = set()
        self._lock = threading.RLock()  # the names, as submit and the commands see them
        self._wake = threading.Event()
        self._draining = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.compiles = 0  # programs compiled since start() returned
        self._ready = False
        self.cache = self._empty_cache()

    # -- what the server reads --------------------------------------------------------

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapters requests may name (loaded, not being unloaded)."""
        with self._lock:
            names = self.model.adapter_names if isinstance(self.model, PeftBankModel) else ()
            return tuple(n for n in names if n not in self._unloading)

    @property
    def slots(self) -> tuple[int, int]:
        """`(used, max_adapters)`."""
        if isinstance(self.model, PeftBankModel):
            return len(self.model.adapter_names), self.model.max_adapters
        return 0, self.max_adapters

    @property
    def vocab_size(self) -> int:
        base = self.model.base_model if isinstance(self.model, PeftBankModel) else self.model
        return base.config.vocab_size

    @property
    def busy_rows(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return self.busy_rows + len(self._waiting) + self._pending.qsize()

    @property
    def draining(self) -> bool:
        return self._draining

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Compile every program (a decode step, a prefill per bucket), then run."""
        jax.monitoring.register_event_duration_secs_listener(self._count_compile)
        model = self.model
        rows = self._rows_inputs()
        self.cache, _ = self._decode((model, rows, self.spec), self.cache)
        for width in self.spec.buckets:
            self.cache, _ = self._prefill((model, self._prompts([], width), self.spec), self.cache)
        jax.block_until_ready(self.cache)
        self._ready = True
        self._thread = threading.Thread(target=self._run, name="peftx-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests; running and queued ones finish."""
        self._draining = True
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        jax.monitoring.unregister_event_duration_listener(self._count_compile)

    def _count_compile(self, event: str, duration: float, **kwargs: Any) -> None:
        if self._ready and event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1

    # -- requests and commands ------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise `EngineError` for a request the engine cannot run."""
        if self._error is not None:
            raise EngineError(f"the engine failed ({self._error!r}); see the server's log", 500)
        if self._draining:
            raise EngineError("the server is shutting down", 503)
        if request.adapter != BASE and request.adapter not in self.adapters:
            raise EngineError(
                f"The model `{request.adapter}` does not exist.", 404, "model_not_found"
            )
        room = self.spec.max_model_len - len(request.prompt)
        if not request.prompt:
            raise EngineError("the prompt has no tokens", 400)
        if request.max_tokens > room:
            raise EngineError(
                f"This model's maximum context length is {self.spec.max_model_len} tokens; "
                f"the prompt has {len(request.prompt)} and max_tokens asks for "
                f"{request.max_tokens} more (give at most {max(room, 0)}).",
                400,
                "context_length_exceeded",
            )

    def submit(self, request: Request) -> None:
        """Queue `request` (checked first: `EngineError` if it cannot run)."""
        with self._lock:
            self.check(request)
            self._pending.put(request)
        self._wake.set()

    def call(self, command: Callable[[], Any]) -> Future:
        """Run `command()` on the engine's thread between steps; its result as a future."""
        future: Future = Future()
        self._commands.put((command, future))
        self._wake.set()
        return future

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load the PEFT adapter at `path` into a free slot as `name` (on the engine's
        thread; call through `call`)."""
        if name == BASE or not name:
            raise EngineError(f"{name!r} is not a name an adapter can take", 400)
        with self._lock:
            names = self.model.adapter_names if isinstance(self.model, PeftBankModel) else ()
            if name in names:
                state = "is being unloaded" if name in self._unloading else "is already loaded"
                raise EngineError(f"an adapter named {name!r} {state}", 400)
        try:
            if isinstance(self.model, PeftBankModel):
                if len(names) >= self.model.max_adapters:
                    raise EngineError(
                        f"the adapter bank is full: max_adapters={self.model.max_adapters} "
                        "(unload one first, or serve with a larger --max-adapters)",
                        409,
                    )
                model = self.model.load_adapter(path, name)
            else:  # the first adapter makes the bank (its targets and rank are the bank's)
                model = PeftModel.from_pretrained(
                    self.model,
                    path,
                    name,
                    max_adapters=self.max_adapters,
                    max_rank=self.max_rank,
                )
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a file does wrong is the client's
            message = " ".join(str(e).split()) or type(e).__name__
            raise EngineError(f"could not load adapter {name!r} from {path}: {message}", 400)
        with self._lock:
            self.model = model

    def unload_adapter(self, name: str) -> None:
        """Stop taking requests for `name`; its slot is freed once no request uses it."""
        with self._lock:
            if name not in self.adapters:
                raise EngineError(f"The model `{name}` does not exist.", 404, "model_not_found")
            self._unloading.add(name)
        self._wake.set()

    # -- the engine's thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                self._admit()
                self._free_unloaded()
                if not self.busy_rows:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            self._error = e
            for request in [*self._waiting, *(r for r in self._rows if r is not None)]:
                self._finish(request, "error")
            raise

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(command())
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                future.set_exception(e)

    def _slot(self, name: str) -> int:
        """A row's route: its adapter's slot, or the bank's size for the base (a model
        without a bank routes nothing)."""
        if not isinstance(self.model, PeftBankModel):
            return 0
        return self.model.max_adapters if name == BASE else self.model.table.slot(name)

    def _collect(self) -> None:
        """Move submitted requests to the waiting list, dropping those whose client left."""
        while True:
            try:
                self._waiting.append(self._pending.get_nowait())
            except queue.Empty:
                break
        self._waiting = [r for r in self._waiting if not r.cancelled]

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, a bucket's worth at a time."""
        self._collect()
        free = [i for i, r in enumerate(self._rows) if r is None]
        while self._waiting and free:
            n = min(len(free), self.spec.prefill_batch)
            batch, self._waiting = self._waiting[:n], self._waiting[n:]
            rows, free = free[: len(batch)], free[len(batch) :]
            longest = max(len(r.prompt) for r in batch)
            width = next(b for b in self.spec.buckets if b >= longest)
            prompts = self._prompts(list(zip(rows, batch)), width)
            self.cache, first = self._prefill((self.model, prompts, self.spec), self.cache)
            first = np.asarray(first)
            for k, (row, request) in enumerate(zip(rows, batch)):
                self._rows[row] = request
                self._take(row, request, int(first[k]))

    def _prompts(self, placed: list[tuple[int, Request]], width: int) -> Prompts:
        """A prefill's inputs: each `(row, request)` placed, padding after them."""
        n = self.spec.prefill_batch
        ids = np.zeros((n, width), np.int32)
        lengths = np.ones(n, np.int32)
        rows = np.full(n, self.spec.max_batch, np.int32)  # padding writes nowhere
        for k, (row, r) in enumerate(placed):
            ids[k, : len(r.prompt)], lengths[k], rows[k] = r.prompt, len(r.prompt), row
        sampling = self._per_request([(k, r) for k, (_, r) in enumerate(placed)], n)
        return Prompts(ids, lengths, rows, *sampling)

    def _rows_inputs(self) -> Rows:
        b = self.spec.max_batch
        tokens = np.zeros(b, np.int32)
        active = np.zeros(b, bool)
        counts = np.zeros(b, np.int32)
        busy = [(i, r) for i, r in enumerate(self._rows) if r is not None]
        for i, r in busy:
            tokens[i], active[i], counts[i] = r.tokens[-1], True, len(r.tokens)
        routes, temperature, top_p, seeds = self._per_request(busy, b)
        return Rows(tokens, active, routes, temperature, top_p, seeds, counts)

    def _per_request(
        self, placed: list[tuple[int, Request]], n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`(routes, temperature, top_p, seeds)` of `n` entries: each `(index, request)`'s
        own at its index, the base's greedy defaults elsewhere."""
        routes = np.full(n, self._slot(BASE), np.int32)
        temperature = np.zeros(n, np.float32)
        top_p = np.ones(n, np.float32)
        seeds = np.zeros(n, np.uint32)
        for k, r in placed:
            routes[k], temperature[k], top_p[k] = self._slot(r.adapter), r.temperature, r.top_p
            seeds[k] = self._seed(r)
        return routes, temperature, top_p, seeds

    @staticmethod
    def _seed(request: Request) -> int:
        if request.seed is None:
            request.seed = int(np.random.default_rng().integers(2**32))
        return request.seed % 2**32

    def _step(self) -> None:
        for i, r in enumerate(self._rows):
            if r is not None and r.cancelled:  # its client left: the row is free again
                self._rows[i] = None
        if not self.busy_rows:
            return
        self.cache, nxt = self._decode((self.model, self._rows_inputs(), self.spec), self.cache)
        nxt = np.asarray(nxt)
        for i, r in enumerate(self._rows):
            if r is not None:
                self._take(i, r, int(nxt[i]))

    def _take(self, row: int, request: Request, token: int) -> None:
        """A row's new token: the text it adds, and whether the request is done."""
        if token in self.eos and not request.ignore_eos:
            return self._end(row, request, "stop")
        request.tokens.append(token)
        text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in request.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._end(row, request, "stop", text[:cut])
        if len(request.tokens) >= request.max_tokens:
            return self._end(row, request, "length", text)
        # hold back what may be the start of a stop string, or half a character
        hold = max((len(s) - 1 for s in request.stop), default=0)
        ready = text[: len(text) - hold] if hold else text
        if ready.endswith("\ufffd"):
            return None
        if len(ready) > len(request.text) and ready.startswith(request.text):
            delta, request.text = ready[len(request.text) :], ready
            request.emit(delta, None)
        return None

    def _end(self, row: int, request: Request, reason: str, text: str | None = None) -> None:
        if text is None:
            text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        self._rows[row] = None
        delta = text[len(request.text) :] if text.startswith(request.text) else ""
        request.text = request.text + delta
        request.finish_reason = reason
        request.emit(delta, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.emit("", reason)

    def _free_unloaded(self) -> None:
        """Free the slot of each adapter being unloaded that no request uses any more."""
        if not self._unloading:
            return
        with self._lock:  # submit holds it too: no request slips in between
            self._collect()
            used = {r.adapter for r in [*self._waiting, *self._rows] if r is not None}
            for name in sorted(self._unloading - used):
                self.model = self.model.delete_adapter(name)
                self._unloading.discard(name)

    def _empty_cache(self) -> KVCache:
        s = self.spec
        cache = KVCache.empty(
            s.layers, s.max_batch, s.max_model_len, s.kv_heads, s.head_dim, s.cache_dtype
        )
        cache = eqx.tree_at(lambda c: c.index, cache, jnp.zeros(s.max_batch, jnp.int32))
        placements = _placements(s)
        return cache if placements is None else jax.device_put(cache, placements)


def wait_for(
    predicate: Callable[[], bool], timeout: float | int, every: float | int = 0.05
) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
