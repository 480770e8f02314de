"""DTensor tensor parallelism: a sharded model gives the single-process logits and greedy tokens,
through plain ``generate``, with two all-reduces per layer per decode step."""

import pytest
import torch

import minillm
from minillm.parallel.dtensor import DTensorCheck, gate_up_rows_for_tp, qkv_rows_for_tp, run_dtensor_checks
from tests.conftest import tiny_config, tiny_model

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

PROMPT = (3, 14, 15, 9, 26, 5, 35)
NEW_TOKENS = 32

# name -> (world size, config overrides, vocab_parallel); one launch per world size runs them all.
CASES = {
    "mha-vocab-parallel": (2, dict(n_heads=4, n_kv_heads=4), True),
    "mqa-tied": (2, dict(n_heads=4, n_kv_heads=1, tie_embeddings=True), False),
    "gqa-fewer-kv-than-ranks-tied-vocab-parallel": (4, dict(n_heads=8, n_kv_heads=2, tie_embeddings=True), True),
}
BUNDLED = {"minillm-target": (2, "minillm-target", False)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for seed, (name, (_, overrides, _)) in enumerate(CASES.items()):
        model = tiny_model(seed=seed, vocab_size=96, **overrides)  # 96 words: splits over 2 and 4 ranks
        dirs[name] = str(minillm.save_pretrained(model, tmp_path_factory.mktemp(name)))
    dirs.update({name: model for name, (_, model, _) in BUNDLED.items()})
    return dirs


def _specs(model_dirs, world):
    cases = {**CASES, **BUNDLED}
    return {
        name: DTensorCheck(model_dirs[name], PROMPT, NEW_TOKENS, vocab_parallel)
        for name, (w, _, vocab_parallel) in cases.items()
        if w == world
    }


@pytest.fixture(scope="module")
def runs(model_dirs):
    """{name: (spec, per-rank results)}, one launch per world size."""
    out = {}
    for world in (2, 4):
        specs = _specs(model_dirs, world)
        per_rank = run_dtensor_checks(tuple(specs.values()), world, timeout=60.0)
        for i, (name, spec) in enumerate(specs.items()):
            out[name] = (spec, [rank_results[i] for rank_results in per_rank])
    return out


def _reference(spec):
    model, _ = minillm.load(spec.model, device="cpu", dtype=torch.float32)
    prompt = torch.tensor([spec.prompt_ids])
    with torch.inference_mode():
        logits = model(prompt)[0]  # (T, vocab)
    tokens = minillm.generate(model, prompt, spec.max_new_tokens, eos_token_id=None).tokens[0].tolist()
    return model.config, logits, tokens


@pytest.mark.parametrize("name", [*CASES, *BUNDLED])
def test_dtensor_matches_single_process(runs, name):
    spec, results = runs[name]
    config, logits, tokens = _reference(spec)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.from_numpy(result.prefill_logits), logits, atol=1e-5, rtol=1e-5)
        assert list(result.tokens) == tokens, f"rank {rank}"
        expected = {"all_reduce": 2 * config.n_layers}
        if spec.vocab_parallel:
            expected["all_gather_into_tensor"] = 1
        assert result.decode_comm_counts == expected, f"rank {rank}"
        assert result.decode_total_comms == sum(expected.values())


def test_stacked_rows_give_each_rank_its_heads():
    config = tiny_config(n_heads=8, n_kv_heads=2, head_dim=4)  # q rows 0..31, k 32..39, v 40..47
    rows = qkv_rows_for_tp(config, 4).view(4, -1)  # one chunk per rank: 2 q heads, 1 k head, 1 v head
    assert rows.shape == (4, (2 + 1 + 1) * 4)  # 64 rows > the original 48: K/V heads copied
    assert rows[1].tolist() == [*range(8, 16), *range(32, 36), *range(40, 44)]
    assert rows[2].tolist() == [*range(16, 24), *range(36, 40), *range(44, 48)]
    gate_up = gate_up_rows_for_tp(config, 2).view(2, -1)
    f = config.ffn_dim
    assert gate_up[1].tolist() == [*range(f // 2, f), *range(f + f // 2, 2 * f)]


def test_impossible_split_raises_before_launch(tmp_path):
    directory = str(minillm.save_pretrained(tiny_model(n_heads=6, n_kv_heads=6, head_dim=4, ffn_dim=96), tmp_path))
    with pytest.raises(ValueError, match="query heads"):
        run_dtensor_checks((DTensorCheck(directory, PROMPT),), 4)
    with pytest.raises(ValueError, match="vocabulary"):
        run_dtensor_checks((DTensorCheck(directory, PROMPT, vocab_parallel=True),), 3)  # 97 words, 6 heads


def test_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="max_new_tokens"):
        DTensorCheck("minillm-target", PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        DTensorCheck("minillm-target", ())
