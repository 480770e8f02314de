"""The three result types (``generate``'s, the decoders', the engine's) share one base,
``core.outputs.TimedTokens``: the same greedy tokens read by the same names, and one meaning of
``total_time`` and ``tokens_per_s``."""

import math

import pytest

from minillm import generate
from minillm.core.generate import GenerationResult
from minillm.core.outputs import TimedTokens
from minillm.decoding.common import DecodingResult
from minillm.decoding.prompt_lookup import prompt_lookup_generate
from minillm.measure.metrics import RequestMetrics
from minillm.serving import Engine, EngineConfig, Request, RequestOutput
from minillm.serving.disagg import DisaggOutput
from tests.conftest import tiny_model

MODEL = tiny_model()
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture(scope="module")
def results() -> dict[str, TimedTokens]:
    (served,) = Engine(MODEL, EngineConfig(num_blocks=16, block_size=4)).run([Request(PROMPT, 12)])
    return {
        "generate": generate(MODEL, PROMPT, 12, eos_token_id=None),
        "prompt lookup": prompt_lookup_generate(MODEL, PROMPT, 12, k=3, eos_token_id=None),
        "engine": served,
    }


def test_every_result_type_has_the_one_base():
    for kind in (GenerationResult, DecodingResult, RequestOutput, DisaggOutput):
        assert issubclass(kind, TimedTokens), kind


def test_the_same_greedy_tokens_by_the_same_names(results):
    expected = results["generate"].token_lists()
    assert len(expected[0]) == 12
    for name, result in results.items():
        assert result.token_lists() == expected, name
        assert result.num_tokens == 12 and result.compile_time == 0.0, name


def test_tokens_per_s_is_new_tokens_over_the_total_time(results):
    for name, result in results.items():
        assert result.total_time > 0, name
        assert result.tokens_per_s == pytest.approx(12 / result.total_time), name


def test_a_request_that_made_no_token_has_no_total_time():
    out = RequestOutput(Request(PROMPT, 4), [], RequestMetrics(arrival=0.0), preemptions=0, finish_reason="error")
    assert math.isnan(out.total_time) and math.isnan(out.tokens_per_s) and out.num_tokens == 0
