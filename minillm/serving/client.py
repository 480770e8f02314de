"""A client of the HTTP server, and the server in a process of its own: what ``bench serve``,
chapter 13's live run, chapter 16's served row and the tests all start and talk to.

``server_process`` runs ``python -m minillm serve`` on a free port of 127.0.0.1 (every wait
bounded, the process reaped); ``run_workload`` streams a workload's requests at their arrival
times and records each token's arrival at the client and on the engine's clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..core.checkpoints import DEFAULT_MODEL
from ..measure.metrics import RequestMetrics
from .workload import Request

HTTPX = "the HTTP client needs httpx: pip install httpx"


# ---------------------------------------------------------------------------------------------
# The server


@contextmanager
def server_process(
    model: str = DEFAULT_MODEL,
    max_batch: int = 16,
    threads: int | None = None,
    timeout: float = 120.0,
    options: Sequence[str] = (),
) -> Iterator[str]:
    """``python -m minillm serve`` in a process of its own, on a free port of 127.0.0.1: yields its
    URL once it answers /health (within ``timeout`` s); at the end SIGTERM, and a RuntimeError if
    it does not exit 0. ``threads``: its CPU threads (default: this process' count); ``options``:
    more of serve's flags, e.g. ("--quantize", "int8", "--compile")."""
    import torch

    command = [sys.executable, "-m", "minillm", "serve", "--model", model, "--port", "0", "--max-batch"]
    command += [str(max_batch), "--threads", str(threads or torch.get_num_threads()), "--shutdown-timeout", "2"]
    command += list(options)
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a chatty server never blocks on it
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = server_url(proc, timeout, log)
            wait_healthy(url, timeout)
            yield url
        except BaseException:
            stop_server(proc)
            raise
        if stop_server(proc) != 0:
            raise RuntimeError(f"the server exited with status {proc.returncode}: {last_line(log)}")


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=15)
    proc.stdout.close()
    return proc.returncode


def last_line(log) -> str:
    log.seek(0)
    lines = log.read().strip().splitlines()
    return lines[-1] if lines else "no output"


def server_url(proc: subprocess.Popen, timeout: float, log) -> str:
    """The URL the server prints on its first line, or a RuntimeError with what it said instead."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        line = ""
    if "http://" not in line:
        stop_server(proc)
        raise RuntimeError(f"the server did not start: {last_line(log)}")
    return "http://" + line.split("http://", 1)[1].split()[0]


def wait_healthy(url: str, timeout: float) -> dict:
    """Poll /health until it answers 200 (within ``timeout`` s); then the served model's card."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no healthy server at {url} within {timeout:.0f} s")
        time.sleep(0.1)
    card = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]
    if "vocab_size" not in card:
        raise ValueError(f"the server at {url} does not say its vocab_size: a minillm server does")
    return card


# ---------------------------------------------------------------------------------------------
# The client


@dataclass
class Measured:
    """One request measured at the client (perf_counter seconds) and by the engine (its clock)."""

    client: RequestMetrics
    engine: RequestMetrics
    send_delay: float = 0.0  # seconds the client sent it after its scheduled arrival (its own lateness)


def completion_body(model: str, request: Request) -> dict:
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_engine_timing": True,
    }


async def stream_one(client, model: str, request: Request, t0: float) -> Measured:
    """Send ``request`` at its arrival time; the time each token's chunk came in."""
    scheduled = t0 + request.arrival
    await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
    sent, times, engine_times = time.perf_counter(), [], None
    async with client.stream("POST", "/v1/completions", json=completion_body(model, request)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"request {request.id}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {request.id}: {chunk['error']['message']}")
            times += [now] * len(chunk["choices"][0].get("token_ids", []))
            engine_times = chunk.get("engine_timing", {}).get("token_times", engine_times)
    if engine_times is None or len(engine_times) != len(times):
        raise RuntimeError(f"request {request.id}: the server sent no engine timing for its {len(times)} tokens")
    n = len(request.prompt)
    return Measured(RequestMetrics(sent, times, n), RequestMetrics(0.0, engine_times, n), sent - scheduled)


async def stream_all(url: str, model: str, requests: Sequence[Request], bar: tqdm) -> list[Measured]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        await stream_one(client, model, Request([0], 2), time.perf_counter())  # a first connection, warm

        async def tracked(request: Request) -> Measured:
            measured = await stream_one(client, model, request, t0)
            bar.update()
            return measured

        t0 = time.perf_counter()
        return list(await asyncio.gather(*(tracked(r) for r in requests)))


def run_workload(url: str, model: str, requests: Sequence[Request], bar: tqdm) -> list[Measured]:
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise ImportError(HTTPX) from e
    return run_coroutine(stream_all(url, model, requests, bar))


def run_coroutine(coroutine):
    """``asyncio.run``, also from inside a running event loop (a notebook's): there the coroutine
    runs in a loop of its own on a worker thread, and this call waits for it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
