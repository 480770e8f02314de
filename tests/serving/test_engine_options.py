"""EngineOptions and build_engine: every technique the engine serves with, composed. Greedy
tokens equal ``generate``'s (same model, same options) on a ragged workload with preemption for
eager, int8, compiled, compiled + int8, prompt lookup, a draft model, and tensor parallelism over
two ranks; what does not compose is refused with its reason before anything loads (or, for what
needs the loaded model, before a server would start); ``serve`` takes the same flags and answers
the openai client with them."""

from __future__ import annotations

import pytest

import minillm
from minillm.serving.client import server_process
from minillm.serving.engine import RequestTooLargeError
from minillm.serving.options import EngineOptions, build_engine
from minillm.serving.workload import Request
from tests.test_cli import assert_one_line_error, run_main

PROMPTS = ["def read_config(path):", "class Stack:\n    def push(self, x):", "import os\n", "for i in range(10):"]


def ragged(tokenizer, n: int = 8) -> list[tuple[list[int], int]]:
    """Prompts of different lengths (some repeating themselves, for prompt lookup), different lengths out."""
    work = []
    for i in range(n):
        ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)] * (1 + i % 3))
        work.append((ids, 6 + 5 * (i % 4)))
    return work


def expected(model, work) -> list[list[int]]:
    return [minillm.generate(model, p, n, eos_token_id=None).tokens[0].tolist() for p, n in work]


def served(options: EngineOptions, work, warm: bool = False) -> tuple[list[list[int]], dict]:
    """Greedy tokens of ``work`` from the engine ``options`` build (``warm``: its graphs compiled
    first; else each compiles when first used) and its counters."""
    engine, _ = build_engine(options)
    try:
        if warm:
            engine.warmup()
        outs = engine.run([Request(p, n) for p, n in work])
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [o.tokens for o in outs], engine.stats() | {"model": engine.model}
    finally:
        engine.close()


SMALL_POOL = dict(num_blocks=10, block_size=8, max_batch=4)  # 80 token slots: requests preempt each other
COMBINATIONS = {
    "eager": {},
    "int8": dict(quantize="int8"),
    "prompt lookup": dict(prompt_lookup=4),
    "draft": dict(speculative_model="minillm-draft", num_speculative_tokens=3),
    "radix, int4, lookup": dict(quantize="int4", group_size=32, prefix_cache="radix", prompt_lookup=3),
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_greedy_equals_generate_with_the_same_options(name):
    options = EngineOptions("minillm-target", device="cpu", **SMALL_POOL, **COMBINATIONS[name])
    _, tokenizer = minillm.load("minillm-target")
    work = ragged(tokenizer)
    tokens, stats = served(options, work)
    assert tokens == expected(stats["model"], work)
    assert stats["preemptions"] > 0
    if options.speculation() is not None:
        assert stats["spec_proposed_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_compiled_greedy_equals_generate(quantize):
    pool = dict(max_batch=2, num_blocks=12, block_size=4)  # two batch buckets, three read widths; preempting
    options = EngineOptions("minillm-target", device="cpu", compile=True, quantize=quantize, max_model_len=256, **pool)
    _, tokenizer = minillm.load("minillm-target")
    work = ragged(tokenizer, 6)
    tokens, stats = served(options, work, warm=quantize is None)
    assert tokens == expected(stats["model"], work) and stats["preemptions"] > 0


@pytest.mark.slow
def test_tensor_parallel_greedy_equals_generate(checkpoint):
    """Two rank processes, each with its shard and a pool of its heads; this process schedules."""
    model, tokenizer = minillm.load(checkpoint)
    work = ragged(tokenizer, 6)
    for extra in ({}, {"prompt_lookup": 3}):
        pool = dict(SMALL_POOL, num_blocks=16)  # byte-level tokens: longer prompts
        options = EngineOptions(str(checkpoint), tensor_parallel=2, **pool, **extra)
        tokens, stats = served(options, work)
        assert tokens == expected(model, work) and stats["preemptions"] > 0


def test_max_model_len_bounds_every_request():
    engine, _ = build_engine(EngineOptions("minillm-draft", device="cpu", max_model_len=64))
    with pytest.raises(RequestTooLargeError, match="context length 64"):
        engine.check(Request(list(range(60)), 5))
    engine.check(Request(list(range(59)), 5))


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(speculative_model="minillm-draft", prompt_lookup=4), "choose one"),
        (dict(num_speculative_tokens=3), "needs speculative_model"),
        (dict(prompt_lookup=0), "prompt_lookup must be a positive integer"),
        (dict(max_model_len=-1), "max_model_len must be a positive integer"),
        (dict(tensor_parallel=2, compile=True), "tensor parallelism with compile"),
        (dict(tensor_parallel=2, quantize="int8"), "quantized weights"),
        (dict(quantize="int8", group_size=32), "int4 quantization only"),
        (dict(prefix_cache="lru"), "prefix_cache must be one of"),
        (dict(max_batch=0), "max_batch must be a positive integer"),
    ],
)
def test_what_does_not_compose_is_refused_before_loading(options, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions("no-such-model-is-loaded", **options)


def test_what_needs_the_model_is_refused_by_build_engine(checkpoint):
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's context length"):
        build_engine(EngineOptions("minillm-draft", device="cpu", max_model_len=100_000))
    with pytest.raises(ValueError, match="vocabulary"):
        build_engine(EngineOptions(str(checkpoint), device="cpu", speculative_model="minillm-draft"))


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--prompt-lookup", "4", "--speculative-model", "minillm-draft"], ["choose one"]),
        (["--tensor-parallel", "2", "--compile"], ["tensor parallelism with compile"]),
        (["--num-speculative-tokens", "3"], ["needs speculative_model"]),
        (["--max-model-len", "0"], ["max_model_len must be a positive integer"]),
    ],
)
def test_serve_refuses_with_one_line_before_loading(flags, words, capsys):
    assert_one_line_error(*run_main(["serve", "--model", "minillm-draft", *flags], capsys)[::2], *words)


def test_serve_passes_every_option(monkeypatch, capsys):
    from minillm.serving import http

    seen = []
    monkeypatch.setattr(http, "run_server", lambda options: seen.append(options) or 0)
    flags = ["--quantize", "int8", "--compile", "--prompt-lookup", "8", "--max-model-len", "512"]
    flags += ["--prefix-cache", "radix", "--served-model-name", "t"]
    assert run_main(["serve", "--model", "minillm-target", *flags], capsys)[0] == 0
    (o,) = seen
    assert (o.quantize, o.compile, o.prompt_lookup, o.max_model_len, o.prefix_cache) == ("int8", True, 8, 512, "radix")
    assert o.engine_config().speculation.k == 8 and o.describe() == "int8, compiled, prompt lookup K=8"


def openai_answer(url: str, model: str, prompt: str, n: int) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"ignore_eos": True}
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body=body)
    return r.choices[0].text


@pytest.mark.slow
def test_serve_quantized_compiled_with_prompt_lookup_answers_the_openai_client():
    flags = ["--quantize", "int8", "--compile", "--prompt-lookup", "8", "--num-blocks", "64", "--max-model-len", "256"]
    options = EngineOptions(
        "minillm-target", device="cpu", quantize="int8", compile=True, prompt_lookup=8, max_model_len=256, max_batch=2
    )
    engine, tokenizer = build_engine(options)
    prompt = PROMPTS[1] * 2
    (want,) = engine.run([Request(tokenizer.encode(prompt), 24)])
    with server_process("minillm-target", max_batch=2, threads=1, timeout=600, options=flags) as url:
        assert openai_answer(url, "minillm-target", prompt, 24) == tokenizer.decode(want.tokens)


@pytest.mark.slow
def test_serve_tensor_parallel_answers_the_openai_client(checkpoint):
    model, tokenizer = minillm.load(checkpoint)
    prompt = "hello there"
    want = minillm.generate(model, tokenizer.encode(prompt), 16, eos_token_id=None).tokens[0].tolist()
    flags = ["--tensor-parallel", "2", "--num-blocks", "32"]
    with server_process(str(checkpoint), max_batch=4, threads=1, timeout=300, options=flags) as url:
        assert openai_answer(url, str(checkpoint), prompt, 16) == tokenizer.decode(want)
