"""`peftx serve`'s parts: the engine that batches requests over a bank of adapters, and
the OpenAI-compatible HTTP app around it."""

from ._app import make_app as make_app
from ._engine import (
    Engine as Engine,
    EngineError as EngineError,
    Request as Request,
    prompt_buckets as prompt_buckets,
    sample as sample,
    wait_for as wait_for,
)
