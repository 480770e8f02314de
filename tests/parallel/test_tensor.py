"""Hand-written tensor parallelism: the sharded model gives the single-process logits and greedy
tokens, each rank holds only its slices, and every byte it all-reduces is the formula's."""

import time

import pytest
import torch
import torch.distributed as dist

import minillm
from minillm.parallel.launch import RankError, launch
from minillm.parallel.predict import tp_all_reduces_per_forward, tp_decode_bytes
from minillm.parallel.tensor import (
    TPCheck,
    check_tensor_parallel,
    kv_heads,
    local_config,
    query_heads,
    run_tp_checks,
)
from tests.conftest import tiny_config, tiny_model

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

PROMPT = (3, 14, 15, 9, 26, 5, 35)
NEW_TOKENS = 32

# name -> (world size, config overrides, vocab_parallel); one launch per world size runs them all.
CASES = {
    "mha": (2, dict(n_heads=4, n_kv_heads=4), False),
    "mqa-tied-vocab-parallel": (2, dict(n_heads=4, n_kv_heads=1, tie_embeddings=True), True),
    "gqa-fewer-kv-than-ranks": (4, dict(n_heads=8, n_kv_heads=2, qkv_bias=True, o_bias=True), False),
    "mha-tied-vocab-parallel": (4, dict(n_heads=4, n_kv_heads=4, tie_embeddings=True, mlp_bias=True), True),
}
BUNDLED = {"minillm-target": (2, "minillm-target", True)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for seed, (name, (_, overrides, _)) in enumerate(CASES.items()):
        model = tiny_model(seed=seed, vocab_size=96, **overrides)  # 96 words: splits over 2 and 4 ranks
        with torch.no_grad():  # biases are zero after init; make them count
            for p_name, p in model.named_parameters():
                if p_name.endswith("bias"):
                    p.normal_(0, 0.1)
        dirs[name] = str(minillm.save_pretrained(model, tmp_path_factory.mktemp(name)))
    dirs.update({name: model for name, (_, model, _) in BUNDLED.items()})
    return dirs


@pytest.fixture(scope="module")
def runs(model_dirs):
    """{name: (spec, per-rank results)}, one launch per world size."""
    out = {}
    cases = {**CASES, **BUNDLED}
    for world in (2, 4):
        names = [n for n, (w, _, _) in cases.items() if w == world]
        specs = tuple(TPCheck(model_dirs[n], PROMPT, NEW_TOKENS, cases[n][2]) for n in names)
        per_rank = run_tp_checks(specs, world, timeout=60.0)
        for i, (name, spec) in enumerate(zip(names, specs)):
            out[name] = (spec, world, [rank_results[i] for rank_results in per_rank])
    return out


def _reference(spec):
    model, _ = minillm.load(spec.model, device="cpu", dtype=torch.float32)
    prompt = torch.tensor([spec.prompt_ids])
    with torch.inference_mode():
        logits = model(prompt)[0]
    tokens = minillm.generate(model, prompt, spec.max_new_tokens, eos_token_id=None).tokens[0].tolist()
    return model, logits, tokens


ALL = [*CASES, *BUNDLED]


@pytest.mark.parametrize("name", ALL)
def test_sharded_model_matches_single_process(runs, name):
    spec, _, results = runs[name]
    _, logits, tokens = _reference(spec)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result.prefill_logits, logits, atol=1e-5, rtol=1e-5)
        assert result.tokens == tokens, f"rank {rank}"


@pytest.mark.parametrize("name", ALL)
def test_counted_bytes_equal_the_formula(runs, name):
    spec, world, results = runs[name]
    config = spec.config()
    T, N, vp = len(spec.prompt_ids), spec.max_new_tokens, spec.vocab_parallel
    layers = tp_all_reduces_per_forward(config)
    for result in results:
        step = {"all_reduce": {"calls": layers, "bytes": 2 * config.n_layers * config.dim * 4}}
        if vp:
            step["all_gather"] = {"calls": 1, "bytes": config.vocab_size * 4}
        assert result.decode_step_counts == step
        assert sum(c["bytes"] for c in result.decode_step_counts.values()) == tp_decode_bytes(config, 1, 4, world, vp)
        prefill = sum(c["bytes"] for c in result.prefill_counts.values())
        assert prefill == tp_decode_bytes(config, T, 4, world, vp)  # every position scored
        # generate: a prefill scoring its last position only, then N - 1 one-token steps
        whole = sum(c["bytes"] for c in result.generate_counts.values())
        assert whole == tp_decode_bytes(config, T, 4, world, vp, head_tokens=1) + (N - 1) * tp_decode_bytes(
            config, 1, 4, world, vp
        )
        assert result.generate_counts["all_reduce"]["calls"] == N * layers


@pytest.mark.parametrize("name", ALL)
def test_each_rank_holds_its_share(runs, name):
    spec, world, results = runs[name]
    model, _, _ = _reference(spec)
    config = model.config
    full = model.num_params()
    hd = config.head_dim
    replicated = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2) + config.dim * (
        2 * config.n_layers + 1
    )
    if spec.vocab_parallel:  # the head's vocabulary is split (and untied: its own 1/N slice)
        replicated = config.vocab_size * config.dim + config.dim * (2 * config.n_layers + 1)
        replicated += config.vocab_size // world * config.dim
    local = local_config(config, world)
    per_layer = (
        config.dim * hd * (local.n_heads + 2 * local.n_kv_heads)
        + local.n_heads * hd * config.dim
        + 3 * config.dim * local.ffn_dim
    )
    biases = (
        (hd * (local.n_heads + 2 * local.n_kv_heads) if config.qkv_bias else 0)
        + (config.dim if config.o_bias else 0)
        + (2 * local.ffn_dim + config.dim if config.mlp_bias else 0)
    )
    for result in results:
        assert result.local_params == replicated + config.n_layers * (per_layer + biases)
        assert result.local_params < full


def test_heads_of_each_rank():
    config = tiny_config(n_heads=8, n_kv_heads=2)
    assert [list(query_heads(config, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads(config, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    assert [list(kv_heads(config, 2, r)) for r in range(2)] == [[0], [1]]
    assert local_config(config, 4).n_kv_heads == 1 and local_config(config, 4).ffn_dim == 16


@pytest.mark.parametrize(
    "overrides, tp, vocab_parallel, message",
    [
        (dict(n_heads=6, n_kv_heads=6, head_dim=8), 4, False, "6 query heads cannot be split over 4"),
        (dict(n_heads=8, n_kv_heads=4), 16, False, "8 query heads cannot be split over 16"),
        (dict(n_heads=4, n_kv_heads=2, ffn_dim=66), 4, False, "ffn_dim 66"),
        (dict(n_heads=4, n_kv_heads=4), 2, True, "vocabulary of 97"),
        (dict(n_heads=12, n_kv_heads=3, head_dim=8), 4, False, "cannot be replicated evenly"),
        (dict(), 0, False, "positive integer"),
        (dict(), True, False, "positive integer"),
    ],
)
def test_impossible_split_is_a_clear_error_before_any_process(overrides, tp, vocab_parallel, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(tiny_config(**overrides), tp, vocab_parallel)


def test_run_checks_refuses_an_impossible_split_before_spawning(model_dirs):
    spec = TPCheck(model_dirs["mha"], PROMPT)  # 4 heads
    start = time.monotonic()
    with pytest.raises(ValueError, match="4 query heads cannot be split over 3"):
        run_tp_checks((spec,), 3)
    assert time.monotonic() - start < 2.0  # no process was started


def raise_on_rank_one(rank, world):
    """Rank 1 fails; rank 0 waits in an all-reduce for a partner that never comes."""
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.all_reduce(torch.ones(4))


def test_a_failing_rank_stops_every_rank_within_the_bound():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed(.|\n)*rank one fails on purpose"):
        launch(raise_on_rank_one, 2, timeout=30.0)
    assert time.monotonic() - start < 30.0
