"""A translation server and an attention explorer in the browser (not in the paper): ``aiayn serve``.

    aiayn serve --model runs/ding/model [--host 127.0.0.1] [--port 8000]

An ASGI app (Starlette, served by uvicorn: the ``serve`` extra) over one ``Translator`` (of a
run of ``train.members``, its ensemble, as ``aiayn translate``'s; ``load``):
- ``POST /translate`` ``{"texts": [...], "beam": 4, "alpha": 0.6, "max_len_a": 50,
  "no_repeat_ngram_size": 0}`` (all but ``texts`` optional) -> ``{"translations": [...]}``, what
  ``aiayn translate`` prints for the same texts and options;
- ``POST /attention`` ``{"text": "...", "beam": 1, "alpha": 0.6}`` -> the sentence's translation
  and every attention weight the model used for it (``aiayn.viz.translation_attention``, what
  ``aiayn attention`` draws);
- ``GET /health`` -> ``{"status": "ok", "queued": texts waiting or decoding}`` (500 once the worker has
  stopped);
- ``GET /`` -> the explorer (``explorer.html``: plain HTML and JavaScript, no build step).

Concurrent requests are batched continuously (``Batcher``): one model thread runs a search
(``aiayn.decode.translate_continuous``) that the texts of new requests join as others end, each
at its own position 0, and a request is answered as soon as its last text has ended. Texts that
ask for the same search options decode together, up to ``batch_tokens`` source positions
(sentences times the longest source times the beam); requests asking for other options wait until the texts
before them have ended (first come, first served). Waiting texts join once they are at least
half as many as those decoding (``JOIN_FRACTION``): a join encodes them and copies each layer's
cache. Each text's translation is what it gets translated alone (aiayn's searches
guarantee it for float weights), so batching changes speed, not output. At most ``max_queue``
texts wait or decode; more are refused with 503. The event loop keeps answering (``/health``,
refusals) while the model works; ``/attention`` runs on the model thread between two steps.

Bad input gets a 4xx and a JSON ``{"error": ...}``: a body that is not JSON (400), a field of the
wrong type or value, an unknown field, an empty list or invalid Unicode (422), a body, text count
or text over its limit (413); a failure inside is a JSON 500, and the worker goes on. A client
that disconnects before its answer does not disturb the others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .data.tokenizer import load_tokenizer
from .decode import translate_continuous
from .engine import EngineOptions
from .model import Transformer
from .translator import Translator, ensemble_members, load_datastores

__all__ = ["ServeOptions", "Batcher", "create_app", "load", "model_thread", "serve", "serving"]

log = logging.getLogger("aiayn.serve")

# name: (type, least, most), the bounds None where the command sets none (beam: ServeOptions.max_beam)
SEARCH_FIELDS = {
    "beam": (int, 1, None), "alpha": (float, None, None), "max_len_a": (int, 0, 1024),
    "no_repeat_ngram_size": (int, 0, 1024),
}  # fmt: skip
# what a request leaves out: Translator.translate's defaults, as `aiayn translate`'s
SEARCH_DEFAULTS = {
    name: p.default for name, p in inspect.signature(Translator.translate).parameters.items() if name in SEARCH_FIELDS
}


@dataclass(frozen=True)
class ServeOptions:
    """The server's limits and batching."""

    max_texts: int = 64  # texts per request (413 beyond)
    max_chars: int = 2000  # characters per text (413 beyond); the model truncates at its max_len tokens
    max_queue: int = 1024  # texts waiting for the model or decoding (503 beyond)
    batch_tokens: int = 16384  # source positions decoding together: sentences x the longest source x the beam
    max_beam: int = 16

    def __post_init__(self) -> None:
        if self.max_queue < self.max_texts:
            raise ValueError(f"max_queue ({self.max_queue}) must be at least max_texts ({self.max_texts})")

    @property
    def max_body(self) -> int:
        """Bytes a request body may have: the texts at their largest (4 UTF-8 bytes a character, 6
        escaped) and room for the JSON around them."""
        return self.max_texts * (6 * self.max_chars + 8) + 4096


# Texts waiting join the sentences decoding once they are at least 1 / JOIN_FRACTION as many (or
# nothing decodes): each join encodes the newcomers and copies every layer's cache. 32 clients
# over the Ding test split (Xeon, beam 4): 1 / 2 gave 140-154 sentences/s, 1 / 4 132-141, 1 / 8
# 132-134, 1 / 1 141, joining whenever any text waits 122-132 (docs/benchmarks.md).
JOIN_FRACTION = 2


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _StoppingError(Exception):
    """The server is shutting down (``Batcher.stop``)."""


_STOP = object()  # the inbox's last item


@dataclass
class _Job:
    """One request's texts on their way through the model thread."""

    texts: list[str]
    search: tuple[tuple[str, Any], ...]  # sorted (name, value): texts of equal searches decode together
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)
    results: list[str | None] = field(default_factory=list)
    sources: list[list[int]] | None = None  # token ids, once the model thread has encoded them
    next: int = 0  # the next text to join the search
    left: int = 0  # texts not yet translated

    def __post_init__(self) -> None:
        self.results, self.left = [None] * len(self.texts), len(self.texts)

    def settle(self, error: BaseException | None = None) -> None:
        """Hand the results (or ``error``) to the request, from any thread; once."""
        self.left = -1
        self.loop.call_soon_threadsafe(_settle, self.future, self.results, error)


@dataclass
class _Call:
    """A function for the model thread (``Batcher.call``), its result for ``future``."""

    fn: Any
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)


class Batcher:
    """Continuous batching of concurrent requests for one ``Translator`` (module docstring): the
    model thread runs one search (``aiayn.decode.translate_continuous``) that texts join as others
    end, and answers each request as soon as its last text has ended."""

    def __init__(
        self, translator: Translator, options: ServeOptions, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.translator, self.options = translator, options
        self.queued = 0  # texts waiting or being translated
        self.executor = executor or model_thread()
        self.joins = 0  # times texts joined a search (or started one)
        self.most_decoding = 0  # the most sentences decoded together
        self._inbox: queue.SimpleQueue | None = None
        self._worker: asyncio.Future | None = None
        self._stopping = False

    async def start(self) -> None:
        self._inbox, self._stopping = queue.SimpleQueue(), False
        self._worker = asyncio.wrap_future(self.executor.submit(self._serve))
        self._worker.add_done_callback(functools.partial(self._answer_after_death, self._inbox))

    @staticmethod
    def _answer_after_death(inbox: queue.SimpleQueue, worker: asyncio.Future) -> None:
        """When the model thread's loop has died, answer with 500 what its inbox still holds (it
        answered what it had taken). On the event loop, once ``alive`` is false: ``admit`` refuses
        from then on, so nothing comes after."""
        if worker.cancelled() or worker.exception() is None:
            return  # stopped: ``stop`` answers what came after with 503
        log.critical("aiayn serve: the model worker has stopped", exc_info=worker.exception())
        _refuse_inbox(inbox, _worker_stopped())

    async def stop(self) -> None:
        """Stop the model thread's loop: what waits, or comes meanwhile, gets a 503."""
        self._stopping = True  # admit and call refuse from now on
        if self._worker is not None:
            self.close()
            with contextlib.suppress(Exception):
                await self._worker
        self._worker = None  # the model's thread stays: the app may start again
        if self._inbox is not None:
            _refuse_inbox(self._inbox)  # what came after the stop

    def close(self) -> None:
        """Tell the model thread's loop to end, from any thread, without waiting (``serve`` does
        when uvicorn exits without the app's shutdown: the thread would keep the process alive)."""
        if self._inbox is not None:
            self._inbox.put(_STOP)

    @property
    def alive(self) -> bool:
        """Whether the model thread's loop runs (``/health`` says so)."""
        return self._worker is not None and not self._worker.done()

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the model's thread, between two decoding steps (on the engine;
        otherwise once the batch decoding has ended)."""
        return await asyncio.shield(self._submit(functools.partial(fn, *args)))

    def _submit(self, fn: Any, texts: int = 0) -> asyncio.Future:
        """Put ``fn()`` in the model thread's inbox; its future counts as ``texts`` queued texts
        until it is settled (``_count_until_done``)."""
        if self._stopping or not self.alive:
            raise HTTPError(503, "the server is shutting down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._count_until_done(future, texts)
        self._inbox.put(_Call(fn, future, loop))
        return future

    def _count_until_done(self, future: asyncio.Future, texts: int) -> None:
        """``texts`` admitted texts stop counting once ``future`` is settled, when the model thread
        has ended their work: not when their request ends. A client that goes away leaves its texts
        decoding (``asyncio.shield``), and they fill the queue (``max_queue``) until then."""

        def release(_: asyncio.Future) -> None:
            self.queued -= texts

        if texts:
            future.add_done_callback(release)

    def admit(self, n: int) -> None:
        """Count ``n`` more texts waiting for the model; 503 when the queue is full."""
        if self.queued + n > self.options.max_queue:
            raise HTTPError(
                503, f"the server is busy: {self.queued} texts are waiting (at most {self.options.max_queue})"
            )
        if self._stopping:
            raise HTTPError(503, "the server is shutting down")
        if not self.alive:
            raise _worker_stopped()
        self.queued += n

    async def translate(self, texts: list[str], search: dict[str, Any]) -> list[str]:
        """The translations of ``texts``, batched with other requests'; 503 when the queue is full."""
        loop = asyncio.get_running_loop()
        search = tuple(sorted({**SEARCH_DEFAULTS, **search}.items()))  # {} and the defaults decode together
        job = _Job(list(texts), search, loop.create_future(), loop)
        self.admit(len(texts))  # nothing that can raise between counting the texts and queueing them
        self._count_until_done(job.future, len(texts))  # before shield's own callback: released first
        self._inbox.put(job)
        return await asyncio.shield(job.future)  # a cancelled request leaves the search alone

    async def exclusive(self, fn: Any, n: int = 1) -> Any:
        """``fn()`` on the model's thread, counted as ``n`` queued texts (``/attention``)."""
        self.admit(n)  # checked what _submit checks, with no await since: it cannot refuse now
        return await asyncio.shield(self._submit(fn, n))

    # On the model thread ------------------------------------------------------------------------

    def _serve(self) -> None:
        """The model thread's loop: wait for a job, then decode the searches of the jobs waiting,
        oldest first, until stopped. A failure fails the requests it touched, not the loop."""
        waiting: collections.deque[_Job] = collections.deque()  # in arrival order
        try:
            while True:
                if not waiting:
                    self._take(waiting, block=True)
                self._decode(waiting, waiting[0].search)
        except _StoppingError:
            for job in waiting:
                _refuse(job)
        except BaseException:  # the loop dies: its requests get an answer, and stop counting
            for job in waiting:
                _refuse(job, _worker_stopped())
            raise

    def _take(self, waiting: collections.deque[_Job], block: bool) -> None:
        """Move what the inbox holds into ``waiting``, running calls at once; with ``block``, wait
        until there is a job."""
        while True:
            try:
                item = self._inbox.get(block=block and not waiting)
            except queue.Empty:
                return
            if item is _STOP:
                raise _StoppingError
            try:
                if isinstance(item, _Call):
                    try:
                        result, error = item.fn(), None
                    except Exception as e:
                        result, error = None, e
                    item.loop.call_soon_threadsafe(_settle, item.future, result, error)
                elif not any(text.strip() for text in item.texts):  # nothing to translate: no need to wait
                    item.results = [""] * len(item.texts)
                    item.settle()
                else:
                    waiting.append(item)
            except BaseException:  # what ends the loop: the item in hand gets an answer too
                _refuse(item, _worker_stopped())
                raise

    def _decode(self, waiting: collections.deque[_Job], search: tuple) -> None:
        """One continuous search for the texts of ``search``: those at the head of ``waiting`` join
        it as they come (``feed``), until the head asks for another search and the sentences
        decoding have ended."""
        decoding: dict[int, tuple[_Job, int, int]] = {}  # key -> (job, text index, source positions)
        keys, beam = itertools.count(), dict(search)["beam"]

        def feed(live: int) -> tuple[list[int], list[list[int]]] | None:
            self._take(waiting, block=False)
            ready = sum(len(j.texts) - j.next for j in itertools.takewhile(lambda j: j.search == search, waiting))
            if not ready or (live and ready * JOIN_FRACTION < live):
                return None
            taken: tuple[list[int], list[list[int]]] = ([], [])
            width = max((n for _, _, n in decoding.values()), default=0)
            while waiting and waiting[0].search == search:
                job = waiting[0]
                if job.sources is None and not self._encode(job):
                    waiting.popleft()
                    continue
                while job.next < len(job.texts):
                    ids, i = job.sources[job.next], job.next
                    if not job.texts[i].strip():  # nothing to translate: "" at once, as Translator gives
                        job.results[i], job.left, job.next = "", job.left - 1, i + 1
                        continue
                    n, width = len(decoding) + 1, max(width, len(ids) + 1)
                    if (live or taken[0]) and n * width * beam > self.options.batch_tokens:
                        return self._joined(taken, live)
                    key = next(keys)
                    decoding[key] = (job, i, len(ids) + 1)
                    taken[0].append(key)
                    taken[1].append(ids)
                    job.next = i + 1
                if job.left == 0:
                    job.settle()
                waiting.popleft()
            return self._joined(taken, live)

        tokenizer = self.translator.tokenizer
        try:
            for key, tokens in translate_continuous(self.translator.model, feed, **dict(search)):
                job, i, _ = decoding[key]
                job.results[i] = tokenizer.decode(tokens)
                del decoding[key]  # after decoding the text: a failure there fails its request too
                job.left -= 1
                if job.left == 0:
                    job.settle()
        except _StoppingError:
            self._fail(decoding, waiting, search, HTTPError(503, "the server is shutting down"))
            raise
        except Exception as e:  # the model failed: every request decoding hears why
            log.exception("aiayn serve: the search failed")
            self._fail(decoding, waiting, search, e)
        except BaseException:  # the loop dies (_serve answers what waits): the texts decoding hear it too
            self._fail(decoding, waiting, search, _worker_stopped())
            raise

    def _joined(self, taken: tuple[list[int], list[list[int]]], live: int) -> tuple | None:
        if not taken[0]:
            return None
        self.joins += 1
        self.most_decoding = max(self.most_decoding, live + len(taken[0]))
        return taken

    def _encode(self, job: _Job) -> bool:
        """The job's token ids (truncated to the model's length, with a warning); a failure
        fails the job alone."""
        try:
            job.sources = self.translator.encode(job.texts)
        except Exception as e:
            log.exception("aiayn serve: encoding failed")
            job.settle(e)
            return False
        return True

    @staticmethod
    def _fail(decoding: dict, waiting: collections.deque[_Job], search: tuple, error: Exception) -> None:
        """Fail the jobs with texts decoding (and drop them from ``waiting``, where partly joined);
        with none, the first job of the search (the failure came before any text joined: left
        there, it would fail again, forever)."""
        jobs = {id(job): job for job, _, _ in decoding.values()}
        if not jobs and waiting and waiting[0].search == search:
            jobs[id(waiting[0])] = waiting[0]
        for job in jobs.values():
            if job.left >= 0:
                job.settle(error)
        while waiting and id(waiting[0]) in jobs:
            waiting.popleft()
        decoding.clear()


def _refuse(item: _Job | _Call, error: HTTPError | None = None) -> None:
    """Answer a job or call the model thread will not run: 503, or ``error``."""
    error = error or HTTPError(503, "the server is shutting down")
    if isinstance(item, _Call):
        item.loop.call_soon_threadsafe(_settle, item.future, None, error)
    else:
        item.settle(error)


def _refuse_inbox(inbox: queue.SimpleQueue, error: HTTPError | None = None) -> None:
    """Answer everything left in an inbox the model thread will not read again (``_refuse``)."""
    while not inbox.empty():
        item = inbox.get()
        if item is not _STOP:
            _refuse(item, error)


def _worker_stopped() -> HTTPError:
    return HTTPError(500, "the server's model worker has stopped; restart the server")


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Set a future of the event loop's (on the loop: ``call_soon_threadsafe``), unless it is done."""
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def load(
    directory: str | Path,
    device: str = "cpu",
    quantize: str | None = None,
    options: EngineOptions | None = None,
    alone: bool = False,
    knn: bool = True,
    retrieval: dict[str, Any] | None = None,
) -> tuple[Translator, Transformer]:
    """(the translator ``/translate`` decodes with, the model ``/attention`` shows) for the model
    ``directory``: the directory's ensemble, as ``aiayn translate`` decodes it (a run of
    ``train.members``: ``ensemble.json``; ``alone``: the directory's model only; with each
    model's kNN-MT datastore unless ``knn`` is False, ``retrieval`` overriding its config), and
    the directory's own model, whose attention the explorer draws."""
    model = Transformer.from_pretrained(directory, device=device).eval()
    if alone or len(ensemble_members(directory)) == 1:
        tokenizer = load_tokenizer(directory, model.config.vocab_size, model.config.tgt_vocab_size)
        stores = load_datastores([Path(directory)], knn, retrieval)
        return Translator(model, tokenizer, quantize, options, stores), model
    return Translator.from_pretrained(directory, device, quantize, options, knn=knn, retrieval=retrieval), model


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

    app = create_app(translator, model, options, executor)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:  # a forced exit skips the app's shutdown: end the model thread's loop, or it keeps the process
        app.state.batcher.close()


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
