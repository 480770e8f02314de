"""An OpenAI-compatible HTTP server on the continuous-batching engine (FastAPI + uvicorn).

    python -m minillm serve --model minillm-target            # http://127.0.0.1:8000
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def add(a, b):", "max_tokens": 32, "stream": true}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (with the checkpoint's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). With an API key,
every ``/v1`` request needs ``Authorization: Bearer KEY`` (the scheme in any case). A body
over the size limit is a 413, and a large one never stalls the others. Bad input is a 4xx with an OpenAI
error object naming the field (``openai_api``); the engine loop (``async_engine``) keeps serving.
A client that goes away aborts its request. On SIGINT/SIGTERM the server stops accepting, lets
requests in flight finish for ``shutdown_timeout`` seconds, aborts the rest and exits.

The web framework is imported only when a server is made (``create_app``, ``run_server``), so
the rest of minillm works without the ``serve`` extra.
"""

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.config import check_field_types
from ..core.device import hardware_description, threads_label
from .async_engine import AsyncEngine
from .engine import Engine, EngineConfig, RequestTooLargeError
from .logits import prompt_logprobs
from .openai_api import (
    APIError,
    Logprobs,
    ModelInfo,
    Piece,
    answer,
    chunk_json,
    engine_timing,
    parse_job,
    parse_jobs,
    refuse_unfittable_text,
    response_json,
    role_chunk_json,
    total_usage,
    usage_chunk_json,
)
from .options import EngineOptions, build_engine
from .workload import Request

SERVE_EXTRA = "pip install 'minillm[serve]' (fastapi, uvicorn, prometheus_client, jinja2)"
MAX_BODY_BYTES = 4 * 2**20  # a request body larger than this is a 413 (``--max-body-bytes``)
API_KEY_VARIABLE = "MINILLM_API_KEY"  # where ``serve`` reads the key when no --api-key is given
ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health, /metrics"
LOG_LEVELS = ("debug", "info", "warning", "error")
access_log = logging.getLogger("minillm.access")  # one line per answered request (``--log-level info``)


def require_serve_extra() -> None:
    """ImportError naming what to install when the server's packages are missing."""
    missing = []
    for name in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"the server needs {', '.join(missing)}: {SERVE_EXTRA}")


@dataclass(frozen=True)
class ServerOptions(EngineOptions):
    """What ``serve`` runs: the engine's options (``serving.options.EngineOptions``: the model, the
    runtime's techniques, speculation, the context and the pool), and the server's own."""

    host: str = "127.0.0.1"  # loopback only by default; 0.0.0.0 serves the network
    port: int = 8000  # 0: any free port (the first printed line says which)
    api_key: str | None = None  # when set, /v1 requests need "Authorization: Bearer <api_key>"
    shutdown_timeout: float = 5.0  # seconds requests in flight may take to finish on SIGTERM
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is refused (413) before it is read
    served_model_name: str | None = None  # the name clients send as "model" (default: ``model``)
    log_level: str = "info"  # info: an access line per request; warning: errors and warnings only

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address such as 127.0.0.1, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")
        check_field_types(self, ints=("max_body_bytes",))
        name = self.served_model_name
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError(f"served_model_name must be a non-empty string or None, got {name!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        t = self.shutdown_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"shutdown_timeout must be a finite number of seconds >= 0, got {t!r}")
        super().__post_init__()  # the engine's and the runtime's checks: what does not compose is refused


def model_info(name: str, tokenizer, engine: Engine) -> ModelInfo:
    """What the API says of the served model, where it runs, and what the engine's KV pool holds."""
    if tokenizer is None:
        raise ValueError(f"{name} has no tokenizer.json: a server needs one to turn text into tokens")
    model, config = engine.model, engine.config
    served_on = {
        "hardware": hardware_description(model.device),
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads() if model.device.type == "cpu" else None,
        "max_batch": config.scheduler.max_batch,
    }
    c, pool = model.config, config.num_blocks * config.block_size
    return ModelInfo(name, tokenizer, c.vocab_size, engine.context, c.eos_ids, kv_pool_tokens=pool, served_on=served_on)


# ---------------------------------------------------------------------------------------------
# The application


def create_app(
    engine: AsyncEngine, name: str, tokenizer, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
):
    """The FastAPI app serving ``engine``'s model as ``name``; its lifespan starts the engine's loop
    and shuts it down. A body over ``max_body_bytes`` is a 413, refused as soon as its length is
    known; decoding the JSON and tokenizing run in a worker thread, so that a large prompt never
    holds up the event loop, and with it every other request and ``/health``."""
    require_serve_extra()
    from fastapi import APIRouter, Depends, FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from .prometheus import ServerMetrics

    name = name.strip()

    info = model_info(name, tokenizer, engine.engine)
    metrics = ServerMetrics(engine)

    class CountResponses:
        """Counts every HTTP response by its status, for /metrics (plain ASGI: a streamed answer
        and a client's disconnect pass through untouched)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)

            async def sending(message):
                if message["type"] == "http.response.start":
                    metrics.count_response(message["status"])
                await send(message)

            await self.app(scope, receive, sending)

    class EngineStreamingResponse(StreamingResponse):
        """The events of the engine requests of one answer (one per choice). However the response
        ends (answered, the client gone before it started or while it ran, the server stopping),
        the requests end with it."""

        def __init__(self, events, request_ids: list[int]):
            super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.request_ids = request_ids

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                for request_id in self.request_ids:
                    engine.abort(request_id)  # a no-op once the request has finished
                with contextlib.suppress(RuntimeError):  # the events' generator, closed now, not when collected
                    await self.body_iterator.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not engine.running:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    async def authorize(request: HTTPRequest) -> None:  # async: a plain def would run in a thread pool, per request
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CountResponses)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    async def serve(request: HTTPRequest, chat: bool):
        received = time.perf_counter()
        raw = await read_body(request, max_body_bytes)
        jobs = await asyncio.to_thread(lambda: parse_jobs(json_body(raw), info, chat))
        first = jobs[0]
        for job in jobs:
            job.received = received
        if first.echo and first.logprobs is not None:  # a forward of each prompt, in a worker thread too
            found: dict[tuple[int, ...], list] = {}
            for job in jobs:
                key = tuple(job.request.prompt)
                if key not in found:
                    found[key] = await asyncio.to_thread(prompt_logprobs, engine.engine.model, list(key), job.logprobs)
                job.prompt_logprobs = found[key]
        formats = [Logprobs(job, tokenizer) if job.logprobs is not None else None for job in jobs]
        if not first.generate:  # echo with max_tokens 0: the prompts and their log-probabilities are the answer
            pieces = [no_pieces() for _ in jobs]
            if first.stream:
                return StreamingResponse(sse_events(jobs, info.name, pieces, formats), media_type="text/event-stream")
            body = await collect_all(jobs, info.name, pieces, formats)
            log_answer(jobs, 200)
            return JSONResponse(body)
        streams = []
        try:
            for job in jobs:
                streams.append(engine.add_request(job.request))
        except (ValueError, RuntimeError) as e:
            for stream in streams:  # all the choices or none
                engine.abort(stream.id)
            if isinstance(e, RequestTooLargeError):
                raise APIError(400, str(e), "max_tokens", "request_too_large") from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e), "messages" if chat else "prompt") from None
            raise APIError(503, str(e), code="shutting_down") from None
        pieces = [answer(job, stream, engine.abort, tokenizer) for job, stream in zip(jobs, streams)]
        ids = [stream.id for stream in streams]
        if first.stream:
            return EngineStreamingResponse(sse_events(jobs, info.name, pieces, formats), ids)
        collecting = asyncio.ensure_future(collect_all(jobs, info.name, pieces, formats))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():  # the client went away, or the server stops: the requests end
                collecting.cancel()
                for request_id in ids:
                    engine.abort(request_id)
                with contextlib.suppress(asyncio.CancelledError):  # cancel() only asks: wait until it has
                    await collecting
        if collecting.cancelled():
            log_answer(jobs, 499)
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        log_answer(jobs, 200)
        return JSONResponse(collecting.result())

    @v1.post("/completions")
    async def completions(request: HTTPRequest):
        return await serve(request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await serve(request, chat=True)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [info.card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != info.name:
            message = f"the model {model_id!r} does not exist here; this server serves {info.name!r}"
            raise APIError(404, message, "model", "model_not_found")
        return info.card()

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: HTTPRequest):
        """vLLM's /tokenize: a prompt's token ids (its text or chat messages), as the model reads it."""
        body = json_body(await read_body(request, max_body_bytes))
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise APIError(400, "/tokenize takes a JSON object with 'prompt' (text) or 'messages'", "prompt")
        if "messages" in body:
            ids = await asyncio.to_thread(lambda: parse_job({"messages": body["messages"]}, info, True).request.prompt)
        elif isinstance(body["prompt"], str):
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise APIError(400, "'add_special_tokens' must be true or false", "add_special_tokens")
            refuse_unfittable_text(len(body["prompt"]), info, "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, body["prompt"], add)
        else:
            raise APIError(400, f"'prompt' must be text, got {type(body['prompt']).__name__}", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": info.max_seq_len}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: HTTPRequest):
        """vLLM's /detokenize: token ids -> text."""
        body = json_body(await read_body(request, max_body_bytes))
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "/detokenize takes a JSON object with 'tokens': a list of token ids", "tokens")
        if any(not 0 <= t < info.vocab_size for t in ids):
            raise APIError(400, f"'tokens' must be token ids below {info.vocab_size}", "tokens")
        return {"prompt": tokenizer.decode(ids)}

    @app.get("/version")
    async def version():
        from .. import __version__

        return {"version": __version__}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if engine.running:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        access_log.info("%s %s %d %s", request.method, request.url.path, e.status, e.message)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None  # what a 401 must say (RFC 9110)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException):
        what = f"{request.method} {request.url.path}"
        message = f"no route {what}; this server has {ROUTES}" if e.status_code == 404 else f"{e.detail}: {what}"
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(APIError(e.status_code, message, code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, e: Exception):  # logged by uvicorn; the client gets one line
        body = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").body()
        return JSONResponse(body, status_code=500)

    return app


async def read_body(request, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before a byte is read, or while it streams in."""
    too_large = f"the request body is over this server's limit of {limit:,} bytes (serve --max-body-bytes)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, too_large, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, too_large, code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def json_body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def disconnected(request) -> None:
    """Return when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def no_pieces():
    """The answer of a job that generates nothing (echo with max_tokens 0): it ends at once."""
    yield Piece("", [], [], "length")


async def collect_all(jobs, model: str, pieces: list, formats: list) -> dict:
    """The whole answer of a request of several choices, collected side by side: one choice each,
    the usage summed (each prompt once). A failure in one ends them all."""
    tasks = [asyncio.ensure_future(collect(*args)) for args in zip(jobs, [model] * len(jobs), pieces, formats)]
    try:
        bodies = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if len(bodies) == 1:
        return bodies[0]
    body = {**bodies[0], "choices": [b["choices"][0] for b in bodies]}
    body["usage"] = total_usage(jobs, sum(b["usage"]["completion_tokens"] for b in bodies))
    if "engine_timing" in body:
        body["engine_timing"] = [b["engine_timing"] for b in bodies]  # by choice
    return body


async def collect(job, model: str, pieces, logprobs: Logprobs | None = None) -> dict:
    """A whole answer, for a request that is not streamed; an engine error is a 500. However it
    ends, ``pieces`` is closed (which ends the request). With echo, the text (and the logprobs)
    start with the prompt's."""
    text, ids, times, reason = [job.prompt_text] if job.echo else [], [], [], None
    parts = [logprobs.prompt()] if logprobs is not None and job.echo else []
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            if piece.error is not None:
                raise APIError(500, f"the request failed in the engine: {piece.error}", code="engine_error")
            job.saw(piece)
            text.append(piece.text)
            ids += piece.token_ids
            times += piece.times
            reason = piece.finish_reason
            if logprobs is not None:
                parts.append(logprobs.piece(piece.token_ids, piece.logprobs))
    merged = Logprobs.merge(parts) if parts else None
    body = response_json(job, model, "".join(text), ids, reason, merged)
    if job.return_engine_timing:
        body["engine_timing"] = engine_timing(job.request, times)
    return body


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse_events(jobs, model: str, pieces: list, formats: list):
    """Server-sent events of an answer: each choice's chunks (``choice_events``) as they come,
    choices interleaved, then the usage when asked for, then ``data: [DONE]``. Closed early (the
    client gone), it closes every choice's ``pieces``, which ends their requests."""
    counts = [0] * len(jobs)
    try:
        async with contextlib.aclosing(_interleaved(jobs, model, pieces, formats, counts)) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        log_answer(jobs, 200)
    if jobs[0].include_usage:
        yield event(usage_chunk_json(jobs, model, sum(counts)))
    yield event("[DONE]")


async def _interleaved(jobs, model: str, pieces: list, formats: list, counts: list[int]):
    """The choices' chunks as they come (one choice: its own, in order)."""
    if len(jobs) == 1:
        async with contextlib.aclosing(choice_events(jobs[0], model, pieces[0], formats[0], counts)) as events:
            async for chunk in events:
                yield chunk
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def run(k: int) -> None:
            try:
                async with contextlib.aclosing(
                    choice_events(jobs[k], model, pieces[k], formats[k], counts, k)
                ) as events:
                    async for chunk in events:
                        queue.put_nowait(chunk)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(run(k)) for k in range(len(jobs))]
        try:
            running = len(tasks)
            while running:
                chunk = await queue.get()
                if chunk is None:
                    running -= 1
                else:
                    yield chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def log_answer(jobs, status: int) -> None:
    """The access log's line for one answered request: its id and status, then per choice the
    prompt and output tokens, time to first token and total (s, from the request's arrival at
    the server) and how it ended ("gone" for a client that left first)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    choices = []
    for job in jobs:
        ttft = f"{job.first_token_at - job.received:.3f}" if job.first_token_at is not None else "-"
        total = f"{(job.done_at or time.perf_counter()) - job.received:.3f}"
        reason = job.finish_reason or "gone"
        choices.append(
            f"prompt={len(job.request.prompt)} output={job.produced} ttft={ttft}s total={total}s finish={reason}"
        )
    route = "/v1/chat/completions" if jobs[0].chat else "/v1/completions"
    access_log.info("%s POST %s %d %s", jobs[0].id, route, status, "; ".join(choices))


async def choice_events(job, model: str, pieces, logprobs: Logprobs | None, counts: list[int], k: int = 0):
    """One choice's events: one chunk per step that adds text (every step with return_token_ids
    or logprobs), the finish reason on the last; with echo, a first chunk holds the prompt (and
    its logprobs). ``counts[k]`` counts its tokens. Closed, it closes ``pieces``."""
    async with contextlib.aclosing(pieces):
        if job.chat:
            yield event(role_chunk_json(job, model))
        if job.echo:
            yield event(chunk_json(job, model, job.prompt_text, [], None, logprobs and logprobs.prompt()))
        times = []
        async for piece in pieces:
            if piece.error is not None:
                failed = APIError(500, f"the request failed in the engine: {piece.error}", code="engine_error")
                yield event(failed.body())
                break
            job.saw(piece)
            counts[k] += len(piece.token_ids)
            times += piece.times
            if piece.text or piece.finish_reason or ((job.return_token_ids or logprobs) and piece.token_ids):
                part = logprobs.piece(piece.token_ids, piece.logprobs) if logprobs is not None else None
                chunk = chunk_json(job, model, piece.text, piece.token_ids, piece.finish_reason, part)
                if piece.finish_reason and job.return_engine_timing:
                    chunk["engine_timing"] = engine_timing(job.request, times)
                yield event(chunk)


# ---------------------------------------------------------------------------------------------
# Running it


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), bound here so the port is known. Its
    protocol is named (IPPROTO_TCP), so that asyncio sets TCP_NODELAY on the connections it
    accepts: with Nagle's algorithm on, each small streamed chunk waits for the client's delayed
    ACK (about 40 ms on Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def make_server(app, shutdown_timeout: float, drain: Callable[[], None] | None = None, log_level: str = "warning"):
    """A uvicorn server for ``app``. On SIGINT/SIGTERM (or ``should_exit``) it stops accepting,
    lets requests in flight run for ``shutdown_timeout`` s, then calls ``drain`` (which aborts what
    is left, so that every stream still ends with its last chunk and ``[DONE]``); a connection
    still open 2 s later is cut. It then exits normally: uvicorn re-raises the signal after its
    graceful shutdown, which would end the process with the signal's status instead of 0."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, drain) if drain else None
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    config = uvicorn.Config(
        app,
        http="h11",
        loop="asyncio",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout + (2 if drain else 0),
    )
    return Server(config)


def configure_logging(level: str) -> None:
    """minillm's log lines (the access log included) on stderr at ``level``; uvicorn's own at the
    same level, its access log off (ours has the tokens and latencies)."""
    logger = logging.getLogger("minillm")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logging.getLogger("uvicorn").setLevel(level.upper())


def warm_up(engine: Engine) -> None:
    """The first forward's one-off costs (and compiling, with ``--compile``) kept out of the first
    client's latency: the engine compiles its graphs, then one tiny request runs through a throwaway
    engine on the same model (a tensor-parallel model's ranks warm up on their first step)."""
    engine.warmup()
    if not getattr(engine.model, "remote", False):
        Engine(engine.model, EngineConfig(num_blocks=2, block_size=engine.config.block_size)).run([Request([0], 2)])


def run_server(options: ServerOptions) -> int:
    """Load the model, print where it is served, and serve until SIGINT/SIGTERM; returns 0."""
    require_serve_extra()
    configure_logging(options.log_level)
    served, tokenizer = build_engine(options)  # refuses a draft or a max_model_len that does not fit
    try:
        model = served.model
        warm_up(served)
        engine = AsyncEngine(served)
        name = options.served_model_name or options.model
        shown = options.model if name == options.model else f"{options.model} as {name!r}"
        app = create_app(engine, name, tokenizer, options.api_key, options.max_body_bytes)
        sock = bind(options.host, options.port)
        host = f"[{options.host}]" if ":" in options.host else options.host
        where = f"{model.device.type}, {str(model.dtype).removeprefix('torch.')}"
        if model.device.type == "cpu":
            where += f", {threads_label(torch.get_num_threads())}"
        print(
            f"serving {shown} on http://{host}:{sock.getsockname()[1]} ({where}; {options.describe()}; "
            f"max batch {options.max_batch}, {options.num_blocks} KV blocks of {options.block_size} tokens)",
            flush=True,
        )
        drain = lambda: engine.shutdown(timeout=0)  # noqa: E731
        make_server(app, options.shutdown_timeout, drain, options.log_level).run(sockets=[sock])
    finally:
        served.close()  # a tensor-parallel model's ranks end with the server
    print("server stopped", file=sys.stderr, flush=True)
    return 0
