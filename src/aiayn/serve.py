"""A translation server and an attention explorer in the browser (not in the paper): ``aiayn serve``.

    aiayn serve --model runs/ding/model [--host 127.0.0.1] [--port 8000]

An ASGI app (Starlette, served by uvicorn: the ``serve`` extra) over one ``Translator``:
- ``POST /translate`` ``{"texts": [...], "beam": 4, "alpha": 0.6, "max_len_a": 50,
  "no_repeat_ngram_size": 0}`` (all but ``texts`` optional) -> ``{"translations": [...]}``, what
  ``aiayn translate`` prints for the same texts and options;
- ``POST /attention`` ``{"text": "...", "beam": 1, "alpha": 0.6}`` -> the sentence's translation
  and every attention weight the model used for it (``aiayn.viz.translation_attention``, what
  ``aiayn attention`` draws);
- ``GET /health`` -> ``{"status": "ok", "queued": texts waiting}`` (500 once the worker has stopped);
- ``GET /`` -> the explorer (``explorer.html``: plain HTML and JavaScript, no build step).

Concurrent requests are batched (``Batcher``): the texts of every request that arrives while the
model is busy, or within ``window_ms`` of the first, go to the model together, up to
``batch_tokens`` source tokens, where ``Translator.translate`` sorts them by length into batches of
``max_tokens`` positions. Each text's translation is what it gets translated alone (aiayn's
searches guarantee it for float weights), so batching changes speed, not output. At most
``max_queue`` texts wait; more are refused with 503. The model runs on one worker thread, so the
event loop keeps answering (``/health``, refusals) while it translates.

Bad input gets a 4xx and a JSON ``{"error": ...}``: a body that is not JSON (400), a field of the
wrong type or value, an unknown field, an empty list or invalid Unicode (422), a body, text count
or text over its limit (413); a failure inside is a JSON 500, and the worker goes on. A client
that disconnects before its answer does not disturb the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .model import Transformer
from .translator import Translator

__all__ = ["ServeOptions", "Batcher", "create_app", "model_thread", "serve", "serving"]

log = logging.getLogger("aiayn.serve")

# name: (type, least, most), the bounds None where the command sets none (beam: ServeOptions.max_beam)
SEARCH_FIELDS = {
    "beam": (int, 1, None), "alpha": (float, None, None), "max_len_a": (int, 0, 1024),
    "no_repeat_ngram_size": (int, 0, 1024),
}  # fmt: skip


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

    def __post_init__(self) -> None:
        if self.max_queue < self.max_texts:
            raise ValueError(f"max_queue ({self.max_queue}) must be at least max_texts ({self.max_texts})")

    @property
    def max_body(self) -> int:
        """Bytes a request body may have: the texts at their largest (4 UTF-8 bytes a character, 6
        escaped) and room for the JSON around them."""
        return self.max_texts * (6 * self.max_chars + 8) + 4096


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
        self._worker = None  # the model's thread stays: the app may start again

    @property
    def alive(self) -> bool:
        """Whether the worker that feeds the model runs (``/health`` says so)."""
        return self._worker is not None and not self._worker.done()

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the model's thread (after what runs there now)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def admit(self, n: int) -> None:
        """Count ``n`` more texts waiting for the model; 503 when the queue is full."""
        if self.queued + n > self.options.max_queue:
            raise HTTPError(
                503, f"the server is busy: {self.queued} texts are waiting (at most {self.options.max_queue})"
            )
        if not self.alive:
            raise HTTPError(500, "the server's model worker has stopped; restart the server")
        self.queued += n

    async def translate(self, texts: list[str], search: dict[str, Any]) -> list[str]:
        """The translations of ``texts``, batched with other requests'; 503 when the queue is full."""
        self.admit(len(texts))
        try:
            tokens = sum(len(self.translator.tokenizer.encode(t)) + 1 for t in texts)
            future = asyncio.get_running_loop().create_future()
            self._queue.put_nowait(_Job(texts, tokens, tuple(sorted(search.items())), future))
            return await asyncio.shield(future)  # a cancelled request leaves its batch alone
        finally:
            self.queued -= len(texts)

    async def exclusive(self, fn: Any, n: int = 1) -> Any:
        """``fn()`` on the model's thread, counted as ``n`` queued texts (``/attention``)."""
        self.admit(n)
        try:
            return await self.call(fn)
        finally:
            self.queued -= n

    async def _run(self) -> None:
        """The worker: take a job, gather what else is queued (waiting ``window_ms`` for more only
        while nothing else is), translate each group of equal searches, hand out the results. A
        failure fails the requests of its batch, not the worker."""
        while True:
            jobs = [await self._queue.get()]
            try:
                await self._gather(jobs)
                groups: dict[tuple, list[_Job]] = {}
                for job in jobs:
                    groups.setdefault(job.search, []).append(job)
                for search, group in groups.items():
                    texts = [t for job in group for t in job.texts]
                    try:
                        results = await self.call(self._translate, texts, dict(search))
                    except Exception as e:  # the model failed: every request of the batch hears why
                        _fail(group, e)
                        continue
                    start = 0
                    for job in group:
                        if not job.future.done():
                            job.future.set_result(results[start : start + len(job.texts)])
                        start += len(job.texts)
            except asyncio.CancelledError:
                _fail(jobs, HTTPError(503, "the server is shutting down"))
                raise
            except Exception as e:  # a bug here must not leave requests waiting forever
                log.exception("aiayn serve: the batch failed")
                _fail(jobs, e)

    async def _gather(self, jobs: list[_Job]) -> None:
        """Add to ``jobs`` what is queued, up to ``batch_tokens``; while the queue is empty, wait
        up to ``window_ms`` after the first job for more."""
        loop = asyncio.get_running_loop()
        tokens, deadline = jobs[0].tokens, loop.time() + self.options.window_ms / 1000
        while tokens < self.options.batch_tokens:
            try:
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:  # not TimeoutError: Python 3.10's differs
                    return
            jobs.append(job)
            tokens += job.tokens

    def _translate(self, texts: list[str], search: dict[str, Any]) -> list[str]:
        return self.translator.translate(texts, max_tokens=self.options.max_tokens, **search)


def _fail(jobs: list[_Job], error: Exception) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)


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


async def _json_body(request: Any, max_body: int) -> dict[str, Any]:
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise HTTPError(413, f"the body has {length} bytes, at most {max_body}")
    body = bytearray()
    try:
        async for chunk in request.stream():  # read at most max_body bytes, whatever the headers say
            body += chunk
            if len(body) > max_body:
                raise HTTPError(413, f"the body has more than {max_body} bytes")
    except ClientDisconnect:  # gone before the whole body came: no one to answer
        raise HTTPError(400, "the client went away before the whole body came") from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HTTPError(400, f"the body is not JSON: {type(e).__name__}: {e}") from None
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
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HTTPError(422, f"{name}[{i}] is not valid Unicode text: {e.reason}") from None
    return value


def _search(
    data: dict[str, Any], options: ServeOptions, body: str, fields: tuple[str, ...] = tuple(SEARCH_FIELDS)
) -> dict:
    """The search options of a request body whose text field is ``body`` (the ``fields`` of
    ``SEARCH_FIELDS``), checked; defaults: ``aiayn translate``'s."""
    search = {}
    for name, value in data.items():
        if name == body:
            continue
        if name not in fields:
            raise HTTPError(422, f"unknown field {name!r}; known fields: {', '.join([body, *fields])}")
        kind, low, high = SEARCH_FIELDS[name]
        high = options.max_beam if name == "beam" else high
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = number and (isinstance(value, int) or math.isfinite(value))
        if kind is int:
            ok = ok and (isinstance(value, int) or value.is_integer())
        what = "an integer" if kind is int else "a number"
        if not ok:
            raise HTTPError(422, f"{name} must be {what}, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise HTTPError(422, f"{name} must be {what} {bounds}, got {value!r}")
        search[name] = kind(value)
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
            except Exception as e:  # a bug, or the model failing: still a JSON answer, logged
                log.exception("aiayn serve: %s failed", request.url.path)
                return _error(500, f"internal error: {type(e).__name__}: {e}")

        return wrapped

    @handles_errors
    async def translate(request: Any) -> Any:
        data = await _json_body(request, options.max_body)
        if "texts" not in data:
            raise HTTPError(422, "the body needs texts: a list of strings")
        texts = _texts(data["texts"], options)
        return JSONResponse({"translations": await batcher.translate(texts, _search(data, options, "texts"))})

    @handles_errors
    async def attention(request: Any) -> Any:
        data = await _json_body(request, options.max_body)
        if not isinstance(data.get("text"), str):
            raise HTTPError(422, "the body needs text: a string")
        (text,) = _texts([data["text"]], options, "text")
        if not text.strip():
            raise HTTPError(422, "text is empty")
        search = _search(data, options, "text", ("beam", "alpha"))

        def weights() -> dict[str, Any]:
            return attention_json(translation_attention(model, translator.tokenizer, text, **search))

        return JSONResponse(await batcher.exclusive(weights))

    async def health(request: Any) -> Any:
        alive = batcher.alive
        return JSONResponse({"status": "ok" if alive else "error", "queued": batcher.queued}, 200 if alive else 500)

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
