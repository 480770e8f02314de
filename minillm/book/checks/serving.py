"""Checkers for chapters 6 and 13: a block allocator with reference counts, the pool slot of a
token, prefix-sharing memory; the admission check of a continuous-batching step, static versus
continuous step counts, goodput of a finished run."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...core.config import ceil_div
from ...kv.paged import blocks_for, token_slot
from ...measure.metrics import SLO, RequestMetrics, goodput
from .base import passed, require

# -- chapter 6 --------------------------------------------------------------------------------


def check_allocator(make: Callable) -> None:
    """make(num_blocks) -> an object with allocate() -> block, incref(block), decref(block), num_free."""
    name = "block allocator"
    a = make(4)
    require(a.num_free == 4, name, f"a new allocator of 4 blocks should have 4 free, got {a.num_free}")
    got = [a.allocate() for _ in range(4)]
    require(sorted(got) == [0, 1, 2, 3], name, f"four allocations from 4 blocks must give 0..3 once each, got {got}")
    require(a.num_free == 0, name, f"after allocating every block none is free, got num_free={a.num_free}")
    try:
        extra = a.allocate()
    except (MemoryError, RuntimeError, IndexError, ValueError):
        extra = None
    require(extra is None, name, f"allocate() on a full pool must raise (e.g. MemoryError), not return {extra!r}")
    shared = got[1]
    a.incref(shared)  # a second sequence shares it (prefix cache)
    a.decref(shared)
    require(
        a.num_free == 0,
        name,
        "a block shared by two sequences and released by one is still in use: free it "
        "only when its reference count reaches 0",
    )
    a.decref(shared)
    require(a.num_free == 1, name, f"released by both, the shared block must be free again, num_free={a.num_free}")
    again = a.allocate()
    require(again == shared, name, f"the only free block is {shared}, but allocate() gave {again}")
    for b in got:
        a.decref(b)
    require(a.num_free == 4, name, f"after every block is released all 4 are free, got {a.num_free}")
    passed(name, "blocks are handed out once, shared with a count, and freed when the last reference goes")


def check_token_slot(fn: Callable) -> None:
    """fn(block_table, position, block_size) -> flat slot index in the pool."""
    name = "token slot"
    cases = [
        ([7, 2, 9], 0, 4),
        ([7, 2, 9], 3, 4),
        ([7, 2, 9], 4, 4),
        ([7, 2, 9], 10, 4),
        ([5], 15, 16),
        ([3, 0, 11, 6], 40, 16),
        ([1, 2], 1, 1),
    ]
    for table, pos, bs in cases:
        want, got = token_slot(table, pos, bs), fn(list(table), pos, bs)
        hint = f"table {table}, block size {bs}, token {pos}: expected slot {want}, got {got}"
        if got == table[pos // bs] + pos % bs:
            hint += ": a block id counts whole blocks; multiply it by the block size"
        elif got == pos:
            hint += ": the token's position is not its slot; look its block up in the table"
        require(got == want, name, hint + " (slot = table[i // block_size] x block_size + i % block_size)")
    passed(name, "slot = table[i // block_size] x block_size + i % block_size")


def check_shared_prefix_blocks(fn: Callable) -> None:
    """fn(n_requests, system_len, own_lens, block_size) -> blocks for all n requests with prefix sharing."""
    name = "prefix-sharing memory"
    cases = [
        (4, 32, [8, 8, 8, 8], 16),
        (3, 40, [5, 20, 1], 16),
        (2, 1000, [24, 40], 16),
        (5, 7, [3, 3, 3, 3, 3], 4),
        (1, 64, [10], 8),
    ]
    for n, system, own, bs in cases:
        shared = system // bs
        want = shared + sum(blocks_for(system + o, bs) - shared for o in own)
        got = fn(n, system, list(own), bs)
        hint = (
            f"{n} requests, a {system}-token system prompt, own tokens {own}, block size {bs}: "
            f"expected {want}, got {got}"
        )
        if got == blocks_for(system, bs) + sum(blocks_for(o, bs) for o in own):
            hint += (
                ": only *full* blocks of the system prompt are shared; its last partial block also holds "
                "each request's own first tokens"
            )
        elif got == sum(blocks_for(system + o, bs) for o in own):
            hint += ": that is without sharing; the full blocks of the system prompt are stored once"
        require(got == want, name, hint)
    passed(name, "the system prompt's full blocks once, then each request's blocks after them")


# -- chapter 13 -------------------------------------------------------------------------------


def reference_admit(
    waiting: list[int],
    n_running: int,
    free_blocks: int,
    max_batch: int,
    block_size: int,
    token_budget: int,
    round_up: bool = True,
) -> int:
    """How many waiting prompts join (first come, first served: stop at the first that does not fit)."""
    admitted = 0
    for prompt in waiting:
        need = blocks_for(prompt, block_size) if round_up else prompt // block_size
        if n_running + admitted >= max_batch or need > free_blocks or prompt > token_budget:
            break
        admitted, free_blocks, token_budget = admitted + 1, free_blocks - need, token_budget - prompt
    return admitted


def check_admission(fn: Callable) -> None:
    """fn(waiting_prompt_lens, n_running, free_blocks, max_batch, block_size, token_budget) -> how many join."""
    name = "admission check"
    cases = [
        ([10, 20, 30], 0, 100, 8, 16, 1000),
        ([10, 20, 30], 6, 100, 8, 16, 1000),
        ([40, 5], 0, 2, 8, 16, 1000),
        ([16, 16, 16], 0, 2, 8, 16, 1000),
        ([100, 10], 2, 50, 8, 16, 64),
        ([30, 30, 30], 1, 50, 8, 16, 62),
        ([], 0, 10, 4, 16, 100),
        ([17], 0, 1, 4, 16, 100),
        ([5, 200, 5], 0, 100, 8, 16, 1000),
    ]
    for waiting, running, free, mb, bs, budget in cases:
        want = reference_admit(list(waiting), running, free, mb, bs, budget)
        got = fn(list(waiting), running, free, mb, bs, budget)
        hint = (
            f"waiting prompts {waiting}, {running} running, {free} free blocks of {bs}, max batch {mb}, "
            f"{budget} tokens left in the step: expected {want} to join, got {got}"
        )
        if got == reference_admit(list(waiting), running, free, mb, bs, budget, round_up=False):
            hint += f": a prompt of p tokens needs ceil(p / {bs}) blocks (round up: a partial block is a whole block)"
        elif waiting == [100, 10] and got:
            hint += ": first come, first served: if the first waiting prompt does not fit, none behind it goes ahead"
        elif running and got == want + running:
            hint += ": the running sequences already hold places in the batch"
        require(got == want, name, hint)
    passed(name, "first come first served, while the batch has a place, the pool the blocks and the step the tokens")


def reference_steps(output_lens: list[int], max_batch: int) -> tuple[int, int]:
    """Decode steps to serve every request (all waiting at time 0): static batches in order, and continuous."""
    static = sum(max(output_lens[i : i + max_batch]) for i in range(0, len(output_lens), max_batch))
    queue, running, continuous = list(output_lens), [], 0
    while queue or running:
        while queue and len(running) < max_batch:
            running.append(queue.pop(0))
        running = [n - 1 for n in running if n > 1]
        continuous += 1
    return static, continuous


def check_batch_steps(fn: Callable) -> None:
    """fn(output_lens, max_batch) -> (static steps, continuous steps), one token per sequence per step."""
    name = "static vs continuous steps"
    cases = [([3, 1, 2, 8], 2), ([5, 5, 5, 5], 2), ([1, 9, 1, 1, 1, 1], 3), ([4], 4), ([2, 7, 1, 3, 6, 2, 2], 3)]
    for lens, mb in cases:
        want, got = reference_steps(list(lens), mb), fn(list(lens), mb)
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        hint = f"output lengths {lens}, max batch {mb}: expected (static, continuous) = {want}, got {got}"
        if isinstance(got, tuple) and len(got) == 2 and got[0] != want[0]:
            hint += ": a static batch runs until its longest member is done: sum of each batch's maximum"
        elif isinstance(got, tuple) and len(got) == 2 and got[1] == ceil_div(sum(lens), mb):
            hint += ": that is the ideal; a request joins only when a place is free, first come first served"
        require(got == want, name, hint)
    passed(name, "static: the sum of each batch's longest; continuous: a freed place is refilled at the next step")


def check_run_goodput(fn: Callable) -> None:
    """fn(metrics: list[RequestMetrics], slo_ttft, slo_tpot) -> requests/s meeting both, over the run's span."""
    name = "goodput of a run"
    run = [
        RequestMetrics(0.0, [0.1, 0.15, 0.2]),
        RequestMetrics(0.2, [0.3]),  # good; good (one token)
        RequestMetrics(0.5, [1.0, 1.02]),
        RequestMetrics(1.0, [1.1, 1.4, 1.7]),  # TTFT 0.5; TPOT 0.3
        RequestMetrics(1.2, [1.3]),
        RequestMetrics(2.0, [2.15, 2.23, 2.31, 2.39]),  # good; good
        RequestMetrics(3.0, [3.05, 3.1, 3.15, 3.3]),
        RequestMetrics(3.5, [3.9, 4.0]),
    ]  # good (mean gap); TTFT 0.4
    slo = SLO(ttft=0.2, tpot=0.1)
    want, n_good = goodput(run, slo), sum(slo.met_by(r) for r in run)
    got = fn(list(run), slo.ttft, slo.tpot)
    hint = f"expected {want:.4f} requests/s ({n_good} good requests over a 4.0 s span), got {got}"
    near = lambda x: got is not None and math.isclose(float(got), x, rel_tol=1e-6)  # noqa: E731
    if near(n_good / len(run)):
        hint += ": that is the fraction of requests in the SLO; goodput divides by the span in seconds"
    elif near(n_good / 3.9):
        hint += ": the span starts at the first *arrival*, not the first token"
    elif near((n_good - 2) / 4.0):
        hint += ": a one-token answer has no TPOT; it counts if its TTFT is met"
    elif near((n_good - 1) / 4.0):
        hint += ": TPOT is the mean gap after the first token, not the largest gap"
    require(near(want), name, hint)
    passed(name, f"{n_good} of {len(run)} requests meet the SLO over a 4 s span: {want:.2f} requests/s")
