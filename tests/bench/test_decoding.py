"""bench.decoding's pieces: the options dataclass, the timed methods and the forward costs by width."""

import pytest

from minillm.bench.decoding import DecodingBench, measure_forward_ms, time_methods, tokens_and_stats
from minillm.decoding.prompt_lookup import prompt_lookup_generate
from tests.conftest import tiny_model
from tests.decoding.test_speculative import random_prompt


def test_decoding_bench_defaults_are_valid():
    options = DecodingBench()
    assert (options.prompts, options.k, options.device) == (4, 4, "cpu")


@pytest.mark.parametrize("field", ["prompts", "prompt_len", "new_tokens", "repeats", "k"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_decoding_bench_names_the_bad_field_and_its_option(field, value):
    option = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{field} \\({option}\\)"):
        DecodingBench(**{field: value})


@pytest.mark.parametrize("field", ["target", "draft", "device"])
def test_decoding_bench_needs_names(field):
    with pytest.raises(ValueError, match=field):
        DecodingBench(**{field: ""})


def test_time_methods_keeps_every_round_and_the_first_round_s_tokens():
    model = tiny_model()
    prompts = [random_prompt(6, s) for s in range(2)]
    methods = {"lookup": lambda p: tokens_and_stats(prompt_lookup_generate(model, p, 5, k=2, eos_token_id=None))}
    timed = time_methods(methods, prompts, repeats=3, device="cpu")
    assert len(timed["lookup"]["seconds"]) == 3 and all(s > 0 for s in timed["lookup"]["seconds"])
    assert [len(t) for t in timed["lookup"]["tokens"]] == [5, 5]
    assert [s.new_tokens for s in timed["lookup"]["stats"]] == [5, 5]


def test_measure_forward_ms_statistics():
    model = tiny_model()
    fastest = measure_forward_ms(model, sizes=(1, 3), prefix=4, repeats=3)
    median = measure_forward_ms(model, sizes=(1, 3), prefix=4, repeats=3, statistic="median")
    assert set(fastest) == set(median) == {1, 3} and all(ms > 0 for ms in [*fastest.values(), *median.values()])
    with pytest.raises(ValueError, match="statistic"):
        measure_forward_ms(model, sizes=(1,), statistic="mean")
