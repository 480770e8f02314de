"""Pipeline parallelism: one launch per world size runs every case; the tests compare its data
with the single-process model and with the formulas."""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm import ModelConfig, Transformer
from minillm.core.checkpoints import read_config, resolve
from minillm.parallel.pipeline import (
    PipelineSpec,
    bubble_fraction,
    check_pipeline,
    measured_bubble,
    pipeline_bytes,
    run_pipeline,
)
from minillm.parallel.stage import Stage, StageKVCache, split_layers

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

NEW_TOKENS = 32


def small_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=128)
    return ModelConfig(**{**base, "eos_token_id": None, **overrides})


MODELS = {
    "mha": small_config(name="mha"),
    "gqa": small_config(name="gqa", n_kv_heads=2, n_layers=5),
    "tied": small_config(name="tied", tie_embeddings=True, n_kv_heads=1),
}
RAGGED = ((5, 7, 9, 11, 13, 2, 3), (17, 4), (8, 8, 8, 8, 8), (1, 2, 3, 4, 5, 6, 7, 8, 9), (30, 31, 32))
EQUAL = ((5, 7, 9, 11), (17, 4, 6, 1), (8, 8, 8, 8), (90, 2, 3, 4))
# (model, prompts, micro-batches): ragged and equal-length prompts, even and uneven micro-batches
CASES = {
    2: [("mha", RAGGED, 2), ("gqa", EQUAL, 4), ("tied", RAGGED, 3), ("minillm-target", EQUAL, 2)],
    4: [("mha", EQUAL, 4), ("gqa", RAGGED, 5), ("tied", EQUAL, 1), ("minillm-target", RAGGED, 4)],
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {"minillm-target": "minillm-target"}
    for i, (name, config) in enumerate(MODELS.items()):
        model = Transformer(config).init_weights(seed=i, std=0.2).eval()  # peaked logits: no near ties
        dirs[name] = str(minillm.save_pretrained(model, tmp_path_factory.mktemp(name)))
    return dirs


def specs_for(world: int, model_dirs) -> list[PipelineSpec]:
    return [PipelineSpec(model_dirs[m], p, NEW_TOKENS, mb) for m, p, mb in CASES[world]]


@pytest.fixture(scope="module", params=[2, 4])
def runs(request, model_dirs):
    world = request.param
    specs = specs_for(world, model_dirs)
    return world, specs, run_pipeline(specs, world, timeout=60.0)


def reference(spec: PipelineSpec):
    model, _ = minillm.load(spec.model_dir, device="cpu", dtype=torch.float32)
    prompts = [list(p) for p in spec.prompts]
    result = minillm.generate(model, prompts, NEW_TOKENS, eos_token_id=None)
    ids, positions = minillm.core.generate.left_pad(prompts, 0, "cpu")
    padded = any(len(p) != ids.shape[1] for p in prompts)
    with torch.inference_mode():
        logits = model(ids, positions if padded else None, last_only=True)[:, -1]
    return model.config, result.tokens.tolist(), logits


def test_split_layers_is_consecutive_and_balanced():
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(5, 1) == [range(0, 5)]


@pytest.mark.parametrize("stages", [0, -1, 5, True, 2.0])
def test_impossible_split_is_a_value_error_before_any_process(stages, model_dirs):
    config = MODELS["mha"]  # 4 layers
    with pytest.raises(ValueError, match="stages"):
        check_pipeline(config, stages)
    with pytest.raises(ValueError, match="stage"):  # raised by the checks, before launch spawns anything
        run_pipeline(PipelineSpec(model_dirs["mha"], EQUAL, 4), stages)


def test_bad_spec_is_a_value_error():
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineSpec("minillm-target", EQUAL, 4, micro_batches=5)
    with pytest.raises(ValueError, match="dtype"):
        PipelineSpec("minillm-target", EQUAL, 4, dtype="float8")
    with pytest.raises(ValueError, match="max_new_tokens"):
        PipelineSpec("minillm-target", EQUAL, 0)


def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == 3 / 4
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


def test_stage_reads_only_its_layers_and_caches_only_them(model_dirs):
    stage = Stage.from_checkpoint(model_dirs["tied"], 1, 2)
    assert stage.layer_ids == range(2, 4) and stage.embed_tokens is None and stage.lm_head is None
    names = {n for n, _ in stage.named_parameters()}
    read = {n for sources in stage.checkpoint_names().values() for n in sources}
    assert {n.split(".")[1] for n in read if n.startswith("layers.")} == {"2", "3"}
    assert {n for n in read if not n.startswith("layers.")} == {"norm.weight"}  # + embed_tokens as the tied head
    assert len(read) == 2 * 9 + 1  # q, k, v, o, gate, up, down and two norms per layer, read apart
    assert not any(n.startswith(("layers.2.", "layers.3.")) for n in names)  # local names 0..1
    cache = stage.new_cache(3, 10)
    assert isinstance(cache, StageKVCache) and cache.k.shape[0] == 2
    config = MODELS["tied"]
    assert cache.nbytes == 2 * 2 * 3 * config.n_kv_heads * 10 * config.head_dim * 4


def test_prefill_logits_and_greedy_tokens_equal_the_single_process_model(runs):
    world, specs, results = runs
    for spec, ranks in zip(specs, results):
        _, tokens, logits = reference(spec)
        last = ranks[-1]
        assert all(r.tokens is None and r.logits is None for r in ranks[:-1])
        torch.testing.assert_close(last.logits, logits, atol=1e-5, rtol=1e-5)
        assert last.tokens == tokens, spec.model_dir
        assert [r.layers for r in ranks] == split_layers(read_config(resolve(spec.model_dir))[0].n_layers, world)


def test_counted_bytes_equal_the_formula(runs):
    world, specs, results = runs
    for spec, ranks in zip(specs, results):
        config, _ = read_config(resolve(spec.model_dir))
        want = pipeline_bytes(config, len(spec.prompts), spec.prompt_len, NEW_TOKENS, spec.micro_batches, world)
        sent = [r.counts.get("send", {"bytes": 0, "calls": 0}) for r in ranks]
        received = [r.counts.get("recv", {"bytes": 0, "calls": 0}) for r in ranks]
        assert [s["bytes"] for s in sent] == want["per_rank_send"]
        assert [s["calls"] for s in sent] == want["per_rank_send_calls"]
        assert sum(s["bytes"] for s in sent) == sum(r["bytes"] for r in received) == want["total"]
        assert set().union(*(r.counts for r in ranks)) <= {"send", "recv"}  # nothing else moved
        # stage s receives what stage s - 1 sent; the first receives the tokens
        assert [r["bytes"] for r in received] == [want["token_bytes"], *want["per_rank_send"][:-1]]


def test_measured_bubble_is_returned_and_sane(runs):
    world, specs, results = runs
    for spec, ranks in zip(specs, results):
        timelines = [r.timeline for r in ranks]
        assert all(len(tl) == spec.micro_batches * NEW_TOKENS for tl in timelines)
        for tl in timelines:
            assert all(iv.end >= iv.start >= 0 for iv in tl)
        for phase, step in (("prefill", 0), ("decode", 1), ("decode", NEW_TOKENS - 1)):
            bubble = measured_bubble(timelines, phase, step)
            assert 0 < bubble["mean"] < 1 and all(0 <= b < 1 for b in bubble["per_stage"])
        assert 0 < bubble_fraction(world, spec.micro_batches) < 1
