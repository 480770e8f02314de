"""One careless request never breaks the engine for everyone: a Request validates every field on
construction (and again when the engine takes it), an error while serving one request ends that
request alone with finish_reason "error", and after any sequence of bad requests the engine still
serves a good one with the right tokens."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import SamplingParams, generate
from minillm.serving import engine as engine_module
from minillm.serving.engine import Engine, EngineConfig, StepCost
from minillm.serving.workload import Request
from tests.conftest import tiny_model

MODEL = tiny_model()
GOOD = [5, 17, 3, 44]


def make_engine() -> Engine:
    return Engine(MODEL, EngineConfig(num_blocks=32, block_size=4, step_cost=StepCost()))


def greedy(prompt: list[int], n: int) -> list[int]:
    return generate(MODEL, prompt, n, eos_token_id=None).tokens[0].tolist()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"stop_ids": 7}, r"stop_ids must be a collection of token ids such as \(7,\), got 7"),
        ({"stop_ids": "7"}, "stop_ids must be a collection"),
        ({"stop_ids": (1, -2)}, "stop_ids must hold non-negative token ids, got -2"),
        ({"stop_ids": (1.5,)}, "stop_ids must hold non-negative token ids, got 1.5"),
        ({"prompt": [1.5, 2.7]}, r"holds float 1\.5, not an int"),
        ({"prompt": torch.tensor([1.0, 2.0])}, "integer tensor"),
        ({"prompt": "Rain fell"}, "encode it with the tokenizer first"),
        ({"prompt": []}, "at least one token"),
        ({"prompt": [[1, 2], [3, 4]]}, "a request has one prompt, got 2 rows"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": 2.0}, "max_tokens must be a positive integer"),
        ({"arrival": -1.0}, "arrival must be a finite time >= 0"),
        ({"arrival": float("nan")}, "arrival must be a finite time"),
        ({"arrival": "soon"}, "arrival must be a finite time"),
        ({"params": {"temperature": 0.5}}, "params must be a SamplingParams"),
        ({"id": -3}, "id must be a non-negative integer"),
    ],
)
def test_request_fields_are_checked_on_construction(fields, match):
    with pytest.raises(ValueError, match=match):
        Request(**{"prompt": GOOD, "max_tokens": 4, **fields})


def test_sampling_params_refuse_a_bad_seed_and_a_boolean_temperature():
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed="x")
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=True)


@pytest.mark.parametrize("prompt", [torch.tensor(GOOD), torch.tensor([GOOD]), np.array(GOOD), tuple(GOOD)])
def test_request_takes_every_form_of_token_ids_generate_takes(prompt):
    assert Request(prompt, 3).prompt == GOOD


def test_a_request_changed_after_construction_is_refused_and_the_engine_serves_on():
    """The bug this guards against: stop_ids=7 accepted, then every later run raised TypeError."""
    engine = make_engine()
    bad = Request(list(GOOD), 3)
    bad.stop_ids = 7
    with pytest.raises(ValueError, match="stop_ids"):
        engine.run([bad])
    with pytest.raises(ValueError, match="stop_ids"):
        engine.add_request(bad)
    (out,) = engine.run([Request(list(GOOD), 5)])
    assert out.tokens == greedy(GOOD, 5) and out.finish_reason == "length" and out.error is None


def test_an_error_while_serving_one_request_ends_only_that_request(monkeypatch):
    real_sample = engine_module.sample

    def sample(logits, params, generator=None):
        if params.temperature == 0.5:  # the one poisoned request
            raise RuntimeError("sampling exploded")
        return real_sample(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)
    engine = make_engine()
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4, 4]]
    requests = [Request(p, 6) for p in prompts]
    requests.insert(1, Request([7, 7, 7], 6, params=SamplingParams(temperature=0.5)))
    outputs = engine.run(requests)
    assert [o.finish_reason for o in outputs] == ["length", "error", "length", "length"]
    assert "sampling exploded" in outputs[1].error
    for out, prompt in zip([outputs[0], *outputs[2:]], prompts):
        assert out.tokens == greedy(prompt, 6)
    assert engine.blocks.allocator.num_used == 0  # the failed request's blocks came back too
    (again,) = engine.run([Request(list(GOOD), 4)])
    assert again.tokens == greedy(GOOD, 4)


def test_a_failing_forward_ends_its_batch_and_the_engine_recovers(monkeypatch):
    engine = make_engine()
    calls = {"n": 0}
    real = engine._forward_split

    def flaky(work):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(work)

    monkeypatch.setattr(engine, "_forward_split", flaky)
    outputs = engine.run([Request([1, 2], 3), Request([3, 4], 3)])
    assert {o.finish_reason for o in outputs} == {"error"} and "device lost" in outputs[0].error
    assert engine.blocks.allocator.num_used == 0
    (out,) = engine.run([Request(list(GOOD), 3)])
    assert out.tokens == greedy(GOOD, 3)


def test_stop_ids_end_with_finish_reason_stop():
    first = greedy(GOOD, 1)[0]
    (out,) = make_engine().run([Request(list(GOOD), 8, stop_ids=(first,))])
    assert out.tokens == [first] and out.finish_reason == "stop"


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 200),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(-2, 120), st.floats(), st.text(max_size=2)), max_size=4),
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={"prompt": ANY, "max_tokens": ANY, "arrival": ANY, "stop_ids": ANY, "id": ANY, "params": ANY},
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_requests=st.lists(FIELDS, min_size=1, max_size=4))
def test_after_any_bad_requests_the_engine_serves_a_good_one(bad_requests):
    engine = make_engine()
    for fields in bad_requests:
        fields = {"prompt": [1, 2], "max_tokens": 2, **fields}
        try:
            request = Request(**fields)
            engine.add_request(request)
        except ValueError as e:  # the only exception a bad request may raise, with a message
            assert str(e)
    outputs = engine.run([Request(list(GOOD), 4)])
    assert outputs[-1].tokens == greedy(GOOD, 4)
    assert all(o.finish_reason in ("length", "stop") for o in engine.outputs.values())
    assert engine.blocks.allocator.num_used == 0


def test_a_request_that_fails_at_admission_is_returned_and_the_run_ends(monkeypatch):
    """The last request failing when admitted (its generator cannot be made) must not leave the
    engine waiting for work that will never come, and step() returns its output."""
    real = SamplingParams.generator

    def generator(params, device="cpu"):
        if params.seed in (5, 6):
            raise RuntimeError("no generator for you")
        return real(params, device)

    monkeypatch.setattr(SamplingParams, "generator", generator)
    request = Request([1, 2, 3], 4, params=SamplingParams(seed=5))
    engine = make_engine()
    engine.add_request(request)
    assert [o.finish_reason for o in engine.step()] == ["error"] and not engine.unfinished
    second = Request([4, 5], 3, params=SamplingParams(seed=6))
    (out,) = engine.run([second])
    assert out.finish_reason == "error" and "no generator" in out.error


def test_duplicate_ids_in_one_run_are_refused_before_anything_is_added():
    engine = make_engine()
    with pytest.raises(ValueError, match="id 3 was already added"):
        engine.run([Request([1, 2], 2, id=3), Request([3, 4], 2, id=3)])
    assert not engine.unfinished
    (out,) = engine.run([Request(list(GOOD), 2, id=3)])
    assert out.tokens == greedy(GOOD, 2)


def test_a_benchmark_refuses_to_report_a_run_with_failed_requests(monkeypatch):
    from minillm.bench.serving import served

    engine = make_engine()
    monkeypatch.setattr(engine, "_forward_split", lambda work: (_ for _ in ()).throw(RuntimeError("boom")))
    outputs = engine.run([Request([1, 2], 2)])
    with pytest.raises(ValueError, match="1 request\\(s\\) failed.*boom"):
        served(outputs)
