"""`peftx serve`: the engine in process against `peftx.generate`, and the server in a child
process on 127.0.0.1 driven by the official `openai` client (equal to `peftx.generate`,
under load, adapters loaded and unloaded while serving, bad requests, shutdown)."""

import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from helpers import WORDS, run_cli, tiny_llama_config, word_tokenizer

import peftx
from peftx.serve import Engine, Request, wait_for

EOS = WORDS.index("</s>")
ADAPTERS = 16
MAX_LEN = 64
# a chat template over the test vocabulary: each message's words, then "w0" cues the answer
TEMPLATE = (
    "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}"
    "{% if add_generation_prompt %}w0 {% endif %}"
)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny random Llama with a word tokenizer (and a chat template), and LoRA adapters
    of ranks 4 and 2 saved as PEFT saves them: a0-a2 here, a3-a15 when a server needs
    them (`_write_adapters`)."""
    root = tmp_path_factory.mktemp("serve")
    _write_base(root, seed=0, chat_template=TEMPLATE, initializer_range=0.2)
    _write_adapters(root, range(3))
    return root


def _write_base(root, seed, chat_template=None, **config):
    """A random transformers Llama over the test vocabulary (`config`: its sizes) and a
    word tokenizer, saved in `root / "base"`."""
    import torch
    import transformers

    config = tiny_llama_config(
        len(WORDS), bos_token_id=None, eos_token_id=EOS, max_position_embeddings=128, **config
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer = word_tokenizer(WORDS)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(root / "base")


def _write_adapters(root, numbers):
    base = peftx.from_pretrained(root / "base")
    for k in numbers:
        if (root / f"a{k}").is_dir():
            continue
        lora = peftx.LoraConfig(
            r=2 if k % 2 else 4,
            lora_alpha=64,  # an update that changes what the model says
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=False,
        )
        model = peftx.get_peft_model(base, lora, key=jax.random.key(k + 1))
        model.save_pretrained(root / f"a{k}")


@pytest.fixture(scope="module")
def slow_zoo(tmp_path_factory):
    """The zoo's vocabulary on a Llama wide and deep enough that one row's 56 tokens take a
    while on any machine: the shutdown tests' requests are still decoding when the signal
    comes."""
    root = tmp_path_factory.mktemp("serve_slow")
    _write_base(
        root,
        seed=1,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    _write_adapters(root, range(2))
    return root


def _prompt(rng, n):
    return " ".join(rng.choice(WORDS[5:], n))


def _base(zoo, kind="float32"):
    """The zoo's base in float32 or bfloat16, or NF4-quantized (QLoRA's base)."""
    base = peftx.from_pretrained(zoo / "base", dtype="bfloat16" if kind == "bfloat16" else None)
    if kind == "nf4":
        base = peftx.quantize_model(base, peftx.QuantizationConfig(load_in_4bit=True))
    return base


def _reference(zoo, adapter, ids, max_tokens, kind="float32"):
    """`peftx.generate`'s greedy continuation's new tokens, up to the end of sequence."""
    return _references(zoo, adapter, [ids], [max_tokens], kind)[0]


def _references(zoo, adapter, prompts, max_tokens, kind="float32"):
    """`_reference` of several prompts with one adapter in one left-padded batch (one
    compile): each row's first `max_tokens[i]` new tokens are its own greedy answer."""
    base = _base(zoo, kind)
    model = base if adapter is None else peftx.PeftModel.from_pretrained(base, zoo / adapter)
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    out = peftx.generate(
        model, ids, max(max_tokens), attention_mask=mask, eos_token_id=EOS, pad_token_id=0
    )
    answers = []
    for row, n in zip(np.asarray(out)[:, width:].tolist(), max_tokens):
        row = row[:n]
        answers.append(row[: row.index(EOS)] if EOS in row else row)
    return answers


def _tokenizer(zoo):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(zoo / "base", local_files_only=True)


# -- the engine, in process ----------------------------------------------------------------


def _engine(zoo, kind="float32"):
    bank = peftx.PeftModel.from_pretrained(
        _base(zoo, kind), zoo / "a0", "a0", max_adapters=4, max_rank=4
    )
    for name in ("a1", "a2"):
        bank = bank.load_adapter(zoo / name, name)
    engine = Engine(bank, _tokenizer(zoo), max_batch=3, max_model_len=MAX_LEN, eos_token_ids=(EOS,))
    engine.start()
    return engine


def _served(engine, requests, timeout=120):
    """Submit `requests` together and wait until each has finished."""
    done = [threading.Event() for _ in requests]
    for request, event in zip(requests, done):
        emit = request.emit
        request.emit = lambda d, f, e=event, emit=emit: (emit(d, f), f and e.set())
        engine.submit(request)
    assert all(event.wait(timeout) for event in done)


@pytest.fixture(scope="module")
def engine(zoo):
    """One engine for the in-process tests: three rows over a bank of three adapters."""
    e = _engine(zoo)
    yield e
    e.stop()


@pytest.mark.parametrize(
    "kind",
    [
        "float32",
        pytest.param("bfloat16", marks=pytest.mark.variant_sweep),
        pytest.param("nf4", marks=pytest.mark.variant_sweep),
    ],
)
def test_engine_rows_equal_generate_each_with_its_own_adapter(zoo, engine, kind):
    """Requests on the base and three adapters, more than the rows, decoded together
    (joining as rows free up): each equals `peftx.generate` with its own adapter, on a
    float32, a bfloat16 and an NF4 base, and nothing compiles after start."""
    if kind != "float32":
        engine = _engine(zoo, kind)
    tokenizer = engine.tokenizer
    rng = np.random.default_rng(0)
    requests = [
        Request(tokenizer(_prompt(rng, 3 + 2 * k))["input_ids"], adapter, max_tokens=6 + k)
        for k, adapter in enumerate(["a0", peftx.BASE, "a1", "a2", "a0", "a2", peftx.BASE])
    ]
    try:
        _served(engine, requests)
        assert engine.compiles == 0
    finally:
        if kind != "float32":
            engine.stop()
    for adapter in {r.adapter for r in requests}:
        mine = [r for r in requests if r.adapter == adapter]
        name = None if adapter == peftx.BASE else adapter
        wants = _references(zoo, name, [r.prompt for r in mine], [r.max_tokens for r in mine], kind)
        for request, want in zip(mine, wants):
            assert request.tokens == want, adapter
            assert request.text == tokenizer.decode(want, skip_special_tokens=True)


def test_an_engine_without_adapters_makes_its_bank_at_the_first_load(zoo):
    """Serving the base alone, then loading adapters: the first load makes the bank (its
    programs compile again), and rows on the new adapters and on the base equal
    `peftx.generate`."""
    engine = Engine(
        _base(zoo),
        _tokenizer(zoo),
        max_batch=2,
        max_model_len=16,  # one prompt bucket: fewer programs to compile twice
        max_adapters=3,
        max_rank=4,
        eos_token_ids=(EOS,),
    )
    engine.start()
    try:
        ids = engine.tokenizer(_prompt(np.random.default_rng(8), 5))["input_ids"]
        before = Request(list(ids), peftx.BASE, max_tokens=6)
        _served(engine, [before])
        assert engine.adapters == () and engine.slots == (0, 3)
        for name in ("a1", "a0"):  # rank 2 first: the bank's rank is max_rank's 4
            engine.call(lambda n=name: engine.load_adapter(n, zoo / n)).result(120)
        assert engine.adapters == ("a1", "a0") and engine.slots == (2, 3)
        requests = [Request(list(ids), name, max_tokens=6) for name in ("a0", peftx.BASE, "a1")]
        _served(engine, requests)
    finally:
        engine.stop()
    assert before.tokens == requests[1].tokens == _reference(zoo, None, ids, 6)
    for request in (requests[0], requests[2]):
        assert request.tokens == _reference(zoo, request.adapter, ids, 6), request.adapter


def test_stop_strings_end_the_text_before_them_and_never_stream(engine):
    """A stop string ends the request before it (finish_reason "stop"), and no piece of
    the stream holds it, as OpenAI's `stop` does."""
    ids = engine.tokenizer(_prompt(np.random.default_rng(5), 4))["input_ids"]
    full = Request(list(ids), "a1", max_tokens=20, ignore_eos=True)
    _served(engine, [full])
    words = full.text.split()
    stop = f"{words[4]} {words[5]}"  # two words: a piece may end inside it
    pieces = []
    cut = Request(
        list(ids),
        "a1",
        max_tokens=20,
        ignore_eos=True,
        stop=("zzz", stop),
        emit=lambda d, f: pieces.append(d),
    )
    _served(engine, [cut])
    want = full.text[: full.text.index(stop)]  # holds no stop string
    assert cut.text == "".join(pieces) == want
    assert cut.finish_reason == "stop"


def test_a_request_whose_client_left_frees_its_row_at_the_next_step(engine):
    ids = engine.tokenizer(_prompt(np.random.default_rng(6), 4))["input_ids"]
    gone = Request(list(ids), "a0", max_tokens=50, ignore_eos=True)
    gone.emit = lambda d, f: setattr(gone, "cancelled", True)  # leaves at its first piece
    engine.submit(gone)
    after = Request(list(ids), "a2", max_tokens=3)
    _served(engine, [after])
    assert gone.finish_reason is None and len(gone.tokens) <= 2
    assert after.finish_reason in ("stop", "length")
    assert wait_for(lambda: engine.busy_rows == 0, 60, every=0.01)


def test_sampling_is_greedy_at_temperature_zero_and_keyed_by_seed():
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    zero, warm = np.zeros(4, np.float32), np.full(4, 1.0, np.float32)
    seeds, counts = np.arange(4, dtype=np.uint32), np.zeros(4, np.int32)
    top = np.ones(4, np.float32)
    greedy = peftx.serve.sample(logits, zero, top, seeds, counts)
    np.testing.assert_array_equal(greedy, np.argmax(logits, -1))
    a = peftx.serve.sample(logits, warm, top, seeds, counts)
    b = peftx.serve.sample(logits, warm, top, seeds, counts)
    np.testing.assert_array_equal(a, b)
    # a nucleus this small keeps only the most likely token: greedy again
    tiny = np.full(4, 1e-6, np.float32)
    np.testing.assert_array_equal(peftx.serve.sample(logits, warm, tiny, seeds, counts), greedy)
    # rows sample apart: 200 seeds at temperature 1 do not all draw the argmax
    many = jax.random.normal(jax.random.key(1), (200, 8)) * 0.1
    drawn = peftx.serve.sample(
        many,
        np.ones(200, np.float32),
        np.ones(200, np.float32),
        np.arange(200, dtype=np.uint32),
        np.zeros(200, np.int32),
    )
    assert (np.asarray(drawn) != np.argmax(many, -1)).mean() > 0.5


# -- the server, in a child process ------------------------------------------------------


class Server:
    """`peftx serve` in a child process on 127.0.0.1 (a free port), read until ready."""

    def __init__(self, zoo, *args, adapters=range(ADAPTERS), env=None):
        _write_adapters(zoo, adapters)
        argv = [sys.executable, "-m", "peftx", "serve", str(zoo / "base"), "--port", "0"]
        for k in adapters:
            argv += ["--adapter", f"a{k}={zoo / f'a{k}'}"]
        argv += ["--max-model-len", str(MAX_LEN), "--max-rank", "4", *map(str, args)]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines = []
        deadline = time.monotonic() + 300
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the server exited: {self.stderr_lines()}")
            self.lines.append(line)
            found = re.search(r"ready on (http://\S+) ", line)
            if found:
                self.url = found.group(1)
                break
            assert time.monotonic() < deadline, "the server did not get ready"
        self.base_name = str(zoo / "base")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stderr_lines(self):
        return Path(self.log.name).read_text().splitlines()

    def health(self):
        return httpx.get(self.url + "/health").json()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


@pytest.fixture(scope="module")
def server(zoo):
    s = Server(zoo, "--max-adapters", 20, "--max-batch", 8)
    yield s
    s.stop()


def _complete(client, model, prompt, max_tokens, *, chat=False, stream=False, **kw):
    """`(text, finish_reason, usage)` of one greedy request through the openai client."""
    if chat:
        messages = [{"role": "user", "content": prompt}]
        call = client.chat.completions.create
        args = dict(messages=messages)
    else:
        call = client.completions.create
        args = dict(prompt=prompt)
    options = dict(model=model, max_tokens=max_tokens, temperature=0, stream=stream, **kw)
    if stream:
        options["stream_options"] = {"include_usage": True}
    out = call(**args, **options)
    if not stream:
        c = out.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason, out.usage
    text, finish, usage = "", None, None
    for chunk in out:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            finish = c.finish_reason or finish
    return text, finish, usage


@pytest.mark.command_run
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_greedy_completions_equal_generate(zoo, server, chat):
    """Through the openai client, streamed and not: the base and three adapters continue
    each prompt as `peftx.generate` does with that adapter, token for token."""
    tokenizer = _tokenizer(zoo)
    rng = np.random.default_rng(1)
    for k, adapter in enumerate([None, "a0", "a1", "a5"]):
        prompt = _prompt(rng, 4 + k)
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        want = _reference(zoo, adapter, ids, 10)
        for stream in (False, True):
            model = server.base_name if adapter is None else adapter
            text, finish, usage = _complete(
                server.client, model, prompt, 10, chat=chat, stream=stream
            )
            assert text == tokenizer.decode(want, skip_special_tokens=True), (adapter, stream)
            assert finish == ("length" if len(want) == 10 else "stop")
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want))
            assert usage.total_tokens == len(ids) + len(want)


@pytest.mark.command_run
def test_models_lists_the_base_and_every_adapter(server):
    names = [m.id for m in server.client.models.list()]
    assert names == [server.base_name, *(f"a{k}" for k in range(ADAPTERS))]


@pytest.mark.command_run
def test_under_load_every_request_equals_its_answer_alone(zoo, server):
    """200 requests from 32 concurrent clients over 16 adapters and the base, of mixed
    lengths, streamed and not: each equals the same request sent alone (no row sees
    another's adapter or cache), and nothing compiles."""
    rng = random.Random(2)
    models = [server.base_name, *(f"a{k}" for k in range(ADAPTERS))]
    jobs = [
        (
            rng.choice(models),
            _prompt(np.random.default_rng(k), rng.randint(1, 24)),
            rng.randint(1, 24),
            rng.random() < 0.5,
        )
        for k in range(200)
    ]
    alone = [_complete(server.client, m, p, n)[0] for m, p, n, _ in jobs]
    assert len({a for (m, *_), a in zip(jobs, alone)}) > 50  # adapters change the answers
    before = server.health()["compiles_since_ready"]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(
            pool.map(lambda job: _complete(server.client, *job[:3], stream=job[3])[0], jobs)
        )
    assert together == alone
    assert server.health()["compiles_since_ready"] == before == 0


@pytest.mark.command_run
def test_adapters_load_and_unload_while_serving(zoo, server):
    """Under a steady load on other adapters: an adapter loaded while serving answers as
    the same files served from the start; unloaded, it is a 404, and a request already
    decoding with it finishes with it; a full bank is a 409; no other request fails."""
    client = server.client
    prompt = _prompt(np.random.default_rng(3), 5)
    want = _complete(client, "a7", prompt, 20)[0]  # a7's files, served from the start
    stop, failures, served = threading.Event(), [], []

    def load():
        rng = random.Random(4)
        while not stop.is_set():
            model = rng.choice([server.base_name, "a0", "a1", "a2", "a3"])
            try:
                served.append(_complete(client, model, _prompt(np.random.default_rng(), 4), 8))
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                failures.append(e)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        post = lambda route, **body: httpx.post(server.url + route, json=body, timeout=60)  # noqa: E731
        assert (
            post("/v1/load_lora_adapter", lora_name="x", lora_path=str(zoo / "a7")).status_code
            == 200
        )
        assert _complete(client, "x", prompt, 20)[0] == want
        assert "x" in [m.id for m in client.models.list()]
        # a long stream on x, unloaded after its first chunk: it finishes with x
        stream = client.completions.create(
            model="x", prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        assert post("/v1/unload_lora_adapter", lora_name="x").status_code == 200
        with pytest.raises(openai.NotFoundError):
            _complete(client, "x", prompt, 4)
        text += "".join(c.choices[0].text for c in chunks)
        assert text == want
        # 16 adapters in a bank of 20: four more fill it, a fifth is refused
        for k in range(4):
            r = post("/v1/load_lora_adapter", lora_name=f"y{k}", lora_path=str(zoo / f"a{k}"))
            assert r.status_code == 200, r.text
        full = post("/v1/load_lora_adapter", lora_name="y4", lora_path=str(zoo / "a4"))
        assert full.status_code == 409
        assert "max_adapters=20" in full.json()["error"]["message"]
        for k in range(4):
            assert post("/v1/unload_lora_adapter", lora_name=f"y{k}").status_code == 200
        assert post("/v1/unload_lora_adapter", lora_name="y0").status_code == 404
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert len(served) > 10


@pytest.mark.command_run
def test_bad_requests_get_their_status_and_an_openai_error_body(zoo, server, tmp_path):
    """Each bad request gets its status and OpenAI's error body, and the server keeps
    serving."""
    url = server.url

    def status(route, body=None, raw=None):
        r = httpx.post(url + route, json=body, content=raw, timeout=60)
        error = r.json()["error"]
        assert {"message", "type", "code"} <= set(error), r.text
        assert error["message"], r.text
        return r.status_code

    model = server.base_name
    ok = {"model": model, "prompt": "w5 w6", "max_tokens": 4}
    headers_json = b'{"model": "x", "prompt": '  # malformed JSON
    assert status("/v1/completions", raw=headers_json) == 400
    assert status("/v1/completions", {"prompt": "w5"}) == 400  # no model
    assert status("/v1/chat/completions", {"model": model}) == 400  # no messages
    assert status("/v1/completions", {**ok, "max_tokens": -1}) == 400
    assert status("/v1/completions", {**ok, "max_tokens": 10**9}) == 400
    assert status("/v1/completions", {**ok, "temperature": "hot"}) == 400
    assert status("/v1/completions", {**ok, "n": 2}) == 400
    assert status("/v1/completions", {**ok, "model": "nope"}) == 404
    assert status("/v1/completions", {**ok, "prompt": " ".join(["w5"] * MAX_LEN)}) == 400
    assert status("/v1/completions", {**ok, "prompt": [10**6]}) == 400  # not a token id
    # adapters that cannot load: not a PEFT directory, a corrupt one, a missing one
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(zoo / "a0", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    broken = tmp_path / "broken"
    shutil.copytree(zoo / "a0", broken)
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": "x"}))
    for path in (empty, corrupt, broken, tmp_path / "missing"):
        body = {"lora_name": "bad", "lora_path": str(path)}
        assert status("/v1/load_lora_adapter", body) == 400, path
    assert status("/v1/load_lora_adapter", {"lora_name": "bad"}) == 400
    assert status("/v1/unload_lora_adapter", {"lora_name": "nope"}) == 404
    # and it keeps serving
    text, finish, _ = _complete(server.client, model, "w5 w6", 4)
    assert finish in ("stop", "length")
    assert "bad" not in [m.id for m in server.client.models.list()]


@pytest.mark.command_run
def test_sigterm_drains_then_exits_0(slow_zoo):
    """SIGTERM while requests decode and wait for a row: they all finish whole, a new
    request gets 503, and the process exits 0."""
    s = Server(slow_zoo, "--max-batch", 1, adapters=range(2))
    client = s.client
    n, tokens = 16, MAX_LEN - 8  # one row: the last finishes seconds after SIGTERM
    options = dict(extra_body={"ignore_eos": True})
    distinct = [_prompt(np.random.default_rng(10 + k), 4) for k in range(4)]
    answers = {p: _complete(client, "a1", p, tokens, **options)[0] for p in distinct}
    prompts = [distinct[k % 4] for k in range(n)]
    alone = [answers[p] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        running = [pool.submit(_complete, client, "a1", p, tokens, **options) for p in prompts]
        assert wait_for(lambda: s.health()["in_flight"] == n, 60, every=0.01)  # every request in
        s.process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        late = httpx.post(
            s.url + "/v1/completions", json={"model": "a1", "prompt": "w5", "max_tokens": 2}
        )
        assert late.status_code == 503
        assert late.json()["error"]["message"]
        results = [f.result(timeout=120) for f in running]
    assert [r[0] for r in results] == alone
    assert all(r[1] == "length" for r in results)
    assert s.process.wait(120) == 0


@pytest.mark.command_run
def test_a_second_sigterm_ends_it_at_once(slow_zoo):
    s = Server(slow_zoo, "--max-batch", 1, adapters=range(2))
    options = dict(extra_body={"ignore_eos": True})
    prompt = _prompt(np.random.default_rng(11), 4)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        running = [
            pool.submit(_complete, s.client, "a1", prompt, MAX_LEN - 8, **options)
            for _ in range(16)
        ]
        assert wait_for(lambda: s.health()["in_flight"] == len(running), 60, every=0.01)
        s.process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(30) == -signal.SIGTERM
        unfinished = 0
        for f in running:
            try:
                f.result(timeout=30)
            except openai.APIError:  # the connection closed under it
                unfinished += 1
    assert unfinished > 0


@pytest.mark.command_run
@pytest.mark.simulated_devices
def test_on_a_mesh_it_serves_what_one_device_generates(zoo):
    """On 8 simulated devices with tensor-parallel weights: greedy completions equal one
    device's `peftx.generate`, and nothing compiles after warm-up."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    s = Server(
        zoo, "--mesh", "tensor=2", "--mesh", "rules=tp", adapters=(1, 2), env={"XLA_FLAGS": flags}
    )
    try:
        assert any("mesh data=1, fsdp=4, tensor=2" in line for line in s.stderr_lines())
        tokenizer = _tokenizer(zoo)
        rng = np.random.default_rng(7)
        for adapter in (None, "a1", "a2"):
            prompt = _prompt(rng, 5)
            want = _reference(zoo, adapter, tokenizer(prompt)["input_ids"], 12)
            text = _complete(s.client, adapter or s.base_name, prompt, 12)[0]
            assert text == tokenizer.decode(want, skip_special_tokens=True), adapter
        assert s.health()["compiles_since_ready"] == 0
    finally:
        assert s.stop() == 0


def test_help_names_every_option_and_bad_options_are_one_line(zoo, capsys, tmp_path):
    with pytest.raises(SystemExit):
        run_cli(capsys, "serve", "--help")
    out = capsys.readouterr().out
    for option in (
        "--adapter NAME=PATH",
        "--max-adapters",
        "--max-rank",
        "--max-batch",
        "--max-model-len",
        "--host",
        "--port",
        "--served-model-name",
        "--quantize",
        "--mesh",
    ):
        assert option in out, option
    base = zoo / "base"
    for argv, message in (
        (["--adapter", "a0"], "--adapter 'a0': expected NAME=PATH"),
        (["--adapter", f"x={tmp_path / 'missing'}"], "does not exist"),
        (["--adapter", f"x={zoo / 'a0'}", "--adapter", f"x={zoo / 'a1'}"], "given twice"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--port", "70000"], "--port must be in [0, 65536)"),
        (["--max-model-len", "1000"], "--max-model-len must be in [2, 128]"),
    ):
        code, _, err = run_cli(capsys, "serve", base, *argv)
        assert code in (1, 2) and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    with socket.socket() as taken:  # a port in use is refused before anything loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", base, "--port", port)
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err
