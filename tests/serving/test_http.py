"""The HTTP server, through the real ``openai`` client and raw HTTP on 127.0.0.1: greedy answers
equal ``minillm.generate`` token for token, streamed or not; stop strings stop; 64 concurrent
streams each get their own answer and leave no block behind; a client that goes away frees its
blocks; every bad input is a 4xx naming the field and the server goes on; an API key is
enforced; SIGTERM with requests in flight exits 0 within its bound."""

import asyncio
import contextlib
import itertools
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import minillm
from minillm.serving.client import last_line, server_url
from minillm.serving.http import collect, create_app, sse_events
from minillm.serving.openai_api import APIError, Job, Piece, render_chat
from minillm.serving.workload import Request
from tests.serving.conftest import LiveServer, make_engine
from tests.test_cli import assert_one_line_error, run_main

openai = pytest.importorskip("openai")
NAME = "tiny-serve"
POOL_BLOCKS = 30  # 480 tokens: less than the context (512), so a request can fit one and not the other
REPO = Path(__file__).resolve().parents[2]
ABORTED = 'minillm_requests_finished_total{reason="abort"}'
STOPPED = 'minillm_requests_finished_total{reason="stop"}'
E2E_COUNT = "minillm_e2e_request_latency_seconds_count"


class Live:
    def __init__(self, url, model, tokenizer, engine):
        self.url, self.model, self.tokenizer, self.engine = url, model, tokenizer, engine
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        return minillm.generate(self.model, ids, n).tokens[0].tolist()

    def metric(self, name: str, missing: float | None = None) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        if found is None and missing is not None:
            return missing
        return float(found.group(1))

    def wait_for(self, name: str, value: float, timeout: float = 10.0) -> None:
        """Until the metric ``name`` reaches ``value`` (histograms are observed just after a step's
        state is published)."""
        deadline = time.monotonic() + timeout
        while self.metric(name, missing=0.0) < value:
            assert time.monotonic() < deadline, f"{name} stayed below {value}"
            time.sleep(0.02)

    def wait_until_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metric("minillm_kv_blocks_used") or self.metric("minillm_requests_running"):
            assert time.monotonic() < deadline, "the server kept blocks or requests after its clients left"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def live(checkpoint):
    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model, num_blocks=POOL_BLOCKS)
    with LiveServer(create_app(engine, NAME, tokenizer), engine) as url:
        yield Live(url, model, tokenizer, engine)


PROMPT = "def add(a, b):"


def test_completion_equals_generate_with_usage(live):
    ids = live.tokenizer.encode(PROMPT)
    expected = live.greedy(ids, 12)
    r = live.client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == live.tokenizer.decode(expected) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert r.object == "text_completion" and r.model == NAME


def test_streamed_completion_equals_generate(live):
    ids = live.tokenizer.encode(PROMPT)
    expected = live.greedy(ids, 20)
    chunks = list(
        live.client.completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    body = [c for c in chunks if c.choices]
    assert len(body) >= 10, "tokens should come in many chunks, not one at the end"
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == expected
    assert "".join(c.choices[0].text for c in body) == live.tokenizer.decode(expected)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_stop(live, stream):
    """The request ends when its stop string comes (long before max_tokens), its blocks freed, and
    /metrics counts it as finished by a stop, with its end-to-end latency, not as an abort."""
    full = live.tokenizer.decode(live.greedy(live.tokenizer.encode(PROMPT), 40))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    before = {name: live.metric(name, missing=0.0) for name in (ABORTED, STOPPED, E2E_COUNT)}
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=300, temperature=0, stop=[stop])
    if stream:
        chunks = [c for c in live.client.completions.create(stream=True, **kwargs) if c.choices]
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = live.client.completions.create(**kwargs).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == full[: full.index(stop)] and reason == "stop"
    live.wait_until_idle()  # the request was ended when its stop string came
    live.wait_for(E2E_COUNT, before[E2E_COUNT] + 1)
    assert live.metric(STOPPED) == before[STOPPED] + 1 and live.metric(ABORTED, missing=0.0) == before[ABORTED]


def adjusted_greedy(model, ids: list[int], n: int, repetition=1.0, presence=0.0, frequency=0.0) -> list[int]:
    """The reference: a whole forward per token, the penalties written out from their definitions."""
    tokens = list(ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1].float()
        for t in set(tokens):  # CTRL's repetition penalty, over prompt and output
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        out = tokens[len(ids) :]
        for t in set(out):  # OpenAI's presence and frequency penalties, over the output
            logits[t] -= presence + frequency * out.count(t)
        tokens.append(int(logits.argmax()))
    return tokens[len(ids) :]


@pytest.mark.parametrize(
    "penalties",
    [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.5}],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_change_greedy_tokens_as_defined(live, penalties):
    ids = live.tokenizer.encode(PROMPT)
    names = {"repetition_penalty": "repetition", "frequency_penalty": "frequency", "presence_penalty": "presence"}
    expected = adjusted_greedy(live.model, ids, 24, **{names[k]: v for k, v in penalties.items()})
    assert expected != live.greedy(ids, 24), "the penalty should change this prompt's answer"
    r = live.client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"return_token_ids": True, **penalties}
    )
    assert r.choices[0].model_extra["token_ids"] == expected


def test_logit_bias_bans_and_forces_tokens(live):
    ids = live.tokenizer.encode(PROMPT)
    first = live.greedy(ids, 1)[0]
    extra = {"return_token_ids": True}

    def tokens(**kwargs) -> list[int]:
        r = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, **kwargs)
        return r.choices[0].model_extra["token_ids"]

    assert tokens(logit_bias={str(first): -100}, extra_body=extra)[0] != first
    assert tokens(logit_bias={"7": 100}, extra_body=extra) == [7] * 6


def test_min_p_samples_only_likely_tokens(live):
    ids = live.tokenizer.encode(PROMPT)
    r = live.client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=30,
        temperature=1.0,
        seed=3,
        extra_body={"min_p": 0.3, "return_token_ids": True},
    )
    out = r.choices[0].model_extra["token_ids"]
    with torch.no_grad():
        probs = live.model(torch.tensor([ids + out]))[0, len(ids) - 1 : -1].float().softmax(-1)
    chosen = probs[torch.arange(len(out)), torch.tensor(out)]
    assert (chosen >= 0.3 * probs.max(-1).values - 1e-6).all()
    plain = live.client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=3, extra_body={"return_token_ids": True}
    ).choices[0]
    assert plain.model_extra["token_ids"] != out, "at temperature 1, min_p 0.3 should drop some tokens drawn without it"


def test_stop_token_ids_stop_and_min_tokens_holds_them_off(live):
    ids = live.tokenizer.encode(PROMPT)
    greedy = live.greedy(ids, 8)

    def answer(**extra):
        r = live.client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True, **extra}
        )
        return r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason

    assert answer(stop_token_ids=[greedy[2]]) == (greedy[: greedy.index(greedy[2]) + 1], "stop")
    held, _ = answer(stop_token_ids=[greedy[0]], min_tokens=4)
    assert len(held) >= 4 and greedy[0] not in held[:4]


def test_include_stop_str_in_output_keeps_the_stop_string(live):
    full = live.tokenizer.decode(live.greedy(live.tokenizer.encode(PROMPT), 40))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop])
    kept = live.client.completions.create(extra_body={"include_stop_str_in_output": True}, **kwargs).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)] and kept.finish_reason == "stop"


def test_a_bundled_model_answers_chat_clients(capsys):
    """The bundled models carry a minimal chat template (training.train.CHAT_TEMPLATE): a chat
    client's request is rendered with it and answered with the greedy tokens of that prompt."""
    model, tokenizer = minillm.load("minillm-draft")
    engine = make_engine(model)
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "Read a file."}]
    prompt = render_chat(tokenizer, messages)
    assert prompt == "<|endoftext|>system: Answer in Python.\nuser: Read a file.\nassistant:"
    expected = minillm.generate(model, tokenizer.encode(prompt, add_special_tokens=False), 12, eos_token_id=None)
    with LiveServer(create_app(engine, "minillm-draft", tokenizer), engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(
            model="minillm-draft", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
    assert r.choices[0].message.content == tokenizer.decode(expected.tokens[0].tolist())


def token_text(tokenizer, token: int) -> str:
    """A token as OpenAI's logprobs spell it: its text, or "bytes:\\x.." when not whole characters."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def direct_logprobs(model, ids: list[int], out: list[int]) -> torch.Tensor:
    """log p(out[i] | ids + out[:i]) and each position's distribution, from one forward of it all."""
    with torch.no_grad():
        return model(torch.tensor([ids + out]))[0, len(ids) - 1 : -1].float().log_softmax(-1)


def completion_logprobs(live, stream: bool, **kwargs):
    args = dict(
        model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, extra_body={"return_token_ids": True}
    )
    args.update(kwargs)
    if not stream:
        choice = live.client.completions.create(**args).choices[0]
        return choice.text, choice.logprobs.model_dump(), choice.model_extra.get("token_ids", [])
    chunks = [c.choices[0] for c in live.client.completions.create(stream=True, **args) if c.choices]
    parts = [c.logprobs.model_dump() for c in chunks if c.logprobs is not None]
    merged = {key: [x for part in parts for x in part[key]] for key in parts[0]}
    return "".join(c.text for c in chunks), merged, [t for c in chunks for t in c.model_extra.get("token_ids") or []]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_equal_a_direct_forward(live, stream):
    """Completions' legacy logprobs: each token's log-probability and the top 3 of its position
    equal one forward of the model over prompt and answer; text_offset is where each token's text
    starts in the answer."""
    ids = live.tokenizer.encode(PROMPT)
    text, lp, out = completion_logprobs(live, stream)
    assert out == live.greedy(ids, 8)
    expected = direct_logprobs(live.model, ids, out)
    assert torch.allclose(torch.tensor(lp["token_logprobs"]), expected[torch.arange(8), torch.tensor(out)], atol=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
        best = torch.topk(expected[i], 3)
        want = {token_text(live.tokenizer, t): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        assert set(want) <= set(top) and all(abs(top[k] - v) < 1e-4 for k, v in want.items())
    assert lp["tokens"] == [token_text(live.tokenizer, t) for t in out]
    assert lp["text_offset"] == [len(live.tokenizer.decode(out[:i])) for i in range(8)]
    assert text == live.tokenizer.decode(out)


def test_echo_returns_the_prompt_and_its_logprobs(live):
    """What an evaluation harness asks for a log-likelihood: echo with max_tokens 0 answers with
    the prompt, each of its tokens' log-probability given the ones before (None for the first),
    and no generated token; with max_tokens, the answer follows the prompt."""
    ids = live.tokenizer.encode(PROMPT)
    r = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    expected = direct_logprobs(live.model, ids[:1], ids[1:])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert torch.allclose(
        torch.tensor(lp.token_logprobs[1:]), expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4
    )
    assert lp.text_offset == [len(live.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    text, merged, out = completion_logprobs(live, False, echo=True)
    assert text == PROMPT + live.tokenizer.decode(out) and len(merged["tokens"]) == len(ids) + 8
    assert merged["text_offset"][len(ids)] == len(PROMPT)
    streamed = completion_logprobs(live, True, echo=True)
    assert streamed[0] == text and streamed[1]["token_logprobs"][1:] == pytest.approx(
        merged["token_logprobs"][1:], abs=1e-4
    )
    bare = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in bare if c.choices) == PROMPT


def test_chat_logprobs_equal_a_direct_forward(live):
    messages = [{"role": "user", "content": "hi"}]
    r = live.client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    out = r.choices[0].model_extra["token_ids"]
    ids = live.tokenizer.encode(render_chat(live.tokenizer, messages), add_special_tokens=False)
    expected = direct_logprobs(live.model, ids, out)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [token_text(live.tokenizer, t) for t in out]
    assert [bytes(c.bytes) for c in content] == [live.tokenizer.token_bytes(t) for t in out]
    assert torch.allclose(
        torch.tensor([c.logprob for c in content]), expected[torch.arange(6), torch.tensor(out)], atol=1e-4
    )
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_n_choices_sample_with_their_own_seeds(live):
    """n=3 with a seed: three different answers, choice j the one a request of seed 5 + j gets,
    the prompt counted once in the usage; streamed, the chunks of each index give the same texts."""
    args = dict(model=NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"return_token_ids": True})
    r = live.client.completions.create(n=3, seed=5, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, "three seeds should give three answers"
    for j, choice in enumerate(r.choices):
        alone = live.client.completions.create(seed=5 + j, **args).choices[0]
        assert choice.model_extra["token_ids"] == alone.model_extra["token_ids"]
    ids = live.tokenizer.encode(PROMPT)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 30)
    chunks = [c for c in live.client.completions.create(n=3, seed=5, stream=True, **args) if c.choices]
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == j) for j in range(3)]
    assert streamed == texts


def test_a_list_of_prompts_is_answered_prompt_by_prompt(live):
    """Four prompts in one request, two choices each: the choices come in prompt order (index
    i * n + j), each the greedy answer to its prompt; usage counts every prompt once."""
    prompts = ["def add(a, b):", "class Stack:", "import os", "x = ["]
    r = live.client.completions.create(
        model=NAME, prompt=prompts, n=2, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in r.choices] == list(range(8))
    for c in r.choices:
        assert c.model_extra["token_ids"] == live.greedy(live.tokenizer.encode(prompts[c.index // 2]), 6)
    assert r.usage.prompt_tokens == sum(len(live.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 8 * 6
    as_ids = live.client.completions.create(
        model=NAME, prompt=[live.tokenizer.encode(p) for p in prompts[:2]], max_tokens=6, temperature=0
    )
    assert [c.text for c in as_ids.choices] == [r.choices[0].text, r.choices[2].text]


def test_chat_completion_renders_the_template(live):
    messages = [{"role": "user", "content": "Add two numbers."}]
    ids = live.tokenizer.encode(render_chat(live.tokenizer, messages), add_special_tokens=False)
    expected = live.tokenizer.decode(live.greedy(ids, 10))
    r = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = live.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, stream=True, temperature=0
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == [NAME]
    assert httpx.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/v1/models/{NAME}", timeout=10).json()["max_model_len"] == 512


def test_metrics_name_what_the_issue_asks_for(live):
    live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    for name in (
        "minillm_time_to_first_token_seconds_bucket",
        "minillm_inter_token_latency_seconds_bucket",
        "minillm_e2e_request_latency_seconds_count",
        "minillm_requests_running",
        "minillm_requests_waiting",
        "minillm_kv_blocks_used",
        "minillm_kv_blocks_free",
        "minillm_preemptions_total",
        "minillm_generation_tokens_total",
        "minillm_prompt_tokens_total",
    ):
        assert re.search(rf"^{name}(\{{.*\}})? ", text, re.M), f"{name} missing from /metrics"
    assert live.metric("minillm_kv_blocks_free") == POOL_BLOCKS and live.metric("minillm_generation_tokens_total") >= 3


def test_the_operators_metrics_parse_and_count_what_happened(checkpoint):
    """On a fresh server: two requests sharing a 32-token prefix, one streamed, and one bad one.
    Prometheus' own parser reads every family; the split latencies, lengths, prefix-cache
    tokens, KV usage and responses by status count exactly those requests."""
    from prometheus_client.parser import text_string_to_metric_families

    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model)
    prefix = list(range(1, 33))
    with LiveServer(create_app(engine, NAME, tokenizer), engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model=NAME, prompt=prefix + [40, 41], max_tokens=5, temperature=0)
        list(client.completions.create(model=NAME, prompt=prefix + [50], max_tokens=4, temperature=0, stream=True))
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_token": 3}, timeout=10).status_code == 400
        deadline = time.monotonic() + 10
        while True:
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
            if samples.get(("minillm_request_generation_tokens_count", ()), 0) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert samples[(f"minillm_{name}_count", ())] == 2, name
    assert samples[("minillm_time_per_output_token_seconds_count", ())] == 2
    assert samples[("minillm_request_prompt_tokens_sum", ())] == 34 + 33
    assert samples[("minillm_request_generation_tokens_sum", ())] == 5 + 4
    assert samples[("minillm_prefix_cache_queries_total", ())] == 34 + 33
    assert samples[("minillm_prefix_cache_hits_total", ())] == 32  # the second found the first's two blocks
    assert 0 <= samples[("minillm_kv_cache_usage_ratio", ())] <= 1
    assert samples[("minillm_http_responses_total", (("status", "200"),))] >= 2
    assert samples[("minillm_http_responses_total", (("status", "400"),))] == 1


def test_the_access_log_has_a_line_per_request(live):
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("minillm.access")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        r = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        list(live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
        httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    n = len(live.tokenizer.encode(PROMPT))
    assert re.fullmatch(
        rf"{r.id} POST /v1/completions 200 prompt={n} output=4 ttft=\d+\.\d{{3}}s total=\d+\.\d{{3}}s finish=length",
        lines[0],
    ), lines
    assert f"prompt={n} output=3" in lines[1] and "finish=length" in lines[1]
    assert lines[2].startswith("POST /v1/completions 400 'max_tokens' must be a positive integer"), lines[2]


def test_tokenize_detokenize_and_version(live):
    ids = live.tokenizer.encode(PROMPT)
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    assert r == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    expected = live.tokenizer.encode(
        render_chat(live.tokenizer, [{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    assert chat.json()["tokens"] == expected
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": ids}, timeout=10).json() == {"prompt": PROMPT}
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": [99999]}, timeout=10).status_code == 400
    assert httpx.post(f"{live.url}/tokenize", json={}, timeout=10).status_code == 400
    assert httpx.get(f"{live.url}/version", timeout=10).json() == {"version": minillm.__version__}


def test_64_concurrent_streams_each_get_their_own_answer(live):
    prompts = [[(7 * i + j) % live.tokenizer.vocab_size for j in range(3 + i % 9)] for i in range(64)]
    expected = [live.greedy(p, 6) for p in prompts]
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(p):
        stream = await client.completions.create(
            model=NAME, prompt=p, max_tokens=6, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
        return [t async for c in stream for t in c.choices[0].model_extra["token_ids"]]

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 60)
        finally:
            await client.close()

    assert asyncio.run(main()) == expected
    live.wait_until_idle()
    assert live.engine.engine.blocks.allocator.num_used == 0


def test_a_client_that_goes_away_frees_its_blocks(live):
    aborted = live.metric(ABORTED, missing=0.0)
    body = {"model": NAME, "prompt": "x", "max_tokens": 470, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{live.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept: a line iterator collected closes the response, and the client is gone
        events = [line for line in itertools.islice(lines, 6) if line]  # each event: its line, then a blank one
        assert len(events) == 3 and all(e.startswith("data: ") for e in events), events
        assert live.metric("minillm_kv_blocks_used") > 0
    live.wait_until_idle()
    assert live.metric(ABORTED) == aborted + 1
    r = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_a_client_that_goes_away_before_a_whole_answer_frees_its_blocks_too(live):
    """Not streamed: the handler notices the closed connection while the engine generates, and
    the abort is the whole story: no traceback in the server's log (uvicorn's error logger)."""
    import logging
    import socket

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "minillm")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        aborted = live.metric(ABORTED, missing=0.0)
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 470, "temperature": 0}).encode()
        host, port = live.url.removeprefix("http://").split(":")
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 10
            while not live.metric("minillm_kv_blocks_used"):
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.005)
        live.wait_until_idle()
        assert live.metric(ABORTED) == aborted + 1
        time.sleep(0.2)  # the handler returns after the abort: give it the time to log, if it would
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


def test_a_large_body_holds_up_nobody(live):
    """A 10 MB body is a 413 (refused from its Content-Length, or cut off while it streams in
    without one), and a 3 MB prompt under the limit is refused before it is tokenized: while
    they are sent over and over, /health and a small completion answer as fast as ever."""
    big = json.dumps({"model": NAME, "prompt": "x " * 5_000_000}).encode()  # 10 MB
    under = json.dumps({"model": NAME, "prompt": "y" * 3_000_000}).encode()
    stop, statuses = threading.Event(), []

    def flood():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set() and len(statuses) < 200:
                headers = {"Content-Type": "application/json"}
                statuses.append(client.post(f"{live.url}/v1/completions", content=big, headers=headers).status_code)
                chunks = (big[i : i + 2**20] for i in range(0, len(big), 2**20))  # no Content-Length: chunked
                statuses.append(client.post(f"{live.url}/v1/completions", content=chunks, headers=headers).status_code)
                statuses.append(client.post(f"{live.url}/v1/completions", content=under, headers=headers).status_code)

    def slowest(call, n: int = 10) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return max(times)

    small = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=10) as client:

        def health():
            assert client.get(f"{live.url}/health").status_code == 200

        def complete():
            assert client.post(f"{live.url}/v1/completions", json=small).status_code == 200

        quiet = max(slowest(health), slowest(complete))
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while len(statuses) < 3:
                assert time.monotonic() < deadline and thread.is_alive(), "the flood never got an answer"
                time.sleep(0.01)
            busy = max(slowest(health), slowest(complete))
        finally:
            stop.set()
            thread.join(30)
    assert not thread.is_alive()
    assert set(statuses[0::3]) == {413} and set(statuses[1::3]) == {413} and set(statuses[2::3]) == {400}
    assert busy < quiet + 0.3, f"a large body delayed others: slowest {busy:.3f} s against {quiet:.3f} s quiet"


def test_serve_reads_the_api_key_from_the_environment(monkeypatch, capsys):
    from minillm.serving import http

    seen = []
    monkeypatch.setattr(http, "run_server", lambda options: seen.append(options) or 0)
    monkeypatch.setenv(http.API_KEY_VARIABLE, "from-env")
    assert run_main(["serve", "--model", "minillm-draft"], capsys)[0] == 0
    assert run_main(["serve", "--model", "minillm-draft", "--api-key", "given"], capsys)[0] == 0
    assert run_main(["serve", "--model", "minillm-draft", "--max-body-bytes", "1000"], capsys)[0] == 0
    named = ["serve", "--model", "minillm-draft", "--served-model-name", "draft", "--log-level", "warning"]
    assert run_main(named, capsys)[0] == 0
    assert [o.api_key for o in seen] == ["from-env", "given", "from-env", "from-env"]
    assert [o.max_body_bytes for o in seen] == [http.MAX_BODY_BYTES, http.MAX_BODY_BYTES, 1000, http.MAX_BODY_BYTES]
    assert [(o.served_model_name, o.log_level) for o in seen] == [(None, "info")] * 3 + [("draft", "warning")]


def test_a_request_when_the_engine_is_not_running_is_a_503(checkpoint):
    """Shut down (or its loop gone): the engine refuses the request, the client gets an OpenAI
    error object with a 503, never a request left waiting."""
    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model)  # never started: what add_request sees once the loop has closed
    app = create_app(engine, NAME, tokenizer)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=10) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    r = asyncio.run(asyncio.wait_for(main(), 10))
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.json()["error"]["type"] == "server_error"


def test_a_client_gone_before_its_stream_starts_aborts_the_request(checkpoint):
    """The request is in the engine before the response starts: a client that left in between
    (the response's first send fails) must not leave it running to its max_tokens."""
    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model).start()
    app = create_app(engine, NAME, tokenizer)
    body = json.dumps({"prompt": "x", "max_tokens": 400, "stream": True, "temperature": 0}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    try:
        with contextlib.suppress(Exception):  # the app reports the failed send; the request is what matters
            asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
        deadline = time.monotonic() + 30

        def settled() -> bool:  # the stats are a snapshot after each step: wait for the abort's own
            s = engine.stats
            return bool(s.get("finished_abort")) and not (s["running"] or s["waiting"] or s["kv_blocks_used"])

        while not settled():
            assert time.monotonic() < deadline, f"the request was not aborted: {engine.stats}"
            time.sleep(0.01)
        assert engine.stats.get("finished_abort") == 1 and engine.stats["generated_tokens"] < 400
    finally:
        assert engine.shutdown(30)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_events_or_a_collected_answer_ended_early_close_the_answer(chat):
    """Closing the events at any yield, or an engine error while collecting, closes the answer's
    pieces (whose end aborts the request) at once, not whenever the generator is collected."""
    closed = []

    async def pieces(error: str | None = None):
        try:
            yield Piece("a", [1], [0.0], error=error)
            yield Piece("b", [2], [0.0])
        finally:
            closed.append(True)

    job = Job(Request([1, 2], 5), chat=chat, stream=True)

    async def main():
        answer = pieces()
        events = sse_events([job], NAME, [answer], [None])
        assert (await anext(events)).startswith("data: ")  # a chat's first event comes before any piece
        await events.aclose()
        assert answer.ag_frame is None, "the answer was left open"
        answer = pieces(error="boom")
        with pytest.raises(APIError, match="boom"):
            await collect(job, NAME, answer)
        assert answer.ag_frame is None and closed[-1]

    asyncio.run(asyncio.wait_for(main(), 10))


BAD = [
    # (path, body (bytes: sent raw), status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "'prompt' is required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "text or a list of token ids"),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400, "prompt", "not an int"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "positive"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "context length 512"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 490}, 400, "max_tokens", "KV pool has only 30"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k", "top_k must be"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed", "seed must be"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "true or false"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "'stop'"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "between 1 and 64"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 33}, 400, "n", "between 1 and 64"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt", "text or a list of token ids"),
    ("/v1/completions", {"prompt": ["a", [1, 99999]]}, 400, "prompt[1]", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_token": 40}, 400, "max_token", "did you mean 'max_tokens'"),
    ("/v1/completions", {"prompt": "hi", "messages": []}, 400, "messages", "unknown field 'messages'"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "(0, 100]"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty", "[-2, 2]"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20}, 400, "min_tokens", "max_tokens=16"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids", "token ids below"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids (as strings)"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs", "unknown field"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "positive"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "needs 'logprobs'",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        400,
        "echo",
        "unknown field",
    ),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "'gpt-9' does not exist"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "'messages' is required"),
    ("/v1/chat/completions", {"messages": [], "prompt": "hi"}, 400, "prompt", "unknown field 'prompt'"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "not supported",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
        400,
        "tool_choice",
        "not supported",
    ),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages[0].content",
        "list of text parts",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 160}]}, 400, "messages", "KV pool"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, None, "no route POST /v1/nowhere"),
    ("/v1/completions", {"prompt": "x" * 2_000_000}, 400, "prompt", "was not tokenized"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_000_000}]}, 400, "messages", "context"),
    ("/v1/completions", {"prompt": "x" * 5_000_000}, 413, None, "limit of 4,194,304 bytes"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{b[0]}:{str(b[1])[:30]}" for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field_and_the_server_goes_on(live, path, body, status, param, words):
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{live.url}{path}", timeout=10, **send)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error" and "Traceback" not in r.text
    good = live.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert good.usage.completion_tokens == 2


def test_a_wrong_method_is_405_in_the_same_shape(live):
    r = httpx.get(f"{live.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and "GET /v1/completions" in r.json()["error"]["message"]


def test_an_api_key_is_required_when_set(checkpoint, monkeypatch):
    import anyio.to_thread

    hops, run_sync = [], anyio.to_thread.run_sync  # how Starlette runs a plain def: in a worker thread

    async def counted(func, *args, **kwargs):
        hops.append(func)
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model)
    app = create_app(engine, NAME, tokenizer, api_key="s3cret")
    with LiveServer(app, engine) as url:
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert r.status_code == 200 and hops == [], "the key check must not cost each request a thread hop"
        body = {"prompt": "hi", "max_tokens": 2}
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
            r = httpx.post(
                f"{url}/v1/completions", json=body, headers={"Authorization": f"{scheme} s3cret"}, timeout=10
            )
            assert r.status_code == 200, r.text
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")  # as OpenAI's
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no key


@pytest.mark.slow
def test_sigterm_with_requests_in_flight_exits_0_within_the_bound(checkpoint):
    command = [sys.executable, "-m", "minillm", "serve", "--model", str(checkpoint), "--port", "0"]
    command += ["--shutdown-timeout", "0.5", "--threads", "1"]
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe nobody reads: a chatty server never blocks on it
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = server_url(proc, 60, log)
            started, ended = threading.Barrier(5, timeout=60), []

            def stream_one():
                body = {"prompt": "x", "max_tokens": 470, "stream": True, "temperature": 0}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                    lines = r.iter_lines()
                    next(lines)
                    started.wait()
                    ended.append([line for line in lines if line])

            clients = [threading.Thread(target=stream_one, daemon=True) for _ in range(4)]
            for c in clients:
                c.start()
            started.wait()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0, last_line(log)
            assert time.monotonic() - t0 < 8
            for c in clients:
                c.join(10)
            assert len(ended) == 4  # every stream ended with its last chunk (aborted) and [DONE], none cut
            for events in ended:
                assert events[-1] == "data: [DONE]"
                assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=20)
            proc.stdout.close()


def test_serve_without_the_extra_says_what_to_install(checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    status, _, err = run_main(["serve", "--model", str(checkpoint)], capsys)
    assert_one_line_error(status, err, "pip install 'minillm[serve]'", "fastapi")


def test_serve_options_are_checked_before_loading(capsys):
    status, _, err = run_main(["serve", "--port", "70000"], capsys)
    assert_one_line_error(status, err, "port must be an integer in [0, 65535]")
    status, _, err = run_main(["serve", "--max-batch", "0"], capsys)
    assert_one_line_error(status, err, "max_batch must be a positive integer")
    status, _, err = run_main(["serve", "--quantize", "int8", "--group-size", "32"], capsys)
    assert_one_line_error(status, err, "applies to int4 quantization only")  # the runtime's reason


def test_a_quantized_model_serves_the_tokens_generate_makes(monkeypatch):
    """serve --quantize loads through the runtime (bf16 on a CPU): the engine behind the server
    gives the greedy tokens minillm.generate gives on the same quantized model."""
    from minillm.runtime import load_model
    from minillm.serving.engine import Engine
    from minillm.serving.http import ServerOptions
    from minillm.serving.workload import Request

    options = ServerOptions(model="minillm-draft", device="cpu", quantize="int4", group_size=32)
    model, tokenizer = load_model(options.model, options.runtime_options())
    assert model.dtype == torch.bfloat16
    ids = tokenizer.encode("def read_config(path):")
    (out,) = Engine(model, options.engine_config()).run([Request(ids, 10)])
    assert out.tokens == minillm.generate(model, ids, 10, eos_token_id=None).tokens[0].tolist()


def test_sse_lines_are_data_events_ending_with_done(live):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0}
    text = httpx.post(f"{live.url}/v1/completions", json=body, timeout=10).text
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_accepted_connections_send_small_chunks_at_once():
    """TCP_NODELAY on every accepted connection (asyncio sets it only for sockets made with
    IPPROTO_TCP): without it each streamed chunk waits ~40 ms for the client's delayed ACK."""
    import socket

    from minillm.serving.http import bind

    async def main():
        flags = []

        async def accepted(reader, writer):
            flags.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            for _ in range(100):
                if flags:
                    break
                await asyncio.sleep(0.01)
            writer.close()
        return flags

    assert asyncio.run(asyncio.wait_for(main(), 10)) == [1]
