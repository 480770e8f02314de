"""The OpenAI API's request and response shapes, without the web framework: a JSON body in, a
checked ``Job`` (an engine ``Request`` plus what the answer needs) out, or an ``APIError`` that
names the field; and the JSON of answers, streamed chunks and errors.

Supported: ``POST /v1/completions`` (``prompt`` as text or token ids, or a list of them; ``n``
choices of each, ``parse_jobs``; ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``, ``stream_options``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias``; vLLM's ``repetition_penalty``,
``min_p``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``; ``logprobs`` (top
N per token, legacy format with ``text_offset``) and ``echo``, with ``max_tokens`` 0 for a
prompt's log-probabilities alone) and
``POST /v1/chat/completions`` (``messages``, rendered with the checkpoint's chat template;
``logprobs`` and ``top_logprobs``). Log-probabilities are the model's own distribution, before
temperature, penalties and filters.
Extensions, as vLLM names them: ``top_k``, ``ignore_eos`` (stop only at ``max_tokens``),
``return_token_ids`` (each choice carries the ids); and ``return_engine_timing``: the answer's
last chunk carries the engine's own clock for the request (each token's time since it arrived),
so that a client can put its own latencies beside the engine's.

Strict: a field this server does not read is a 400 naming it (with the closest known name), and
a field it knows but does not implement (``UNSUPPORTED``) is a 400 unless it has its default
value; nothing sent is silently ignored, except what cannot change an answer (``NOT_APPLICABLE``:
``user``, ``metadata``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.prompts import check_vocabulary, token_rows
from ..core.sampling import SamplingParams
from ..core.tokenizer import TextStream, Tokenizer
from .async_engine import RequestStream
from .logits import LogitAdjustments, TokenLogprob
from .workload import MAX_LOGPROBS, Request, copy_requests

ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields of the OpenAI API this server does not implement, and the values it accepts for them (their defaults)
UNSUPPORTED = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (["text"],),
    "web_search_options": ({},),
    "verbosity": ("medium",),
}
ADJUSTMENTS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")  # serving.logits
# Fields read from a request's body, by endpoint; any other field is a 400 that names it (a typo such
# as "max_token" would otherwise quietly give the default). Fields the answer cannot depend on here
# (who the user is, what to store or bill) are accepted as they are.
NOT_APPLICABLE = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort")
NOT_APPLICABLE += ("prompt_cache_key", "safety_identifier")
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
)
MAX_CHOICES = 64  # choices per request at most: n times the number of prompts
COMMON_FIELDS += ("ignore_eos", "return_token_ids", "return_engine_timing", *UNSUPPORTED, *NOT_APPLICABLE)
COMMON_FIELDS += (*ADJUSTMENTS, "logit_bias", "min_tokens", "stop_token_ids", "include_stop_str_in_output")
COMMON_FIELDS += ("logprobs",)
FIELDS = {
    False: frozenset((*COMMON_FIELDS, "prompt", "echo")),
    True: frozenset((*COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs")),
}
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default


class APIError(Exception):
    """A request the server refuses: HTTP status, and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"  # a 401 too, as OpenAI's

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ModelInfo:
    """What the protocol needs to know of the served model."""

    name: str  # the id clients send as "model"
    tokenizer: Tokenizer
    vocab_size: int
    max_seq_len: int  # context: prompt + max_tokens at most
    eos_ids: tuple[int, ...]
    kv_pool_tokens: int | None = None  # what the engine's KV pool holds: prompt + max_tokens at most
    served_on: dict = field(default_factory=dict)  # hardware, device, dtype, threads: for labelling figures
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict:
        """The model's entry in /v1/models, with what a client benchmark needs to label its figures."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "minillm",
            "max_model_len": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "served_on": self.served_on,
        }


@dataclass
class Job:
    """A checked request: the engine's ``Request`` and what shaping the answer needs."""

    request: Request
    chat: bool  # /v1/chat/completions: answers are messages, chunks are deltas
    stream: bool = False
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # include_stop_str_in_output: the stop string ends the text
    include_usage: bool = False  # streamed: a last chunk with the token counts
    return_token_ids: bool = False
    return_engine_timing: bool = False
    logprobs: int | None = None  # log-probabilities of the answer's tokens, with this many top ones
    echo: bool = False  # completions: the answer's text starts with the prompt (and its logprobs)
    prompt_text: str = ""  # the prompt as text, for echo
    generate: bool = True  # False: echo with max_tokens 0, the prompt is the whole answer
    prompt_logprobs: list | None = None  # with echo and logprobs: the prompt's, filled by the server
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's place in the answer: prompt i's choice j is i * n + j
    first_of_prompt: bool = True  # counts its prompt's tokens in the usage (once per prompt, not per choice)
    # what the server saw of it (time.perf_counter), for the access log
    received: float = 0.0  # the request arrived
    first_token_at: float | None = None
    done_at: float | None = None
    produced: int = 0  # tokens of the answer
    finish_reason: str | None = None

    def saw(self, piece: Piece) -> None:
        """Account for one piece of the answer (the access log's figures)."""
        now = time.perf_counter()
        if piece.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.produced += len(piece.token_ids)
        if piece.finish_reason is not None:
            self.finish_reason, self.done_at = piece.finish_reason, now


# ---------------------------------------------------------------------------------------------
# Requests in


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    """body[name] if it has one of ``kinds`` (null or absent: ``default``), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {what}, got {type(value).__name__} {value!r:.60}", name)
    return value


def _sampling(body: dict, temperature_default: float = 1.0) -> SamplingParams:
    """Temperature, top_p, top_k and seed, each checked by ``SamplingParams`` and named when wrong."""
    values = {
        "temperature": body.get("temperature", temperature_default),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "seed": body.get("seed"),
    }
    values["temperature"] = temperature_default if values["temperature"] is None else values["temperature"]
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise APIError(400, str(e), name) from None
    return SamplingParams(**values)


def _adjustments(body: dict) -> LogitAdjustments:
    """Penalties, logit_bias and min_p (``serving.logits``), each named when wrong."""
    values = {name: body[name] for name in ADJUSTMENTS if body.get(name) is not None}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
            message = f"'logit_bias' must map token ids (as strings) to numbers in [-100, 100], got {bias!r:.60}"
            raise APIError(400, message, "logit_bias")
        values["logit_bias"] = tuple((int(k), v) for k, v in bias.items())
    try:
        return LogitAdjustments(**values)
    except ValueError as e:
        name = str(e).split(" ")[0].split("[")[0]
        raise APIError(400, str(e), name if name in body else None) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top log-probabilities per token, or None for no logprobs. Completions: the
    number is ``logprobs``; chat: ``logprobs`` is true or false, the number ``top_logprobs``."""
    if not chat:
        return _count(body, "logprobs", None)
    if not _get(body, "logprobs", (bool,), False, "true or false"):
        if body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return _count(body, "top_logprobs", 0)


def _count(body: dict, name: str, default: int | None) -> int | None:
    what = f"an integer in [0, {MAX_LOGPROBS}]"
    value = _get(body, name, (int,), default, what)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"'{name}' must be {what}, got {value}", name)
    return value


def _stop_token_ids(body: dict, model: ModelInfo) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    bad = not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    if bad or any(not 0 <= i < model.vocab_size for i in ids):
        message = f"'stop_token_ids' must be a list of token ids below {model.vocab_size}, got {ids!r:.60}"
        raise APIError(400, message, "stop_token_ids")
    return tuple(ids)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to 4 of them, got {stop!r:.60}", "stop")
    return tuple(stops)


def _prompt_ids(body: dict, model: ModelInfo) -> list[int]:
    """The prompt's ids: text is encoded; ids are checked (ints, in the vocabulary); one prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise APIError(400, "'prompt' is required: text, or a list of token ids", "prompt")
    if isinstance(prompt, str):
        refuse_unfittable_text(len(prompt), model, "prompt")
        ids = model.tokenizer.encode(prompt)
        if not ids:
            raise APIError(400, "'prompt' is empty: it encodes to no token at all", "prompt")
        return ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"'prompt' holds {len(prompt)} prompts: parse_jobs takes them apart", "prompt")
    if not isinstance(prompt, list):
        raise APIError(400, f"'prompt' must be text or a list of token ids, got {type(prompt).__name__}", "prompt")
    try:
        ids = token_rows(prompt)[0]
        check_vocabulary([ids], model.vocab_size)
    except ValueError as e:
        raise APIError(400, f"'prompt' must be text or a list of token ids: {e}", "prompt") from None
    return ids


def refuse_unfittable_text(chars: int, model: ModelInfo, field_name: str) -> None:
    """A 400 for text that cannot fit the context however it tokenizes, before it is tokenized
    (a 10 MB prompt would keep a worker busy for seconds): no token spans more than
    ``max_token_chars`` characters; the factor 2 leaves room for a normalizer that shortens text."""
    most = 2 * model.max_seq_len * model.tokenizer.max_token_chars
    if chars > most:
        message = (
            f"'{field_name}' is {chars:,} characters: more than the context of {model.max_seq_len:,} tokens "
            f"can hold (no token here spans more than {model.tokenizer.max_token_chars} characters), so it "
            "was not tokenized"
        )
        raise APIError(400, message, field_name, "context_length_exceeded")


def _chat_ids(body: dict, model: ModelInfo) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
    if model.tokenizer.chat_template is None:
        raise APIError(
            400,
            f"{model.name} has no chat template (its tokenizer_config.json carries none), so chat "
            "messages cannot be turned into a prompt; use /v1/completions with a prompt instead",
            "messages",
            "no_chat_template",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"'messages[{i}]' needs a 'role', one of {list(ROLES)}", f"messages[{i}].role")
        content = m.get("content")  # a string or text parts: a text model refuses images rather than drop them
        if not isinstance(content, str) and not (isinstance(content, list) and all(map(_is_text_part, content))):
            param = f"messages[{i}].content"
            what = "a string or a list of text parts, each {'type': 'text', 'text': <string>}"
            raise APIError(400, f"'{param}' must be {what}, got {content!r:.80}", param)
    refuse_unfittable_text(sum(len(message_text(m)) for m in messages), model, "messages")
    text = render_chat(model.tokenizer, [{"role": m["role"], "content": message_text(m)} for m in messages])
    return model.tokenizer.encode(text, add_special_tokens=False)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def message_text(message: dict) -> str:
    """A message's content as text: a string, or its text parts joined."""
    content = message["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def render_chat(tokenizer: Tokenizer, messages: list[dict]) -> str:
    """The chat template rendered as Hugging Face does (a sandboxed Jinja environment, trim_blocks,
    lstrip_blocks, the generation prompt added); an error in it is a 400 on ``messages``."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None


def parse_jobs(body: Any, model: ModelInfo, chat: bool) -> list[Job]:
    """A body -> one checked ``Job`` per choice: ``n`` of each prompt (completions take a list of
    prompts, as text or as lists of ids), in the order of their ``index``. With a seed, choice j
    of a prompt samples with seed + j, so that the choices differ yet repeat from run to run."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    n = _get(body, "n", (int,), 1, "a positive integer")
    prompt = body.get("prompt")
    several = (
        not chat and isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    )
    prompts = prompt if several else [prompt]
    if n < 1 or n * len(prompts) > MAX_CHOICES:
        message = f"'n' ({n}) times the prompts ({len(prompts)}) must be between 1 and {MAX_CHOICES} choices"
        raise APIError(400, message, "n")
    jobs = []
    for i, p in enumerate(prompts):
        one = {k: v for k, v in body.items() if k != "n"} | ({} if chat else {"prompt": p})
        try:
            job = parse_job(one, model, chat)
        except APIError as e:
            if several and e.param == "prompt":
                e.param = f"prompt[{i}]"
            raise
        for j in range(n):
            request = copy_requests([job.request])[0]
            if j and request.params.seed is not None:
                request.params = dataclasses.replace(request.params, seed=(request.params.seed + j) % 2**63)
            first = jobs[0] if jobs else job
            jobs.append(
                dataclasses.replace(
                    job, request=request, index=len(jobs), first_of_prompt=j == 0, id=first.id, created=first.created
                )
            )
    return jobs


def parse_job(body: Any, model: ModelInfo, chat: bool) -> Job:
    """A completions (or chat completions) body of one choice -> a checked ``Job``, or an
    ``APIError`` (``parse_jobs`` takes a body of several choices apart)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("n", 1) != 1:
        raise APIError(400, "parse_job reads a body of one choice: parse_jobs takes 'n' apart", "n")
    name = _get(body, "model", (str,), model.name, "a string")
    if name != model.name:
        raise APIError(
            404,
            f"the model {name!r} does not exist here; this server serves {model.name!r}",
            "model",
            "model_not_found",
        )
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        close = difflib.get_close_matches(unknown[0], FIELDS[chat], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = "chat completions" if chat else "completions"
        names = ", ".join(repr(k) for k in unknown)
        raise APIError(
            400, f"unknown field{'s' if len(unknown) > 1 else ''} {names} in a {what} request{hint}", unknown[0]
        )
    for key, accepted in UNSUPPORTED.items():
        if body.get(key) is not None and body[key] not in accepted:
            raise APIError(400, f"'{key}' is not supported by this server (only its default {accepted[0]!r})", key)
    ids = _chat_ids(body, model) if chat else _prompt_ids(body, model)
    room, field_name = model.max_seq_len - len(ids), "messages" if chat else "prompt"
    if room < 1:
        raise APIError(
            400,
            f"'{field_name}' is {len(ids)} tokens: no room left in the context of {model.max_seq_len}",
            field_name,
            "context_length_exceeded",
        )
    pool = model.kv_pool_tokens
    if pool is not None and len(ids) >= pool:  # not even one output token fits: the prompt is what is too large
        message = f"'{field_name}' is {len(ids)} tokens: the KV pool holds {pool} tokens, prompt and answer together"
        raise APIError(400, message, field_name, "request_too_large")
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    fits = room if pool is None else min(room, pool - len(ids))
    max_tokens = _get(body, limit, (int,), fits if chat else DEFAULT_MAX_TOKENS, "a positive integer")
    echo = not chat and _get(body, "echo", (bool,), False, "true or false")
    generate = not (echo and max_tokens == 0)  # echo alone: a prompt's log-probabilities, as evaluations ask
    if max_tokens < 1 and generate:
        raise APIError(400, f"'{limit}' must be a positive integer, got {max_tokens}", limit)
    if max_tokens > room:
        raise APIError(
            400,
            f"prompt ({len(ids)} tokens) + '{limit}' ({max_tokens}) exceeds the context length "
            f"{model.max_seq_len}; ask for at most {room} tokens",
            limit,
            "context_length_exceeded",
        )
    ignore_eos = _get(body, "ignore_eos", (bool,), False, "true or false")
    stream = _get(body, "stream", (bool,), False, "true or false")
    options = _get(body, "stream_options", (dict,), {}, "an object")
    min_tokens = _get(body, "min_tokens", (int,), 0, "an integer >= 0")
    if not 0 <= min_tokens <= max_tokens:
        raise APIError(400, f"'min_tokens' must be in [0, {limit}={max_tokens}], got {min_tokens}", "min_tokens")
    stop_ids = (() if ignore_eos else model.eos_ids) + _stop_token_ids(body, model)
    adjust = _adjustments(body)
    try:
        adjust.check_vocabulary(model.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), "logit_bias") from None
    logprobs = _logprobs(body, chat)
    request = Request(ids, max(max_tokens, 1), params=_sampling(body), stop_ids=stop_ids, min_tokens=min_tokens)
    request.adjust, request.logprobs = adjust, logprobs
    request.validate()
    prompt = body.get("prompt")
    return Job(
        request=request,
        chat=chat,
        stream=stream,
        stop=_stop(body),
        include_stop=_get(body, "include_stop_str_in_output", (bool,), False, "true or false"),
        include_usage=bool(options.get("include_usage")) and stream,
        return_token_ids=_get(body, "return_token_ids", (bool,), False, "true or false"),
        return_engine_timing=_get(body, "return_engine_timing", (bool,), False, "true or false"),
        logprobs=logprobs,
        echo=echo,
        prompt_text=(prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)) if echo else "",
        generate=generate,
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
    )


# ---------------------------------------------------------------------------------------------
# Text out


def usage(job: Job, completion_tokens: int) -> dict:
    n = len(job.request.prompt)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def total_usage(jobs: list[Job], completion_tokens: int) -> dict:
    """The usage of an answer of several choices: each prompt counted once, every choice's tokens."""
    n = sum(len(job.request.prompt) for job in jobs if job.first_of_prompt)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


class Logprobs:
    """An answer's ``logprobs`` field, piece by piece, as each API defines it. Completions (the
    legacy format): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top N and the chosen
    token) and ``text_offset`` (where each token starts in the answer's text, the echoed prompt
    included). Chat: ``content``, one ``{token, logprob, bytes, top_logprobs}`` per token."""

    def __init__(self, job: Job, tokenizer: Tokenizer):
        self.job, self.tokenizer = job, tokenizer
        self.ids: list[int] = []  # the answer's tokens so far, for the offsets
        self.base = len(job.prompt_text) if job.echo else 0

    def _text(self, token: int) -> str:
        """A token as text; one that is not whole UTF-8 characters as its bytes, as OpenAI writes
        it ("bytes:\\xe2\\x80")."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def prompt(self) -> dict:
        """The echoed prompt's part (completions): None for its first token, nothing predicts it."""
        ids, logprobs = self.job.request.prompt, self.job.prompt_logprobs
        return {
            "tokens": [self._text(t) for t in ids],
            "token_logprobs": [lp and lp.logprob for lp in logprobs],
            "top_logprobs": [lp and self._top(t, lp) for t, lp in zip(ids, logprobs)],
            "text_offset": [len(self.tokenizer.decode(ids[:i])) for i in range(len(ids))],
        }

    def _top(self, token: int, lp: TokenLogprob) -> dict[str, float]:
        return {self._text(t): v for t, v in lp.top} | {self._text(token): lp.logprob}

    def piece(self, ids: list[int], logprobs: list[TokenLogprob]) -> dict:
        """The part for these new tokens of the answer."""
        if self.job.chat:

            def entry(t: int, v: float) -> dict:
                return {"token": self._text(t), "logprob": v, "bytes": list(self.tokenizer.token_bytes(t))}

            content = [
                {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                for t, lp in zip(ids, logprobs)
            ]
            return {"content": content}
        offsets = []
        for t in ids:
            offsets.append(self.base + len(self.tokenizer.decode(self.ids)))
            self.ids.append(t)
        return {
            "tokens": [self._text(t) for t in ids],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top(t, lp) for t, lp in zip(ids, logprobs)],
            "text_offset": offsets,
        }

    @staticmethod
    def merge(parts: list[dict]) -> dict:
        """Parts of one answer as one field (every list joined)."""
        return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def _choice(
    job: Job, text: str, token_ids: list[int], finish_reason: str | None, chunk: bool, logprobs: dict | None = None
) -> dict:
    if not job.chat:
        choice = {"index": job.index, "text": text}
    elif chunk:
        choice = {"index": job.index, "delta": {"content": text} if text else {}}
    else:
        choice = {"index": job.index, "message": {"role": "assistant", "content": text}}
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    if job.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def _envelope(job: Job, model: str, chunk: bool, choices: list[dict]) -> dict:
    kind = ("chat.completion" if job.chat else "text_completion") + (".chunk" if job.chat and chunk else "")
    return {"id": job.id, "object": kind, "created": job.created, "model": model, "choices": choices}


def chunk_json(
    job: Job,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One server-sent event's JSON: the new text (and ids, and logprobs), and on the last one the
    finish reason."""
    return _envelope(job, model, True, [_choice(job, text, token_ids, finish_reason, True, logprobs)])


def role_chunk_json(job: Job, model: str) -> dict:
    """A streamed chat answer's first chunk: who speaks."""
    choice = {
        "index": job.index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _envelope(job, model, True, [choice])


def usage_chunk_json(jobs: list[Job], model: str, completion_tokens: int) -> dict:
    return {**_envelope(jobs[0], model, True, []), "usage": total_usage(jobs, completion_tokens)}


def response_json(
    job: Job, model: str, text: str, token_ids: list[int], finish_reason: str, logprobs: dict | None = None
) -> dict:
    """The whole answer of a request that was not streamed."""
    return {
        **_envelope(job, model, False, [_choice(job, text, token_ids, finish_reason, False, logprobs)]),
        "usage": usage(job, len(token_ids)),
    }


def engine_timing(request: Request, token_times: list[float]) -> dict:
    """The engine's clock for one request: each token's time since the request arrived (s)."""
    return {"token_times": [t - request.arrival for t in token_times]}


@dataclass
class Piece:
    """What one engine delta adds to an answer: text (possibly empty, held back), ids, their times."""

    text: str
    token_ids: list[int]
    times: list[float]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id, when the job asked


async def answer(job: Job, stream: RequestStream, abort: Callable[[int, str], None], tokenizer: Tokenizer):
    """The answer to ``job`` as ``Piece``s, from its engine stream. A stop string ends it (the
    request is ended with reason "stop", its blocks freed: a normal finish in /metrics); leaving
    early, a client that goes away, aborts it."""
    text = TextStream(tokenizer, job.stop, job.include_stop)
    done = False
    try:
        async for delta in stream:
            ids, pieces = [], []
            for token in delta.tokens:
                ids.append(token)
                pieces.append(text.push(token))
                if text.stopped:
                    break
            if delta.finished and not text.stopped:
                pieces.append(text.finish())
            reason = "stop" if text.stopped else delta.finish_reason
            done = reason is not None
            times, logprobs = list(delta.times[: len(ids)]), list(delta.logprobs[: len(ids)])
            yield Piece("".join(pieces), ids, times, reason, delta.error, logprobs)
            if done:
                return
    finally:
        if not done or text.stopped:  # a no-op for a request the engine has finished already
            abort(stream.id, "stop" if text.stopped else "abort")
