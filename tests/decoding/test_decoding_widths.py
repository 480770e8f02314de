"""decoding_bench's chapter-9 helpers: how wide each method's forwards are, and the cost model."""

import pytest

from minillm.bench.decoding import forward_widths
from minillm.decoding.common import cost_at, modeled_speedup
from minillm.decoding.lookahead import LookaheadConfig, lookahead_generate
from minillm.decoding.medusa import MedusaOptions, MedusaTree, medusa_generate
from tests.conftest import tiny_model
from tests.decoding.test_medusa import random_heads
from tests.decoding.test_speculative import random_prompt

COSTS = {1: 2.0, 4: 3.0, 16: 5.0}


def test_cost_at_interpolates_between_measured_widths():
    assert cost_at(COSTS, 1) == 2.0 and cost_at(COSTS, 16) == 5.0
    assert cost_at(COSTS, 2.5) == pytest.approx(2.5)
    assert cost_at(COSTS, 10) == pytest.approx(4.0)
    assert cost_at(COSTS, 32) == pytest.approx(10.0)  # past the last width: proportional
    assert cost_at({"1": 2.0, "4": 3.0}, 4) == 3.0  # keys as saved in JSON


def test_modeled_speedup():
    assert modeled_speedup(1.0, 1, COSTS) == 1.0
    assert modeled_speedup(2.5, 4, COSTS) == pytest.approx(2.5 * 2 / 3)
    assert modeled_speedup(2.0, 4, COSTS, draft_forwards=3, draft_ms={1: 0.5}) == pytest.approx(4 / 4.5)
    assert modeled_speedup(3.0, 16, {1: 1.0, 16: 1.0}) == 3.0  # wide forwards free: tokens per forward


def test_forward_widths_of_medusa_and_lookahead():
    model, heads = tiny_model(), random_heads()
    prompts = [random_prompt(5, s) for s in range(2)]
    tree = MedusaTree.product((2, 2))
    method = lambda p: medusa_generate(model, heads, p, 12, MedusaOptions(tree), eos_token_id=None)
    widths = forward_widths({"target": model}, method, prompts)
    assert set(widths["target"]) == {len(tree)}
    widths = forward_widths({"target": model}, lambda p: lookahead_generate(model, p, 12, eos_token_id=None), prompts)
    base = 1 + LookaheadConfig().levels * LookaheadConfig().window
    assert all(w >= base and (w - base) % 3 == 0 for w in widths["target"])
    assert not model._forward_pre_hooks  # the hooks are removed
