"""The fixed-shape decode step over the paged KV cache (``serving.compiled_step``): eagerly and
compiled, its logits and the K/V it writes equal the engine's eager ``PagedKVBatch`` forward on
ragged batches (padding rows touch the scratch block alone), and a greedy loop through it gives
``generate``'s tokens, for a quantized model too. Compiling takes seconds per graph on a CPU:
the compiled tests share one step and compile the few graphs they use."""

from __future__ import annotations

import pytest
import torch

from minillm import generate
from minillm.compression import quantize
from minillm.core.cache import CacheFullError
from minillm.kv.paged import KVPool, PagedKVBatch
from minillm.serving.compiled_step import PagedDecodeStep, powers_of_two, read_widths
from tests.conftest import tiny_model

BLOCK = 8
NUM_BLOCKS = 24
SCRATCH = NUM_BLOCKS - 1  # the engine's extra block, never in a table
MODEL = tiny_model(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def ragged_batch(model, pool: KVPool):
    """Three sequences of 13, 21 and 35 tokens, all but the last token cached by eager prefills;
    the last two share their first two blocks (a common prefix, the prefix cache's doing)."""
    seqs = prompts([13, 21, 35])
    seqs[2][: 2 * BLOCK] = seqs[1][: 2 * BLOCK]
    tables = [[0, 1], [2, 3, 4], [2, 3, 5, 6, 7]]
    with torch.inference_mode():
        model(torch.tensor([seqs[1][:-1]]), None, PagedKVBatch(pool, [tables[1]]))
        model(torch.tensor([seqs[0][:-1]]), None, PagedKVBatch(pool, [tables[0]]))
        n = len(seqs[2]) - 1  # the shared prefix is cached already: write from block 2 on
        ids, pos = torch.tensor([seqs[2][2 * BLOCK : n]]), torch.arange(2 * BLOCK, n)[None]
        model(ids, pos, PagedKVBatch(pool, [tables[2]]))
    return [s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables


def eager_reference(model, pool: KVPool, tokens, positions, tables):
    """The engine's eager step (``Engine._forward``) on a copy of the pool: logits, K and V after."""
    ref = KVPool.for_model(model, pool.k.shape[1], BLOCK)
    ref.k.copy_(pool.k)
    ref.v.copy_(pool.v)
    with torch.inference_mode():
        ids, pos = torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None]
        logits = model(ids, pos, PagedKVBatch(ref, tables), last_only=True)[:, -1]
    return logits, ref.k, ref.v


def check_step_matches_eager(step: PagedDecodeStep, pool: KVPool, model=MODEL, atol: float = 1e-5) -> None:
    pool.k.zero_()
    pool.v.zero_()
    tokens, positions, tables = ragged_batch(model, pool)  # B = 3: a bucket of 4 with one padding row
    want, want_k, want_v = eager_reference(model, pool, tokens, positions, tables)
    got = step(tokens, positions, tables)
    assert got.shape == want.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    scratch = step.scratch_block  # every other block holds what the eager forward wrote there
    real = [b for b in range(pool.k.shape[1]) if b != scratch]
    torch.testing.assert_close(pool.k[:, real], want_k[:, real], atol=atol, rtol=1e-4)
    torch.testing.assert_close(pool.v[:, real], want_v[:, real], atol=atol, rtol=1e-4)
    assert pool.k[:, scratch].abs().sum() > 0  # the padding row wrote there


def paged_batch_step(model, pool: KVPool):
    """The engine's eager decode step, with the same call as a ``PagedDecodeStep``."""

    def step(tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        ids, pos = torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None]
        with torch.inference_mode():
            return model(ids, pos, PagedKVBatch(pool, tables), last_only=True)[:, -1]

    return step


def greedy_through_step(model, step, pool: KVPool, lengths: list[int], n: int) -> list[list[int]]:
    """Prefill each prompt eagerly into its own blocks, then decode ``n`` tokens for all of them
    together through ``step`` (the first from the prefill's logits)."""
    seqs, tables, first = prompts(lengths, seed=1), [], []
    per_seq = (max(lengths) + n) // BLOCK + 1
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            tables.append(list(range(i * per_seq, (i + 1) * per_seq)))
            logits = model(torch.tensor([s]), None, PagedKVBatch(pool, [tables[-1]]), last_only=True)
            first.append(int(logits[0, -1].argmax()))
    out = [[t] for t in first]
    for _ in range(n - 1):
        positions = [len(s) + len(o) - 1 for s, o in zip(seqs, out)]
        logits = step([o[-1] for o in out], positions, tables)
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


def alone(model, lengths: list[int], n: int) -> list[list[int]]:
    return [generate(model, p, n, eos_token_id=None).tokens[0].tolist() for p in prompts(lengths, seed=1)]


def test_buckets_and_widths():
    assert powers_of_two(8) == (1, 2, 4, 8) and powers_of_two(6) == (1, 2, 4, 6) and powers_of_two(1) == (1,)
    assert read_widths(64, 16) == (4, 8, 16, 32, 64)  # from 64 tokens up
    assert read_widths(2, 64) == (1, 2)
    pool = KVPool.for_model(MODEL, NUM_BLOCKS, BLOCK)
    step = PagedDecodeStep(MODEL, pool, 6, SCRATCH, compile=False)
    assert step.attention == "gather"  # a CPU model, eagerly: SDPA (compiled: the fused reference)
    assert step.buckets == (1, 2, 4, 6) and step.block_buckets == (8, 16) and step.graphs == 8
    assert [step.bucket(b) for b in (1, 3, 5, 6)] == [1, 4, 6, 6]
    assert step.warmup() == 0.0  # nothing to compile


def test_bad_calls_are_refused():
    pool = KVPool.for_model(MODEL, NUM_BLOCKS, BLOCK)
    with pytest.raises(ValueError, match="scratch_block"):
        PagedDecodeStep(MODEL, pool, 4, NUM_BLOCKS, compile=False)
    with pytest.raises(ValueError, match="reach"):
        PagedDecodeStep(MODEL, pool, 4, SCRATCH, compile=False, block_buckets=(2, 4))
    step = PagedDecodeStep(MODEL, pool, 2, SCRATCH, compile=False)
    with pytest.raises(ValueError, match="rows"):
        step([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(CacheFullError):
        step([1], [BLOCK], [[0]])  # position 8 needs a second block
    with pytest.raises(ValueError, match="positions"):
        step([1], [128], [list(range(16))])


@pytest.mark.parametrize("attention", ["gather", "reference"])
def test_eager_step_matches_paged_batch(attention):
    """compile=False: the same fixed-shape code, eagerly; "reference" is the attend hook."""
    pool = KVPool.for_model(MODEL, NUM_BLOCKS, BLOCK)
    check_step_matches_eager(PagedDecodeStep(MODEL, pool, 4, SCRATCH, compile=False, attention=attention), pool)


def test_eager_step_matches_paged_batch_bf16():
    model = tiny_model(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128).to(torch.bfloat16)
    pool = KVPool.for_model(model, NUM_BLOCKS, BLOCK)
    check_step_matches_eager(PagedDecodeStep(model, pool, 4, SCRATCH, compile=False), pool, model, atol=0.1)


def test_sliding_window_model_gathers_and_is_masked_by_its_window():
    model = tiny_model(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128, sliding_window=12)
    pool = KVPool.for_model(model, NUM_BLOCKS, BLOCK)
    assert PagedDecodeStep(model, pool, 4, SCRATCH, compile=True).attention == "gather"  # nothing compiles yet
    with pytest.raises(ValueError, match="sliding window"):
        PagedDecodeStep(model, pool, 4, SCRATCH, compile=False, attention="reference")
    check_step_matches_eager(PagedDecodeStep(model, pool, 4, SCRATCH, compile=False), pool, model)  # contexts > 12


def test_triton_hook_matches_gather():
    """The Triton paged-decode kernel through the attend hook (its CPU interpreter here, fp32)."""
    pytest.importorskip("triton")
    from minillm.kernels.flash_attention import check_interpreter, interpreting

    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is not set and there is no GPU")
    try:
        check_interpreter()
    except RuntimeError as e:
        pytest.skip(str(e))
    pool = KVPool.for_model(MODEL, NUM_BLOCKS, BLOCK)
    step = PagedDecodeStep(MODEL, pool, 4, SCRATCH, compile=False, attention="triton")
    assert step.block_buckets == (16,)  # the kernel reads each row to its length: one width
    check_step_matches_eager(step, pool)


def test_eager_step_greedy_equals_generate():
    pool = KVPool.for_model(MODEL, 40, BLOCK)
    step = PagedDecodeStep(MODEL, pool, 4, 39, compile=False)
    lengths = [5, 17, 30]
    assert greedy_through_step(MODEL, step, pool, lengths, 12) == alone(MODEL, lengths, 12)


# -- compiled ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled():
    """One compiled step for the tests below: they share its graphs (bucket 4, widths 8 and 16).
    Its attention is the CPU's default, "reference"; the int8 test's is "gather"."""
    pool = KVPool.for_model(MODEL, 40, BLOCK)
    return PagedDecodeStep(MODEL, pool, 4, 39, compile=True), pool


@pytest.mark.slow
def test_compiled_step_matches_paged_batch(compiled):
    step, pool = compiled
    assert step.attention == "reference"  # the CPU's default when compiled
    check_step_matches_eager(step, pool)
    check_step_matches_eager(step, pool)  # settled: its guards skipped, the same graph replayed
    assert (4, 8) in step.settled


@pytest.mark.slow
def test_compiled_step_greedy_equals_generate(compiled):
    step, pool = compiled
    lengths = [5, 17, 30]  # contexts cross 64 tokens: widths 8 and 16
    assert greedy_through_step(MODEL, step, pool, lengths, 40) == alone(MODEL, lengths, 40)
    assert {(4, 8), (4, 16)} <= step.settled


@pytest.mark.slow
def test_warmup_compiles_every_graph_and_writes_only_scratch():
    pool = KVPool.for_model(MODEL, NUM_BLOCKS, BLOCK)
    pool.k.normal_()
    k = pool.k.clone()
    step = PagedDecodeStep(MODEL, pool, 4, SCRATCH, compile=True, block_buckets=(16,))
    assert step.warmup() > 0
    assert step.settled == {(1, 16), (2, 16), (4, 16)}
    assert torch.equal(pool.k[:, :SCRATCH], k[:, :SCRATCH])
    assert step.warmup() < 1  # nothing left to compile
    check_step_matches_eager(step, pool)  # compiled on padding rows, right on real ones


@pytest.mark.slow
def test_compiled_int8_model_gives_eager_paged_tokens():
    model = quantize(tiny_model(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128), "int8")
    pool = KVPool.for_model(model, 40, BLOCK)
    step = PagedDecodeStep(model, pool, 4, 39, compile=True, attention="gather", block_buckets=(16,))
    lengths = [5, 17, 30]
    got = greedy_through_step(model, step, pool, lengths, 16)
    assert step.settled == {(4, 16)}  # through the compiled graph
    assert got == greedy_through_step(model, paged_batch_step(model, pool), pool, lengths, 16)
    assert got == alone(model, lengths, 16)
