"""Chapters 6 and 13's checkers accept the right answers and reject plausible wrong ones."""

import pytest

from minillm.book.checks import CheckFailed
from minillm.book.checks.serving import (
    check_admission,
    check_allocator,
    check_batch_steps,
    check_run_goodput,
    check_shared_prefix_blocks,
    check_token_slot,
    reference_admit,
    reference_steps,
)
from minillm.kv.paged import blocks_for
from minillm.measure.metrics import SLO, goodput


def stub(*args):
    raise NotImplementedError


class RightAllocator:
    def __init__(self, n):
        self.refs, self.free = [0] * n, list(range(n))

    @property
    def num_free(self):
        return len(self.free)

    def allocate(self):
        if not self.free:
            raise MemoryError
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def incref(self, block):
        self.refs[block] += 1

    def decref(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)


class FreesOnFirstRelease(RightAllocator):
    def decref(self, block):
        if self.refs[block] > 0:
            self.refs[block] = 0
            self.free.append(block)


class NeverRaises(RightAllocator):
    def allocate(self):
        return self.free.pop() if self.free else -1


def test_allocator_checker():
    check_allocator(RightAllocator)
    with pytest.raises(CheckFailed, match="reference count reaches 0"):
        check_allocator(FreesOnFirstRelease)
    with pytest.raises(CheckFailed, match="must raise"):
        check_allocator(NeverRaises)
    with pytest.raises(NotImplementedError):
        check_allocator(stub)


def test_token_slot_checker():
    check_token_slot(lambda t, i, b: t[i // b] * b + i % b)
    with pytest.raises(CheckFailed, match="multiply it by the block size"):
        check_token_slot(lambda t, i, b: t[i // b] + i % b)
    with pytest.raises(CheckFailed, match="look its block up"):
        check_token_slot(lambda t, i, b: i)
    with pytest.raises(NotImplementedError):
        check_token_slot(stub)


def test_shared_prefix_blocks_checker():
    def right(n, s, own, b):
        return s // b + sum(blocks_for(s + o, b) - s // b for o in own)

    check_shared_prefix_blocks(right)
    with pytest.raises(CheckFailed, match="only \\*full\\* blocks"):
        check_shared_prefix_blocks(lambda n, s, own, b: blocks_for(s, b) + sum(blocks_for(o, b) for o in own))
    with pytest.raises(CheckFailed, match="without sharing"):
        check_shared_prefix_blocks(lambda n, s, own, b: sum(blocks_for(s + o, b) for o in own))
    with pytest.raises(NotImplementedError):
        check_shared_prefix_blocks(stub)


def test_reference_admission_examples():
    assert reference_admit([10, 20, 30], 6, 100, 8, 16, 1000) == 2  # two places left
    assert reference_admit([40, 5], 0, 2, 8, 16, 1000) == 0  # the first needs 3 blocks: nobody jumps it
    assert reference_admit([30, 30, 30], 1, 50, 8, 16, 62) == 2  # the budget runs out


def test_admission_checker():
    check_admission(reference_admit)

    def skips_ahead(waiting, running, free, mb, bs, budget):
        n = 0
        for p in waiting:
            if running + n < mb and blocks_for(p, bs) <= free and p <= budget:
                n, free, budget = n + 1, free - blocks_for(p, bs), budget - p
        return n

    with pytest.raises(CheckFailed, match="first come, first served|expected"):
        check_admission(skips_ahead)

    def floor_blocks(waiting, running, free, mb, bs, budget):
        n = 0
        for p in waiting:
            if running + n >= mb or p // bs > free or p > budget:
                break
            n, free, budget = n + 1, free - p // bs, budget - p
        return n

    with pytest.raises(CheckFailed, match="round up"):
        check_admission(floor_blocks)
    with pytest.raises(CheckFailed, match="expected"):
        check_admission(lambda w, r, f, mb, bs, bud: min(len(w), mb - r))  # ignores memory
    with pytest.raises(NotImplementedError):
        check_admission(stub)


def test_batch_steps_checker():
    assert reference_steps([4, 1, 1, 1], 2) == (4 + 1, 4)
    check_batch_steps(reference_steps)
    with pytest.raises(CheckFailed, match="longest member"):
        check_batch_steps(lambda lens, mb: (sum(lens) // mb, reference_steps(lens, mb)[1]))
    with pytest.raises(CheckFailed, match="ideal"):
        check_batch_steps(lambda lens, mb: (reference_steps(lens, mb)[0], -(-sum(lens) // mb)))
    with pytest.raises(NotImplementedError):
        check_batch_steps(stub)


def test_run_goodput_checker():
    check_run_goodput(lambda ms, t, p: goodput(ms, SLO(t, p)))

    def good(ms, t, p):
        return sum(SLO(t, p).met_by(m) for m in ms)

    with pytest.raises(CheckFailed, match="fraction"):
        check_run_goodput(lambda ms, t, p: good(ms, t, p) / len(ms))
    with pytest.raises(CheckFailed, match="first \\*arrival"):
        check_run_goodput(lambda ms, t, p: good(ms, t, p) / (ms[-1].finish - ms[0].token_times[0]))
    with pytest.raises(CheckFailed, match="one-token answer"):
        check_run_goodput(lambda ms, t, p: sum(SLO(t, p).met_by(m) and m.output_tokens > 1 for m in ms) / 4.0)

    def max_gap(ms, t, p):
        return sum(m.ttft <= t and (m.output_tokens < 2 or max(m.itl) <= p) for m in ms) / 4.0

    with pytest.raises(CheckFailed, match="largest gap"):
        check_run_goodput(max_gap)
    with pytest.raises(NotImplementedError):
        check_run_goodput(stub)
