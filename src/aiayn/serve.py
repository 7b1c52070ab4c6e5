"""A translation server and an attention explorer in the browser (not in the paper): ``aiayn serve``.

    aiayn serve --model runs/ding/model [--host 127.0.0.1] [--port 8000]

An ASGI app (Starlette, served by uvicorn: the ``serve`` extra) over one ``Translator``:
- ``POST /translate`` ``{"texts": [...], "beam": 4, "alpha": 0.6, "max_len_a": 50,
  "no_repeat_ngram_size": 0}`` (all but ``texts`` optional) -> ``{"translations": [...]}``, what
  ``aiayn translate`` prints for the same texts and options;
- ``POST /attention`` ``{"text": "..."}`` -> the sentence's greedy translation and every attention
  weight the model used (``aiayn.viz.translation_attention``, what ``aiayn attention`` draws);
- ``GET /health`` -> ``{"status": "ok", "queued": texts waiting}``;
- ``GET /`` -> the explorer (``explorer.html``: plain HTML and JavaScript, no build step).

Concurrent requests are batched (``Batcher``): the texts of every request that arrives while the
model is busy, or within ``window_ms`` of the first, go to the model together, up to
``batch_tokens`` source tokens, where ``Translator.translate`` sorts them by length into batches of
``max_tokens`` positions. Each text's translation is what it gets translated alone (aiayn's
searches guarantee it for float weights), so batching changes speed, not output. At most
``max_queue`` texts wait; more are refused with 503. The model runs on one worker thread, so the
event loop keeps answering (``/health``, refusals) while it translates.

Bad input gets a 4xx and a JSON ``{"error": ...}``: a body that is not JSON (400), a field of the
wrong type or value, an unknown field or an empty list (422), too many or too long texts (413).
A client that disconnects before its answer does not disturb the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .model import Transformer
from .translator import Translator

__all__ = ["ServeOptions", "Batcher", "create_app", "model_thread", "serve", "serving"]

SEARCH_FIELDS = {"beam": (int, 1), "alpha": (float, 0.0), "max_len_a": (int, 0), "no_repeat_ngram_size": (int, 0)}


@dataclass(frozen=True)
class ServeOptions:
    """The server's limits and batching."""

    max_texts: int = 64  # texts per request (413 beyond)
    max_chars: int = 2000  # characters per text (413 beyond); the model truncates at its max_len tokens
    max_queue: int = 1024  # texts waiting for the model (503 beyond)
    window_ms: float = 5.0  # a batch waits this long after its first request for more, when the model is idle
    batch_tokens: int = 16384  # source tokens the model gets at once, across requests
    max_tokens: int = 4096  # positions per batch inside the model (Translator.translate's)
    max_beam: int = 16


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Job:
    texts: list[str]
    tokens: int
    search: tuple[tuple[str, Any], ...]  # sorted (name, value): requests with equal searches share batches
    future: asyncio.Future = field(repr=False)


class Batcher:
    """Gathers the texts of concurrent requests into batches for one ``Translator`` (module docstring)."""

    def __init__(
        self, translator: Translator, options: ServeOptions, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.translator, self.options = translator, options
        self.queued = 0  # texts waiting or being translated
        self.executor = executor or model_thread()
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self.executor.shutdown(wait=True)

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the model's thread (after what runs there now)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def translate(self, texts: list[str], search: dict[str, Any]) -> list[str]:
        """The translations of ``texts``, batched with other requests'; 503 when the queue is full."""
        if self.queued + len(texts) > self.options.max_queue:
            raise HTTPError(
                503, f"the server is busy: {self.queued} texts are waiting (at most {self.options.max_queue})"
            )
        tokens = sum(len(ids) + 1 for ids in self.translator.tokenizer.encode_batch(texts))
        future = asyncio.get_running_loop().create_future()
        self.queued += len(texts)
        self._queue.put_nowait(_Job(texts, tokens, tuple(sorted(search.items())), future))
        try:
            return await asyncio.shield(future)  # a cancelled request leaves its batch alone
        finally:
            self.queued -= len(texts)

    async def _run(self) -> None:
        """The worker: take a job, gather what else is queued (waiting ``window_ms`` for more only
        while nothing else is), translate each group of equal searches, hand out the results."""
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            tokens, deadline = jobs[0].tokens, loop.time() + self.options.window_ms / 1000
            while tokens < self.options.batch_tokens:
                try:
                    job = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        job = await asyncio.wait_for(self._queue.get(), remaining)
                    except TimeoutError:
                        break
                jobs.append(job)
                tokens += job.tokens
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.search, []).append(job)
            for search, group in groups.items():
                texts = [t for job in group for t in job.texts]
                try:
                    results = await self.call(self._translate, texts, dict(search))
                except Exception as e:  # the model failed: every request of the batch hears why
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(e)
                    continue
                start = 0
                for job in group:
                    if not job.future.done():
                        job.future.set_result(results[start : start + len(job.texts)])
                    start += len(job.texts)

    def _translate(self, texts: list[str], search: dict[str, Any]) -> list[str]:
        return self.translator.translate(texts, max_tokens=self.options.max_tokens, **search)


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs the model. Load the model on it too (``aiayn serve`` does:
    ``model_thread().submit(load).result()``) so that no other thread runs torch: with GNU OpenMP
    (torch's CPU builds) a second thread that has run torch operations, even one now idle, made
    every decoding step wait longer for its workers (they spin less once threads outnumber the
    cores): translating one sentence took 70 ms instead of 31 (2-core Xeon)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiayn-model")


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Any) -> dict[str, Any]:
    from starlette.requests import ClientDisconnect

    try:
        body = await request.body()
    except ClientDisconnect:  # gone before the whole body came: no one to answer
        raise HTTPError(400, "the client went away before the whole body came") from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(422, f"the body must be a JSON object, got {type(data).__name__}")
    return data


def _texts(value: Any, options: ServeOptions, name: str = "texts") -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise HTTPError(422, f"{name} must be a list of strings")
    if not value:
        raise HTTPError(422, f"{name} is empty: give at least one text")
    if len(value) > options.max_texts:
        raise HTTPError(413, f"{name}: {len(value)} texts, at most {options.max_texts} per request")
    for i, text in enumerate(value):
        if len(text) > options.max_chars:
            raise HTTPError(413, f"{name}[{i}]: {len(text)} characters, at most {options.max_chars}")
    return value


def _search(data: dict[str, Any], options: ServeOptions) -> dict[str, Any]:
    """The search options of a /translate body, checked (defaults: ``aiayn translate``'s)."""
    search = {}
    for name, value in data.items():
        if name == "texts":
            continue
        if name not in SEARCH_FIELDS:
            known = ", ".join(["texts", *SEARCH_FIELDS])
            raise HTTPError(422, f"unknown field {name!r}; known fields: {known}")
        kind, low = SEARCH_FIELDS[name]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            ok = ok and float(value).is_integer()
        if not ok or not math.isfinite(value) or value < low:
            raise HTTPError(
                422, f"{name} must be {'an integer' if kind is int else 'a number'} >= {low}, got {value!r}"
            )
        search[name] = kind(value)
    if search.get("beam", 1) > options.max_beam:
        raise HTTPError(422, f"beam must be at most {options.max_beam}, got {search['beam']}")
    return search


def attention_json(result: Any) -> dict[str, Any]:
    """``viz.translation_attention``'s result as JSON: per kind, per layer, per head, the weights
    ``[query][key]``."""

    def layers(weights: Any) -> list | None:
        return None if weights is None else [w.tolist() for w in weights]

    attention = result.attention
    return {
        "sentence": result.sentence,
        "translation": result.translation,
        "source": result.source,
        "target": result.target,
        "encoder": layers(attention.encoder),
        "decoder_self": layers(attention.decoder_self),
        "decoder_cross": layers(attention.decoder_cross),
    }


def create_app(
    translator: Translator,
    model: Transformer,
    options: ServeOptions | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> Any:
    """The Starlette app of ``aiayn serve`` for ``translator`` (module docstring); ``model``, the
    translator's model unprepared, draws the attention weights, as ``aiayn attention`` does.
    ``executor``: the model's thread (``model_thread``), the one they were loaded on."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    from .viz import translation_attention

    options = options or ServeOptions()
    batcher = Batcher(translator, options, executor)
    page = resources.files("aiayn").joinpath("explorer.html").read_text(encoding="utf-8")
    model.eval()

    def handles_errors(endpoint: Any) -> Any:
        async def wrapped(request: Any) -> Any:
            try:
                return await endpoint(request)
            except HTTPError as e:
                return _error(e.status, str(e))

        return wrapped

    @handles_errors
    async def translate(request: Any) -> Any:
        data = await _json_body(request)
        if "texts" not in data:
            raise HTTPError(422, "the body needs texts: a list of strings")
        texts = _texts(data["texts"], options)
        return JSONResponse({"translations": await batcher.translate(texts, _search(data, options))})

    @handles_errors
    async def attention(request: Any) -> Any:
        data = await _json_body(request)
        unknown = sorted(set(data) - {"text"})
        if unknown or not isinstance(data.get("text"), str):
            raise HTTPError(
                422, 'the body must be {"text": a string}' + (f"; unknown field(s) {unknown}" if unknown else "")
            )
        (text,) = _texts([data["text"]], options, "text")
        if not text.strip():
            raise HTTPError(422, "text is empty")
        weights = await batcher.call(lambda: attention_json(translation_attention(model, translator.tokenizer, text)))
        return JSONResponse(weights)

    async def health(request: Any) -> Any:
        return JSONResponse({"status": "ok", "queued": batcher.queued})

    async def index(request: Any) -> Any:
        return HTMLResponse(page)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        await batcher.start()
        yield
        await batcher.stop()

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/translate", translate, methods=["POST"]),
        Route("/attention", attention, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.batcher = batcher
    return app


def serve(
    translator: Translator,
    model: Transformer,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> None:
    """Run the server until interrupted (uvicorn); ``executor``: ``create_app``'s."""
    import uvicorn

    uvicorn.run(create_app(translator, model, options, executor), host=host, port=port, log_level="info")


@contextlib.contextmanager
def serving(app: Any, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Serve ``app`` with uvicorn in a background thread (``port=0``: a free one) while the
    ``with`` block runs; yields the base URL (for tests, notebooks, scripts)."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
