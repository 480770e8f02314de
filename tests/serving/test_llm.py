"""LLM: offline batch generation on the engine, loaded through the runtime. Completions come back
in the prompts' order and equal minillm.generate's tokens for each prompt alone."""

import pytest

import minillm
from minillm import SamplingParams
from minillm.serving import LLM, Completion

PROMPTS = ["def read_config(path):", "class Stack:", "import os\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("minillm-draft", device="cpu", max_batch=2, num_blocks=64)


def test_greedy_completions_equal_generate_in_prompt_order(llm):
    outs = llm.generate(PROMPTS, max_tokens=12)
    assert [o.prompt for o in outs] == PROMPTS and all(isinstance(o, Completion) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        alone = minillm.generate(llm.model, llm.tokenizer.encode(prompt), 12)
        assert out.token_ids == alone.tokens[0].tolist()[: alone.lengths[0]]
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.finish_reason in ("length", "stop")


def test_token_id_prompts_and_seeded_sampling(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    first, again = llm.generate([ids, ids], sampling, max_tokens=10)
    assert first.token_ids == again.token_ids and first.prompt == ids  # one seed per request


def test_bad_prompts_are_refused_with_a_reason(llm):
    with pytest.raises(ValueError, match="list of prompts"):
        llm.generate("def f():")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        llm.generate(PROMPTS, max_tokens=0)


def test_the_runtime_options_apply(llm):
    quantized = LLM("minillm-draft", device="cpu", quantize="int8")
    assert quantized.model.dtype.is_floating_point and quantized.generate(PROMPTS[:1], max_tokens=4)[0].token_ids
    with pytest.raises(ValueError, match="applies to int4"):
        LLM("minillm-draft", quantize="int8", group_size=32)
