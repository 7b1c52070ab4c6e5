"""aiayn serve: /translate gives what `aiayn translate` gives, concurrent requests are batched
together, bad input gets a 4xx JSON error and the server keeps serving, a full queue answers
503, a client that goes away mid-request harms nobody; /attention is translation_attention."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from aiayn.cli import _one_line, main  # noqa: E402
from aiayn.data.tokenizer import load_tokenizer  # noqa: E402
from aiayn.decode import translate_ids  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.serve import Batcher, HTTPError, ServeOptions, create_app, serving  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from aiayn.viz import translation_attention  # noqa: E402
from serve_helpers import SENTENCES, make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


def hold_steps(monkeypatch, held, before=lambda: None) -> None:
    """Each decoding step of the engine runs ``before()``, then waits while ``held()`` (at most
    10 s), so that a test orders a search's steps against its HTTP requests instead of racing them."""
    from aiayn.engine.step import Decoding

    step = Decoding.__call__

    def waiting(self, tokens):
        before()
        deadline = time.monotonic() + 10
        while held() and time.monotonic() < deadline:
            time.sleep(0.001)
        return step(self, tokens)

    monkeypatch.setattr(Decoding, "__call__", waiting)


def app_for(model_dir, **options):
    model = Transformer.from_pretrained(model_dir).eval()
    translator = Translator(model, load_tokenizer(model_dir, model.config.vocab_size))
    return create_app(translator, model, ServeOptions(**options))


@pytest.fixture(scope="module")
def client(model_dir):
    with TestClient(app_for(model_dir)) as client:
        yield client


def cli_translate(model_dir, capsys, texts, *options) -> list[str]:
    """What `aiayn translate` prints for ``texts``: a line each (``_one_line``)."""
    capsys.readouterr()
    assert main(["translate", "--model", str(model_dir), *options, *texts]) == 0
    return capsys.readouterr().out.split("\n")[:-1]


@pytest.mark.parametrize("options", [{}, {"beam": 1}, {"beam": 3, "alpha": 1.0, "max_len_a": 5}])
def test_translate_equals_the_translate_command(client, model_dir, capsys, options):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    expected = cli_translate(model_dir, capsys, SENTENCES, *flags)
    response = client.post("/translate", json={"texts": SENTENCES, **options})
    assert response.status_code == 200
    translations = response.json()["translations"]
    assert [_one_line(t) for t in translations] == expected  # the command prints each as one line
    translator = Translator.from_pretrained(model_dir)
    search = {"beam": 4, "alpha": 0.6, **options}
    assert translations == translator.translate(SENTENCES, **search)  # the text itself, control characters too
    assert len({len(t) for t in expected}) > 2  # outputs of different lengths: a mix-up would show


def test_health(client):
    assert client.get("/health").json() == {"status": "ok", "queued": 0}


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"max_queue \(8\) must be at least max_texts \(64\)"):
        ServeOptions(max_queue=8)


def test_a_failing_search_fails_its_requests_not_the_worker(model_dir, monkeypatch):
    """Encoding failing, or the model failing mid-search: the requests it touched get a 500 JSON
    error; the model thread goes on and later requests are answered."""
    import aiayn.serve

    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    encode, search = batcher.translator.encode, aiayn.serve.translate_continuous
    failures = {"encode": [RuntimeError("encoding broke")], "search": []}

    def flaky_encode(texts):
        if failures["encode"]:
            raise failures["encode"].pop()
        return encode(texts)

    def flaky_search(model, feed, **options):
        steps = search(model, feed, **options)
        if failures["search"]:
            next(steps, None)  # some sentences may have ended: the failure comes mid-search
            raise failures["search"].pop()
        return steps

    monkeypatch.setattr(batcher.translator, "encode", flaky_encode)
    monkeypatch.setattr(aiayn.serve, "translate_continuous", flaky_search)
    with TestClient(app) as client:
        first = client.post("/translate", json={"texts": SENTENCES[:2]})
        assert first.status_code == 500 and "encoding broke" in first.json()["error"]
        failures["search"].append(RuntimeError("the model broke"))
        second = client.post("/translate", json={"texts": SENTENCES[:3]})
        assert second.status_code == 500 and "the model broke" in second.json()["error"]
        assert client.post("/translate", json={"texts": SENTENCES[:2]}).status_code == 200
        assert client.get("/health").json() == {"status": "ok", "queued": 0}
    with TestClient(app) as client:  # the app starts again (its model thread stays)
        assert client.post("/translate", json={"texts": SENTENCES[:1]}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "the body is not JSON"),
        (b'["a list"]', 422, "must be a JSON object"),
        (b"{}", 422, "the body needs texts"),
        (json.dumps({"texts": "one string"}).encode(), 422, "texts must be a list of strings"),
        (json.dumps({"texts": ["ok", 3]}).encode(), 422, "texts must be a list of strings"),
        (json.dumps({"texts": []}).encode(), 422, "texts is empty"),
        (json.dumps({"texts": ["a"], "beam": 0}).encode(), 422, "beam must be an integer from 1 to 16, got 0"),
        (json.dumps({"texts": ["a"], "beam": 2.5}).encode(), 422, "beam must be an integer, got 2.5"),
        (json.dumps({"texts": ["a"], "beam": True}).encode(), 422, "beam must be an integer, got True"),
        (json.dumps({"texts": ["a"], "alpha": "high"}).encode(), 422, "alpha must be a number, got 'high'"),
        (json.dumps({"texts": ["a"], "beam": 99}).encode(), 422, "beam must be an integer from 1 to 16"),
        (json.dumps({"texts": ["a"], "beam": 10**400}).encode(), 422, "beam must be an integer from 1 to 16"),
        (json.dumps({"texts": ["a"], "max_len_a": 5000}).encode(), 422, "max_len_a must be an integer from 0 to 1024"),
        (b'{"texts": ["a"], "alpha": NaN}', 422, "alpha must be a number, got nan"),
        (b'{"texts": ["\\ud800"]}', 422, "texts[0] is not valid Unicode text"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "the body is not JSON"),
        (b'{"texts": ["a"], "pad": "' + b"x" * 1_000_000 + b'"}', 413, "bytes, at most"),
        (json.dumps({"texts": ["a"], "bean": 4}).encode(), 422, "unknown field 'bean'"),
        (json.dumps({"texts": ["a"] * 65}).encode(), 413, "65 texts, at most 64 per request"),
        (json.dumps({"texts": ["ok", "x" * 2001]}).encode(), 413, "texts[1]: 2001 characters, at most 2000"),
    ],
)
def test_bad_input_is_a_4xx_json_error_and_the_server_goes_on(client, body, status, message):
    response = client.post("/translate", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert message in response.json()["error"]
    assert client.post("/translate", json={"texts": ["Das Haus ist groß."]}).status_code == 200


def test_concurrent_requests_are_batched_together(model_dir, capsys):
    """32 clients at once: their texts decode together (fewer joins than requests, many
    sentences in one search), each answer its own text's translation."""
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    texts = [SENTENCES[i % len(SENTENCES)] + " " * (i // len(SENTENCES)) for i in range(32)]
    expected = dict(zip(SENTENCES, cli_translate(model_dir, capsys, SENTENCES, "--beam", "1"), strict=True))
    release = threading.Event()

    async def clients(url):
        blocker = asyncio.ensure_future(batcher.call(release.wait))  # all 32 arrive while the model is busy
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            requests = [asyncio.ensure_future(http.post("/translate", json={"texts": [t], "beam": 1})) for t in texts]
            while batcher.queued < 32:
                await asyncio.sleep(0.01)
            release.set()
            await blocker
            responses = await asyncio.gather(*requests)
        return [r.json()["translations"][0] for r in responses]

    with serving(app) as url:
        answers = asyncio.run(clients(url))
    assert answers == [expected[t.strip()] for t in texts]
    assert batcher.joins < 8 and batcher.most_decoding >= 16, (batcher.joins, batcher.most_decoding)


def test_a_short_text_is_answered_before_a_long_one_ends(model_dir, monkeypatch):
    """Continuous batching: a request whose sentence ends early is answered then, not when the
    longest sentence decoding with it ends; one that comes later joins the running search."""
    order = []
    # 5 ms a step; once the first short text is answered (one text left decoding), each step waits
    # until the second is queued, whatever the round trip
    hold_steps(monkeypatch, lambda: batcher.queued == 1 and "short again" not in order, lambda: time.sleep(0.005))
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    translator = batcher.translator
    outputs = translate_ids(translator.model, translator.encode(SENTENCES), beam=1)
    lengths = {text: len(tokens) for text, tokens in zip(SENTENCES, outputs, strict=True)}  # decoding steps - 1
    short, long = min(lengths, key=lengths.get), max(lengths, key=lengths.get)
    assert lengths[long] > 2 * lengths[short] + 10, lengths  # the long one decodes many more steps
    release = threading.Event()

    async def scenario(url):
        blocker = asyncio.ensure_future(batcher.call(release.wait))
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def ask(text, name):
                response = await http.post("/translate", json={"texts": [text], "beam": 1})
                order.append(name)
                return response.json()["translations"][0]

            async def short_twice():  # the second comes while the long one decodes, and joins it
                return [await ask(short, "short"), await ask(short, "short again")]

            first = [asyncio.ensure_future(ask(long, "long")), asyncio.ensure_future(short_twice())]
            while batcher.queued < 2:
                await asyncio.sleep(0.01)
            release.set()
            await blocker
            return await asyncio.gather(*first)

    with serving(app) as url:
        (long_answer, short_answers) = asyncio.run(scenario(url))
    assert order == ["short", "short again", "long"]
    assert [long_answer, *short_answers] == translator.translate([long, short, short], beam=1)
    assert batcher.joins == 2


def test_requests_with_other_search_options_get_their_own_searches(model_dir, capsys):
    """Requests of three option sets at once: each answer is `aiayn translate`'s with its options."""
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    flags = {1: ["--beam", "1"], 3: ["--beam", "3", "--alpha", "1.0"], 4: []}
    expected = {b: cli_translate(model_dir, capsys, SENTENCES, *f) for b, f in flags.items()}
    bodies = {1: {"beam": 1}, 3: {"beam": 3, "alpha": 1.0}, 4: {}}
    order = [(b, i) for i in range(len(SENTENCES)) for b in (1, 3, 4)]
    release = threading.Event()

    async def clients(url):
        blocker = asyncio.ensure_future(batcher.call(release.wait))
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            requests = [
                asyncio.ensure_future(http.post("/translate", json={"texts": [SENTENCES[i]], **bodies[b]}))
                for b, i in order
            ]
            while batcher.queued < len(order):
                await asyncio.sleep(0.01)
            release.set()
            await blocker
            return [r.json()["translations"][0] for r in await asyncio.gather(*requests)]

    with serving(app) as url:
        answers = asyncio.run(clients(url))
    assert [_one_line(a) for a in answers] == [expected[b][i] for b, i in order]
    assert expected[1] != expected[3]  # the options change outputs: a mix-up would show


def test_stopping_answers_what_waits_with_503(model_dir):
    """The app shutting down: texts still waiting get a 503 JSON answer, not silence."""

    async def scenario():
        app = app_for(model_dir)
        batcher: Batcher = app.state.batcher
        release = threading.Event()
        await batcher.start()
        blocker = asyncio.ensure_future(batcher.call(release.wait))
        waiting = asyncio.ensure_future(batcher.translate(SENTENCES[:2], {}))
        while batcher.queued < 2:
            await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        await stopping
        with pytest.raises(Exception) as error:
            await waiting
        return error.value, batcher.alive

    error, alive = asyncio.run(scenario())
    assert getattr(error, "status", None) == 503 and "shutting down" in str(error)
    assert not alive


def test_a_full_queue_answers_503_and_frees_up(model_dir):
    app = app_for(model_dir, max_queue=4, max_texts=4)
    batcher: Batcher = app.state.batcher
    release = threading.Event()
    with serving(app) as url:

        async def scenario():
            blocker = asyncio.ensure_future(batcher.call(release.wait))  # the model's thread is busy
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                waiting = asyncio.ensure_future(http.post("/translate", json={"texts": SENTENCES[:4]}))
                while batcher.queued < 4:
                    await asyncio.sleep(0.01)
                refused = await http.post("/translate", json={"texts": ["Die Katze schläft."]})
                health = await http.get("/health")
                release.set()
                await blocker
                return refused, health, await waiting

        refused, health, waited = asyncio.run(scenario())
        assert refused.status_code == 503 and "busy" in refused.json()["error"]
        assert health.json() == {"status": "ok", "queued": 4}  # the event loop answers while the model works
        assert waited.status_code == 200 and len(waited.json()["translations"]) == 4
        assert httpx.get(f"{url}/health").json()["queued"] == 0


def test_texts_of_a_request_gone_away_count_until_they_have_decoded(model_dir):
    """max_queue caps the texts the model thread holds: a request cancelled while its texts wait
    (its client gone) leaves them to decode, and they keep their places in the queue until then."""

    async def scenario():
        app = app_for(model_dir, max_queue=4, max_texts=4)
        batcher: Batcher = app.state.batcher
        release = threading.Event()
        await batcher.start()
        try:
            blocker = asyncio.ensure_future(batcher.call(release.wait))  # the model's thread is busy
            gone = asyncio.ensure_future(batcher.translate(SENTENCES[:4], {}))
            deadline = time.monotonic() + 10
            while batcher.queued < 4 and not gone.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            gone.cancel()
            await asyncio.sleep(0.05)
            with pytest.raises(HTTPError) as refused:  # admitted instead, it would wait for the blocker
                await asyncio.wait_for(batcher.translate(["Die Katze schläft."], {}), timeout=5)
            while_waiting, joins = batcher.queued, batcher.joins
            release.set()
            await blocker
            deadline = time.monotonic() + 30
            while batcher.queued and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            after, decoded = batcher.queued, batcher.joins > joins  # the 4 texts decoded, then left
            answer = await batcher.translate(["Die Katze schläft."], {})
        finally:
            release.set()  # a failure above must not leave the model's thread blocked
            await batcher.stop()
        return refused.value, while_waiting, after, decoded, answer, gone.cancelled()

    refused, while_waiting, after, decoded, answer, cancelled = asyncio.run(scenario())
    assert cancelled
    assert refused.status == 503 and "busy" in str(refused)
    assert (while_waiting, after, decoded) == (4, 0, True)
    assert len(answer) == 1 and answer[0]


def test_a_worker_that_dies_answers_what_it_held_with_500_and_frees_the_queue():
    """Something that ends the model thread's loop (not an Exception: those fail one request)
    still answers the call in hand, and its texts stop counting."""

    class Fatal(BaseException):
        pass

    def fatal():
        raise Fatal

    async def scenario():
        batcher = Batcher(None, ServeOptions())  # no translator: only calls run
        await batcher.start()
        try:
            with pytest.raises(HTTPError) as error:
                await asyncio.wait_for(batcher.exclusive(fatal, 2), timeout=10)
            deadline = time.monotonic() + 10
            while batcher.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return error.value, batcher.queued, batcher.alive
        finally:
            with contextlib.suppress(Fatal):
                await batcher.stop()

    error, queued, alive = asyncio.run(scenario())
    assert error.status == 500 and "worker has stopped" in str(error)
    assert (queued, alive) == (0, False)


def test_a_worker_that_dies_mid_search_answers_every_request_it_held_with_500(model_dir, monkeypatch):
    """The model thread's loop ending mid-search (not an Exception) answers, with 500, the request
    whose texts were decoding, the request waiting for another search and the request still in the
    inbox; their texts stop counting."""
    import aiayn.serve

    class Fatal(BaseException):
        pass

    joined, die = threading.Event(), threading.Event()

    def dying_search(model, feed, **options):
        assert feed(0) is not None  # the first request's texts join the search ...
        joined.set()
        die.wait(10)
        raise Fatal  # ... and the loop dies while they decode
        yield

    monkeypatch.setattr(aiayn.serve, "translate_continuous", dying_search)

    async def until(condition):
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def scenario():
        batcher: Batcher = app_for(model_dir).state.batcher
        release = threading.Event()
        await batcher.start()
        try:
            blocker = asyncio.ensure_future(batcher.call(release.wait))  # both requests queue up behind it
            decoding = asyncio.ensure_future(batcher.translate(SENTENCES[:2], {}))
            waiting = asyncio.ensure_future(batcher.translate(SENTENCES[2:3], {"beam": 1}))  # another search
            await until(lambda: batcher.queued == 3)
            release.set()
            await blocker
            await until(joined.is_set)
            inbox = asyncio.ensure_future(batcher.translate(SENTENCES[3:4], {}))  # the search takes no more
            await until(lambda: batcher.queued == 4)
            die.set()
            done, _ = await asyncio.wait({decoding, waiting, inbox}, timeout=10)
            await until(lambda: not batcher.alive)
            return [task.exception() for task in (decoding, waiting, inbox) if task in done], batcher.queued
        finally:
            release.set()
            die.set()
            with contextlib.suppress(Fatal):
                await batcher.stop()

    errors, queued = asyncio.run(scenario())
    assert len(errors) == 3, "a request was never answered"
    for error in errors:
        assert isinstance(error, HTTPError) and error.status == 500 and "worker has stopped" in str(error)
    assert queued == 0


def test_a_client_that_disconnects_mid_request_harms_nobody(model_dir):
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    release = threading.Event()
    with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")

        async def scenario():
            blocker = asyncio.ensure_future(batcher.call(release.wait))
            body = json.dumps({"texts": SENTENCES}).encode()
            head = (
                "POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            for partial in (False, True):  # gone while its texts wait; gone halfway through its body
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(head.encode() + (body[:10] if partial else body))
                    await asyncio.sleep(0.1)
            release.set()
            await blocker
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return await http.post("/translate", json={"texts": SENTENCES[:2]}), await http.get("/health")

        answer, _ = asyncio.run(scenario())
        assert answer.status_code == 200 and len(answer.json()["translations"]) == 2
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["queued"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "queued": 0}


@pytest.mark.parametrize("beam", [1, 3])
def test_attention_is_translation_attention(client, model_dir, beam):
    model = Transformer.from_pretrained(model_dir).eval()
    expected = translation_attention(model, load_tokenizer(model_dir), SENTENCES[0], beam=beam)
    answer = client.post("/attention", json={"text": SENTENCES[0], "beam": beam}).json()
    assert (
        answer["translation"]
        == client.post("/translate", json={"texts": SENTENCES[:1], "beam": beam}).json()["translations"][0]
    )  # the weights of the translation /translate gives
    assert (answer["translation"], answer["source"], answer["target"]) == (
        expected.translation, expected.source, expected.target,
    )  # fmt: skip
    for kind, ours in zip(("encoder", "decoder_self", "decoder_cross"), expected.attention, strict=True):
        assert len(answer[kind]) == len(ours)
        for layer, weights in zip(answer[kind], ours, strict=True):
            assert layer == weights.tolist()
    assert client.post("/attention", json={"text": ""}).status_code == 422
    assert client.post("/attention", json={"texts": ["a"]}).status_code == 422
    assert "unknown field 'max_len_a'" in client.post("/attention", json={"text": "a", "max_len_a": 3}).json()["error"]


def test_attention_of_a_long_text_is_truncated_as_translate_truncates(client, model_dir):
    """The model takes max_len - 1 source tokens; /attention truncates as /translate does."""
    text = " ".join(SENTENCES) * 3
    with pytest.warns(UserWarning, match="truncated to the model's 47"):
        answer = client.post("/attention", json={"text": text, "beam": 1}).json()
    assert len(answer["source"]) == Transformer.from_pretrained(model_dir).config.max_len  # 47 tokens and EOS
    with pytest.warns(UserWarning, match="longer than the model's 47 tokens were truncated"):
        translated = client.post("/translate", json={"texts": [text], "beam": 1}).json()["translations"][0]
    assert answer["translation"] == translated


def test_the_explorer_page_is_served(client):
    response = client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert 'id="show-attention"' in response.text and "/attention" in response.text


def test_the_serve_command(model_dir, capsys):
    """`aiayn serve` as a user starts it: a process answering on its port, the model loaded on its
    model thread, translations as `aiayn translate`'s; it stops on SIGTERM."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    expected = cli_translate(model_dir, capsys, SENTENCES[:3])
    command = [sys.executable, "-m", "aiayn", "serve", "--model", str(model_dir), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "aiayn serve did not start"
                time.sleep(0.1)
        answer = httpx.post(f"http://127.0.0.1:{port}/translate", json={"texts": SENTENCES[:3]}, timeout=60)
        assert [_one_line(t) for t in answer.json()["translations"]] == expected
    finally:
        server.terminate()  # uvicorn shuts down, then re-raises the signal: SIGTERM's exit
        assert server.wait(timeout=30) in (0, -15)
    assert "Traceback" not in server.stderr.read()


def test_a_failure_while_reading_out_a_result_answers_every_request_it_touched(model_dir, monkeypatch):
    """The tokenizer failing on the first text that ends, the only text of its request: that
    request and the others decoding get the error (none waits forever, nothing stays counted),
    and the server goes on."""
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    translator = batcher.translator
    lengths = [len(t) for t in translate_ids(translator.model, translator.encode(SENTENCES), beam=4)]
    first = SENTENCES[lengths.index(min(lengths))]  # its text ends first
    others = [t for t in SENTENCES if t != first]
    decode, broken = translator.tokenizer.decode, [True]

    def flaky_decode(ids):
        if broken and broken.pop():
            raise IndexError("the tokenizer broke")
        return decode(ids)

    monkeypatch.setattr(translator.tokenizer, "decode", flaky_decode)
    release = threading.Event()

    async def scenario(url):
        blocker = asyncio.ensure_future(batcher.call(release.wait))
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            asks = [http.post("/translate", json={"texts": texts}) for texts in ([first], others)]
            asks = [asyncio.ensure_future(a) for a in asks]
            while batcher.queued < len(SENTENCES):
                await asyncio.sleep(0.01)
            release.set()
            await blocker
            answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
            return answers, await http.post("/translate", json={"texts": SENTENCES[:2]}), await http.get("/health")

    with serving(app) as url:
        answers, later, health = asyncio.run(scenario(url))
    for answer in answers:
        assert answer.status_code == 500 and "the tokenizer broke" in answer.json()["error"]
    assert later.status_code == 200 and health.json() == {"status": "ok", "queued": 0}


def test_a_search_failing_before_any_text_joined_fails_its_request_not_the_loop(model_dir):
    """A search that fails at its start (here options the HTTP layer would refuse, given to the
    Batcher directly) fails the request that asked for it; the next request is answered."""

    async def scenario():
        batcher: Batcher = app_for(model_dir).state.batcher
        await batcher.start()
        try:
            with pytest.raises(ValueError, match="beam >= 1"):
                await asyncio.wait_for(batcher.translate(SENTENCES[:1], {"beam": 0}), 30)
            return await asyncio.wait_for(batcher.translate(SENTENCES[:1], {"beam": 1}), 30), batcher.queued
        finally:
            await asyncio.wait_for(batcher.stop(), 30)

    answer, queued = asyncio.run(scenario())
    assert len(answer) == 1 and queued == 0


def test_after_stop_requests_and_calls_get_503_and_close_ends_the_loop(model_dir):
    """Requests and calls made while the server stops, or after, are refused with 503, also those
    that reach the inbox behind the stop; ``close`` (what ``serve`` does when uvicorn exits
    without the app's shutdown) ends the model thread's loop."""

    async def scenario():
        batcher: Batcher = app_for(model_dir).state.batcher
        await batcher.start()
        stopping = asyncio.ensure_future(batcher.stop())
        late = [asyncio.ensure_future(batcher.translate(["x"], {})), asyncio.ensure_future(batcher.call(len, "ab"))]
        await asyncio.wait_for(stopping, 30)
        errors = [(await asyncio.wait_for(asyncio.gather(f, return_exceptions=True), 10))[0] for f in late]
        with pytest.raises(HTTPError, match="shutting down"):
            await batcher.translate(["x"], {})
        await batcher.start()  # the app may start again
        assert await batcher.call(len, "abc") == 3
        batcher.close()
        for _ in range(300):
            if not batcher.alive:
                break
            await asyncio.sleep(0.01)
        return errors, batcher.alive, batcher.queued

    errors, alive, queued = asyncio.run(scenario())
    assert [getattr(e, "status", None) for e in errors] == [503, 503]
    assert not alive and queued == 0


def test_empty_texts_need_not_wait_and_default_options_decode_with_explicit_ones(model_dir, monkeypatch):
    """A request of empty texts is answered at once, even while a long search runs; ``{}`` and
    the same options written out decode in one search."""
    searching, answered = threading.Event(), threading.Event()
    # each step of the search waits until the empty request is queued: it is then answered at the
    # next step's boundary, the search still running
    hold_steps(monkeypatch, lambda: not answered.is_set() and batcher.queued < len(SENTENCES) + 4, searching.set)
    app = app_for(model_dir)
    batcher: Batcher = app.state.batcher
    release, order = threading.Event(), []

    async def scenario(url):
        blocker = asyncio.ensure_future(batcher.call(release.wait))
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def ask(body, name):
                response = await http.post("/translate", json=body)
                order.append(name)
                return response.json()["translations"]

            asks = [
                asyncio.ensure_future(ask({"texts": SENTENCES}, "defaults")),
                asyncio.ensure_future(ask({"texts": SENTENCES[:2], "beam": 4, "alpha": 0.6}, "written out")),
            ]
            while batcher.queued < len(SENTENCES) + 2:
                await asyncio.sleep(0.01)
            release.set()
            await blocker
            while not searching.is_set():  # the search has begun
                await asyncio.sleep(0.01)
            empty = await ask({"texts": ["", "  "]}, "empty")
            answered.set()
            return empty, await asyncio.gather(*asks)

    with serving(app) as url:
        empty, (defaults, written) = asyncio.run(scenario(url))
    assert empty == ["", ""] and order[0] == "empty"
    assert written == defaults[:2] and batcher.joins == 1


def test_a_paired_runs_directory_serves_its_ensemble_and_shows_its_own_attention(model_dir, tmp_path):
    """A model directory with an ensemble.json (train.members): /translate decodes the ensemble, as
    `aiayn translate` does; /attention shows the directory's own model; alone: that model only."""
    import shutil

    import torch

    from aiayn.decode import Ensemble
    from aiayn.serve import load
    from helpers import randomize_

    first, second = tmp_path / "model", tmp_path / "member2" / "model"
    shutil.copytree(model_dir, first)
    shutil.copytree(model_dir, second)
    other = randomize_(Transformer.from_pretrained(second), 7)  # another member: other weights, one tokenizer
    other.save_pretrained(second)
    (first / "ensemble.json").write_text(json.dumps({"members": ["../member2/model"]}))

    translator, model = load(first)
    assert isinstance(translator.model, Ensemble) and len(translator.model.members) == 2
    own = Transformer.from_pretrained(first).state_dict()
    assert all(torch.equal(value, own[name]) for name, value in model.state_dict().items())  # the directory's
    together = Translator.from_pretrained(first).translate(SENTENCES, beam=2)
    alone = Translator.from_pretrained(first, alone=True).translate(SENTENCES, beam=2)
    assert together != alone  # the second member counts
    with TestClient(create_app(translator, model, ServeOptions())) as client:
        assert client.post("/translate", json={"texts": SENTENCES, "beam": 2}).json()["translations"] == together
        answer = client.post("/attention", json={"text": SENTENCES[0]}).json()
    expected = translation_attention(model, load_tokenizer(first), SENTENCES[0])
    assert answer["translation"] == expected.translation
    translator, _ = load(first, alone=True)
    assert isinstance(translator.model, Transformer) and translator.translate(SENTENCES, beam=2) == alone
