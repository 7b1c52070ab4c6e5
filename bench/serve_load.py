"""Load on ``aiayn serve``: 1, 8 and 32 concurrent clients over the Ding test split, against
``aiayn translate`` on the same file (issue 27).

The server runs as its own process (``aiayn serve``, as deployed); each client sends one sentence
per ``POST /translate`` (beam 4, the defaults) and sends the next when its answer comes, the
clients taking the split's lines in turn. Reported per number of clients: sentences per second
and its ratio to ``aiayn translate`` (``Translator.translate`` over the whole file in this process,
before the server starts: what the command does after loading the model; goal >= 0.7x at 32
clients), and to the command run on the file as a user runs it (loading the model included), p50
and p99 latency, errors (goal: none), and whether every answer equals the
command's translation of that line. Clients and server share the machine's cores: on a 2-core
CPU the clients' own work counts against the server.

    python bench/serve_load.py --model runs/ding/model [--data data/ding] [--clients 1 8 32] [--ensemble]

A paired run's directory (``train.members``) is served and translated by its first model alone
(``--alone``), unless ``--ensemble``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from aiayn import Translator
from aiayn.data.corpus import read_lines
from common import machine, table, write_result


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def load(url: str, lines: list[str], clients: int, beam: int) -> dict:
    """``clients`` clients through ``lines``, one sentence per request: answers, latencies, errors,
    and the CPU seconds the clients themselves took.

    Each client is one keep-alive HTTP/1.1 connection written and read with asyncio's streams:
    a load generator sharing the server's two cores must cost it little. (httpx's AsyncClient
    took 3.1-4.0 CPU seconds for the 1,007 requests at 32 clients, 30% of a core during the
    run, against 0.10 s for this client; the server's throughput rose from 79 to 126-135
    sentences/s, Xeon.)"""
    host, port = url.removeprefix("http://").split(":")
    answers: list[str | None] = [None] * len(lines)
    latencies: list[float] = []
    errors: list[str] = []
    nxt = iter(range(len(lines)))

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for i in nxt:
                body = json.dumps({"texts": [lines[i]], "beam": beam}).encode()
                head = (
                    f"POST /translate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                start = time.perf_counter()
                try:
                    writer.write(head + body)
                    status, data = await _response(reader)
                except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                    errors.append(f"line {i + 1}: {type(e).__name__}: {e}")
                    return  # the connection is gone: this client stops
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    errors.append(f"line {i + 1}: {status} {data[:200]!r}")
                else:
                    answers[i] = json.loads(data)["translations"][0]
        finally:
            writer.close()

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    return {
        "answers": answers, "latencies": latencies, "errors": errors, "seconds": seconds,
        "client_cpu_s": time.process_time() - cpu,
    }  # fmt: skip


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length (uvicorn's JSON answers): status, body."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:"))
    return status, await reader.readexactly(length)


def start_server(model: str, port: int, alone: bool = True) -> subprocess.Popen:
    command = [sys.executable, "-m", "aiayn", "serve", "--model", model, "--port", str(port), "--max-queue", "4096"]
    command += ["--alone"] if alone else []  # of a paired run (train.members), the first model only
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"aiayn serve exited: {server.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("aiayn serve did not answer /health within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (e.g. the demo's runs/ding/model)")
    parser.add_argument("--data", default="data/ding", help="directory of the Ding splits (default %(default)s)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--ensemble", action="store_true", help="a paired run's ensemble, not its first model alone")
    args = parser.parse_args()

    source = Path(args.data) / f"{args.split}.de"
    lines = list(read_lines(source))
    # the command as a user runs it (loading included), for a second baseline
    # --alone: a paired run's first model, as the server runs it here
    command = [sys.executable, "-m", "aiayn", "translate", "--model", args.model, "--beam", str(args.beam)]
    command += [] if args.ensemble else ["--alone"]
    start = time.perf_counter()
    subprocess.run([*command, "--input", str(source)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    command_rate = len(lines) / (time.perf_counter() - start)
    translator = Translator.from_pretrained(args.model, alone=not args.ensemble)
    translator.translate(lines[:50], beam=args.beam)  # warm-up: kernels built, caches touched
    start = time.perf_counter()
    reference = translator.translate(lines, beam=args.beam)
    baseline = len(lines) / (time.perf_counter() - start)
    del translator
    print(f"aiayn translate: {len(lines)} lines, {baseline:.1f} sentences/s (beam {args.beam})")

    server = start_server(args.model, args.port, alone=not args.ensemble)
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        asyncio.run(load(url, lines[:32], 8, args.beam))  # warm-up of the server
        for clients in args.clients:
            run = asyncio.run(load(url, lines, clients, args.beam))
            same = sum(a == r for a, r in zip(run["answers"], reference, strict=True))
            throughput = len(lines) / run["seconds"]
            rows.append({
                "clients": clients,
                "sentences_per_s": round(throughput, 1),
                "ratio": round(throughput / baseline, 3),
                "ratio_command": round(throughput / command_rate, 3),
                "p50_ms": round(1000 * percentile(run["latencies"], 0.5), 1),
                "p99_ms": round(1000 * percentile(run["latencies"], 0.99), 1),
                "errors": len(run["errors"]),
                "client_cpu_s": round(run["client_cpu_s"], 2),
                "same_as_translate": f"{same}/{len(lines)}",
            })  # fmt: skip
            print(f"{clients} clients: {throughput:.1f} sentences/s, errors {len(run['errors'])}", flush=True)
            for error in run["errors"][:5]:
                print("  ", error)
    finally:
        server.terminate()
        server.wait(timeout=30)

    columns = [
        ("clients", "clients"), ("sentences_per_s", "sentences/s"), ("ratio", "× Translator.translate"),
        ("ratio_command", "× the command"),
        ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("errors", "errors"), ("same_as_translate", "same output"),
        ("client_cpu_s", "clients' CPU s"),
    ]  # fmt: skip
    print(
        f"\naiayn translate on {args.split}.de (beam {args.beam}): Translator.translate {baseline:.1f} sentences/s, "
        f"the command with loading {command_rate:.1f}\n"
    )
    print(table(rows, columns))
    result = {
        "machine": machine(),
        "model": args.model,
        "ensemble": args.ensemble,
        "lines": len(lines),
        "beam": args.beam,
        "translate_sentences_per_s": round(baseline, 1),
        "command_sentences_per_s": round(command_rate, 1),
        "rows": rows,
        "command": "python bench/serve_load.py " + " ".join(sys.argv[1:]),
        "torch_threads_env": os.environ.get("OMP_NUM_THREADS"),
    }
    print(f"\nwritten to {write_result('serve_load_ensemble' if args.ensemble else 'serve_load', result)}")


if __name__ == "__main__":
    main()
