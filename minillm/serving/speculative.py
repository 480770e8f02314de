"""Speculative decoding and prompt lookup inside the serving engine (chapters 7 and 8, batched).

Chapter 7's loop serves one sequence: propose K tokens, verify them in one forward of K + 1,
keep the accepted ones, roll back the rest. In the engine every decode row of a step does the
same at once:

1. **propose**, per row: up to K tokens, each row as many as it may still use (``Work.lookahead``,
   for which the scheduler reserved KV slots). Prompt lookup copies what followed the latest
   earlier match of the row's last tokens (``lookup_continuation``); a draft model runs K batched
   forwards of one token per row over a paged KV pool of its own (``DraftModel``);
2. **verify**, all rows in one forward of the target over (B, K + 1) new tokens, each row its last
   token and its proposals, left-padded, over the paged KV cache (``verify_inputs``);
3. **accept**, row by row, with chapter 7's rule (``accept``): greedy, the proposals that equal the
   target's argmax; sampling, ``accept_draft_tokens``'s rejection rule, which keeps the target's
   distribution whatever the proposals (a lookup's are deterministic: q is one-hot);
4. **roll back** the rejected: nothing to erase. The rejected tokens' K/V stay in slots past the
   row's new length, where no position reads them, and the next forward overwrites them.

The draft's K/V live in a ``KVPool`` of its own shape but the same blocks: block i of a sequence's
table holds the target's K/V in one pool and the draft's in the other, so prefix sharing, copy on
write (``PoolPair``) and preemption cover both with one block table. The draft runs alongside every
prompt chunk the target runs, so its K/V cover what the target's do; after a round whose every
proposal was accepted it lacks the last one's K/V, and feeds it at the start of the next round.
A block enters the prefix cache only once both pools hold it (the engine commits the shorter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.sampling import SamplingParams, probabilities
from ..decoding.common import check_k
from ..decoding.prompt_lookup import lookup_continuation
from ..decoding.speculative import accept_draft_tokens, draw, greedy_accept
from ..kv.paged import KVPool, PagedKVBatch
from .scheduler import SequenceState

METHODS = ("lookup", "draft")


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates: ``"lookup"`` (prompt lookup, no model) or ``"draft"`` (a draft
    model, given to the engine), ``k`` proposals per row and step at most."""

    method: str = "lookup"
    k: int = 4
    max_ngram: int = 3  # lookup: the longest n-gram looked up (then shorter, down to min_ngram)
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation method must be one of {METHODS}, got {self.method!r}")
        check_k(self.k)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


class PoolPair:
    """The target's pool and the draft's, copied together on copy-on-write (``BlockManager.pool``)."""

    def __init__(self, target: KVPool, draft: KVPool):
        self.target, self.draft = target, draft

    def copy_block(self, src: int, dst: int) -> None:
        self.target.copy_block(src, dst)
        self.draft.copy_block(src, dst)


def check_draft(target_config, draft) -> None:
    """A draft model must speak the target's vocabulary and reach as far as its context."""
    if draft.config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
            f"({target_config.vocab_size}): they must share a tokenizer"
        )
    if draft.config.max_seq_len < target_config.max_seq_len:
        raise ValueError(
            f"the draft model's context ({draft.config.max_seq_len}) is shorter than the target's "
            f"({target_config.max_seq_len})"
        )


def rows_inputs(rows: list[tuple[list[int], int]], device) -> tuple[Tensor, Tensor]:
    """Rows of (tokens, position of the first) -> ids and positions (B, T), left-padded with -1."""
    T = max(len(tokens) for tokens, _ in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    positions = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (tokens, start) in enumerate(rows):
        ids[i, T - len(tokens) :] = torch.as_tensor(tokens, dtype=torch.long)
        positions[i, T - len(tokens) :] = torch.arange(start, start + len(tokens))
    return ids.to(device), positions.to(device)


class DraftModel:
    """A draft model over a paged KV pool of its own, indexed by the target's block tables."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.pool = KVPool.for_model(model, num_blocks, block_size)
        self._generators: dict[int, torch.Generator | None] = {}
        self.forwards = 0

    def start(self, request_id: int, params: SamplingParams) -> None:
        """A request's own draw stream (its seed + 1, as ``speculative_generate`` does)."""
        seed = None if params.seed is None else (params.seed + 1) % 2**63
        self._generators[request_id] = replace(params, seed=seed).generator(self.model.device)

    def end(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def _forward(self, rows: list[tuple[list[int], int]], tables: list[list[int]]) -> Tensor:
        self.forwards += 1
        ids, positions = rows_inputs(rows, self.model.device)
        return self.model(ids, positions, PagedKVBatch(self.pool, tables), last_only=True)[:, -1]  # (B, V)

    def prefill(self, seqs: list[SequenceState], ns: list[int], tables: list[list[int]]) -> None:
        """Run the draft over the prompt chunks the target runs this step (its K/V keep up)."""
        rows = [(seq.tokens[seq.num_computed : seq.num_computed + n], seq.num_computed) for seq, n in zip(seqs, ns)]
        self._forward(rows, tables)
        for seq, n in zip(seqs, ns):
            seq.draft_computed = seq.num_computed + n

    def propose(
        self, seqs: list[SequenceState], ks: list[int], tables: list[list[int]]
    ) -> list[tuple[list[int], Tensor | None]]:
        """Up to ks[i] proposals for each row: max(ks) batched forwards, each row dropping out when it
        has its own. Greedy rows take argmaxes (q None); sampling rows draw from the draft's
        distribution under the request's parameters and keep it (q, (k, V))."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[Tensor]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        # first forward: what the draft lacks of each row (its last token, or the last two)
        rows = [(seqs[i].tokens[seqs[i].draft_computed :], seqs[i].draft_computed) for i in live]
        while live:
            logits = self._forward(rows, [tables[i] for i in live])
            for j, i in enumerate(live):
                seq = seqs[i]
                seq.draft_computed += len(rows[j][0])
                params = seq.request.params
                if params.greedy:
                    drafts[i].append(int(logits[j].argmax()))
                else:
                    q = probabilities(logits[j], params)
                    drafts[i].append(draw(q, self._generators.get(seq.id)))
                    qs[i].append(q)
            live = [i for i in live if len(drafts[i]) < ks[i]]
            rows = [(drafts[i][-1:], seqs[i].draft_computed) for i in live]
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs)]


def lookup_proposals(seqs: list[SequenceState], ks: list[int], spec: Speculation) -> list[tuple[list[int], None]]:
    """Prompt lookup, row by row: what followed the latest earlier match of the last tokens."""
    return [
        (lookup_continuation(seq.tokens, k, spec.max_ngram, spec.min_ngram) if k else [], None)
        for seq, k in zip(seqs, ks)
    ]


def verify_inputs(seqs: list[SequenceState], drafts: list[list[int]], device) -> tuple[Tensor, Tensor]:
    """The verify forward's rows: each sequence's last token and its proposals, from its length on."""
    return rows_inputs([([seq.tokens[-1], *d], len(seq.tokens) - 1) for seq, d in zip(seqs, drafts)], device)


def accept(
    logits: Tensor, draft: list[int], q: Tensor | None, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int]:
    """Chapter 7's rule for one row: target logits (k + 1, V) at its proposals and after them ->
    (proposals kept, the token that follows them)."""
    drafted = torch.tensor(draft, dtype=torch.long, device=logits.device)
    if params.greedy:
        return greedy_accept(logits, drafted)
    p = probabilities(logits, params)
    q = F.one_hot(drafted, p.shape[-1]).float() if q is None else q
    return accept_draft_tokens(p, q, drafted, generator)
