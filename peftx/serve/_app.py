"""The HTTP side of `peftx serve`: OpenAI's completions, chat completions and models
routes, vLLM's routes to load and unload LoRA adapters, and OpenAI's error bodies."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .._targets import BASE
from ._engine import Engine, EngineError, Request

MAX_STOPS = 4  # OpenAI's limit on `stop` strings


def error_body(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    kind = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        409: "conflict_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(message: str, status: int, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code), status_code=status)


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's: decode past end-of-sequence tokens

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is served (one choice per request)")
        return n

    def usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[_Part] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # default: the rest of the context
    max_completion_tokens: int | None = Field(None, ge=1)


def make_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine`, whose base answers to `model_name`."""
    app = FastAPI(title="peftx serve")
    app.state.open_completions = 0  # responses not yet sent whole (a drain waits for them)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return error_response("; ".join(problems) or "invalid request", 400)

    @app.exception_handler(EngineError)
    async def _refused(request: HttpRequest, exc: EngineError) -> JSONResponse:
        return error_response(str(exc), exc.status, exc.code)

    @app.middleware("http")
    async def _draining(request: HttpRequest, call_next: Callable) -> Any:
        if engine.draining:
            return error_response("the server is shutting down", 503)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        used, slots = engine.slots
        return {
            "status": "ok",
            "adapters": list(engine.adapters),
            "slots": {"used": used, "max_adapters": slots},
            "busy_rows": engine.busy_rows,
            "in_flight": engine.in_flight,
            "compiles_since_ready": engine.compiles,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "peftx",
                "root": model_name,
                "parent": parent,
            }

        cards = [card(model_name, None)] + [card(n, model_name) for n in engine.adapters]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(body: dict[str, Any]) -> PlainTextResponse:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise EngineError("lora_name and lora_path are required strings", 400)
        if name == model_name:
            raise EngineError(f"{name!r} is the base model's name", 400)
        await asyncio.wrap_future(engine.call(lambda: engine.load_adapter(name, path)))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(body: dict[str, Any]) -> PlainTextResponse:
        name = body.get("lora_name")
        if not isinstance(name, str):
            raise EngineError("lora_name is a required string", 400)
        engine.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def adapter_of(name: str) -> str:
        return BASE if name == model_name else name

    def check_vocab(ids: list[int]) -> None:
        vocab = engine.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", 400)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Any:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise EngineError("one prompt per request (got a list of several)", 400)
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            check_vocab(ids)
        request = _request(body, ids, adapter_of(body.model), body.max_tokens or 16)
        return await _respond(engine, request, body, http, "text_completion", app)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, http: HttpRequest) -> Any:
        if not getattr(tokenizer, "chat_template", None):
            raise EngineError("this model's tokenizer has no chat template", 400)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template's own error, for the client
            raise EngineError(f"the chat template refused these messages: {e}", 400) from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = body.max_completion_tokens or body.max_tokens
        room = engine.spec.max_model_len - len(ids)
        request = _request(body, ids, adapter_of(body.model), limit or max(room, 1))
        return await _respond(engine, request, body, http, "chat.completion", app)

    return app


def _request(body: _Sampling, ids: list[int], adapter: str, max_tokens: int) -> Request:
    return Request(
        prompt=list(ids),
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos,
    )


def _submit(engine: Engine, request: Request) -> asyncio.Queue:
    """Queue `request` on `engine` (`EngineError` if refused); its `(delta,
    finish_reason)` events arrive on the returned queue."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    request.emit = lambda delta, finish: loop.call_soon_threadsafe(
        events.put_nowait, (delta, finish)
    )
    engine.submit(request)
    return events


async def _events(
    events: asyncio.Queue, request: Request, http: HttpRequest
) -> AsyncIterator[tuple[str, str | None]]:
    """The request's events until it finishes. A client that leaves (the iteration is
    closed, or the connection is gone) cancels the request, which frees its row at the
    engine's next step."""
    try:
        while True:
            try:
                delta, finish = await asyncio.wait_for(events.get(), timeout=1.0)
            except TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            yield delta, finish
            if finish is not None:
                return
    finally:
        if request.finish_reason is None:
            request.cancelled = True


def _usage(request: Request) -> dict[str, int]:
    prompt, completion = len(request.prompt), len(request.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _respond(
    engine: Engine, request: Request, body: _Sampling, http: HttpRequest, kind: str, app: FastAPI
) -> Any:
    chat = kind == "chat.completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # refused here, a request gets its status before any stream starts
    events = _events(_submit(engine, request), request, http)
    first = [True]

    def choice(delta: str, finish: str | None, streamed: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        if not streamed:
            message = {"role": "assistant", "content": delta}
            return {"index": 0, "message": message, "finish_reason": finish}
        part = {"content": delta} if delta else {}
        if first[0]:  # as OpenAI streams: the role comes with the first chunk
            part, first[0] = {"role": "assistant", **part}, False
        return {"index": 0, "delta": part, "finish_reason": finish}

    def envelope(choices: list, streamed: bool) -> dict[str, Any]:
        obj = kind + (".chunk" if streamed and chat else "")
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": body.model,
            "choices": choices,
        }

    if not body.stream:
        finish = None
        app.state.open_completions += 1
        try:
            async for _, finish in events:
                pass
        finally:
            app.state.open_completions -= 1
        if finish is None:  # the client left
            return error_response("the client disconnected", 499)
        if finish == "error":
            return error_response("the engine failed; see the server's log", 500)
        out = envelope([choice(request.text, finish, streamed=False)], streamed=False)
        return JSONResponse({**out, "usage": _usage(request)})

    async def stream() -> AsyncIterator[str]:
        try:
            async for delta, finish in events:
                if finish == "error":
                    yield _sse(error_body("the engine failed; see the server's log", 500))
                    return
                if delta or finish is not None:
                    yield _sse(envelope([choice(delta, finish, streamed=True)], streamed=True))
            if body.usage_in_stream():
                yield _sse({**envelope([], streamed=True), "usage": _usage(request)})
            yield "data: [DONE]\n\n"
        finally:
            app.state.open_completions -= 1

    app.state.open_completions += 1
    return StreamingResponse(stream(), media_type="text/event-stream")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n"
