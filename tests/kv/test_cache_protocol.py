"""Every cache kind the model takes follows the one ``Cache`` protocol of ``minillm.core.cache``:
the model and ``generate`` read its attributes directly, never with a fallback."""

import pytest
import torch

from minillm import KVCache
from minillm.core.cache import Cache
from minillm.core.compiled import CompiledForward, StaticCache
from minillm.kv.compressed import CrossLayerKVCache, QuantizedKVCache, SelectiveKVCache, SlidingWindowCache
from minillm.kv.paged import KVPool, PagedKVBatch
from tests.conftest import tiny_model

MODEL = tiny_model()
KINDS = {
    "contiguous": lambda: KVCache.for_model(MODEL, 2, 16),
    "cross-layer": lambda: CrossLayerKVCache.for_model(MODEL, 2, 16, group=2),
    "int8": lambda: QuantizedKVCache.for_model(MODEL, 2, 16),
    "sliding window": lambda: SlidingWindowCache.for_model(MODEL, 2, 4),
    "sinks + recent": lambda: SelectiveKVCache.for_model(MODEL, 2, 8, policy="recent"),
    "heavy hitters": lambda: SelectiveKVCache.for_model(MODEL, 2, 8, policy="heavy"),
    "static": lambda: StaticCache(MODEL.config, 2, 16, torch.float32, device="cpu").view,
    "paged": lambda: PagedKVBatch(KVPool.for_model(MODEL, 8, 4), [[0, 1], [2, 3]]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_kind_satisfies_the_protocol(kind):
    cache = KINDS[kind]()
    assert isinstance(cache, Cache)
    assert isinstance(cache.length, int) and isinstance(cache.in_order, bool)
    assert cache.window is None or isinstance(cache.window, int)
    assert isinstance(cache.wants_attention, bool) and cache.batch_size == 2
    for method in ("reserve", "update", "truncate", "record_attention"):
        assert callable(getattr(cache, method)), method


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_kind_runs_a_forward_and_a_decode_step(kind):
    cache = KINDS[kind]()
    x = torch.randint(0, 97, (2, 5))
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        MODEL(x, positions, cache)
        MODEL(x[:, :1], torch.full((2, 1), 5), cache)


def test_only_heavy_hitters_want_the_attention_and_only_the_window_limits_it():
    made = {kind: make() for kind, make in KINDS.items()}
    assert [k for k, c in made.items() if c.wants_attention] == ["heavy hitters"]
    assert {k: c.window for k, c in made.items() if c.window is not None} == {"sliding window": 4}
    assert [k for k, c in made.items() if c.in_order] == ["contiguous", "cross-layer", "int8"]


def test_an_object_missing_part_of_the_protocol_is_not_a_cache():
    class Partial:
        length, in_order, window = 0, True, None

        def reserve(self, positions): ...
        def update(self, layer, k, v): ...

    assert not isinstance(Partial(), Cache)


def test_the_static_cache_rolls_back_by_masking_slots_and_its_view_refuses_to():
    fwd = CompiledForward(MODEL, 2, 16, widths=())  # eager over the static cache: nothing compiled
    with torch.no_grad():
        fwd(torch.randint(0, 97, (2, 6)))
    fwd.truncate(4)
    assert fwd.cache.positions[0, :6].tolist() == [0, 1, 2, 3, -1, -1] and fwd.length == 4
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="cannot truncate a cache of length 4"):
            fwd.truncate(bad)
    with pytest.raises(RuntimeError, match="through the StaticCache"):
        fwd.cache.view.truncate(2)
