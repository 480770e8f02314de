"""``measure.profile.profile_breakdown``: where a decoding loop's time goes, by minillm function."""

from minillm.decoding.speculative import speculative_generate
from minillm.measure.profile import profile_breakdown

from ..conftest import tiny_model


def test_breakdown_finds_the_forwards_and_the_bookkeeping():
    target, draft = tiny_model(seed=0), tiny_model(seed=1, n_layers=1)
    rows = profile_breakdown(lambda: speculative_generate(target, draft, [3, 1, 4, 1, 5], 16, k=3), top=20)
    names = [r["function"] for r in rows]
    assert any(n.endswith(" __call__") and n.startswith("compiled.py") for n in names)  # the forwards
    assert any(n.endswith(" propose") for n in names) and any(n.endswith(" greedy_accept") for n in names)
    assert not any(n.startswith("model.py") for n in names)  # a forward is one item
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    for r in rows:
        assert r["calls"] >= 1 and 0 < r["share"] < 1
        assert abs(r["per_call_ms"] * r["calls"] - r["total_ms"]) < 1e-6 * max(1.0, r["total_ms"])
