"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks (chapter 15).

Mixture of experts (Shazeer et al., 2017; Switch Transformer, Fedus et al., 2021; Mixtral, Jiang
et al., 2024) replaces a block's one SwiGLU MLP by ``n_experts`` of them and a router, a linear
map from the hidden state to one logit per expert. Each token runs through only ``top_k``
experts: the parameters grow n_experts-fold, a token's compute top_k-fold.

Routing, Mixtral's convention (``route``). The router's logits of a token, its ``top_k`` largest
chosen (``torch.topk``'s order: highest first), gates = softmax over the k chosen logits, which is
the softmax over all n_experts renormalised over the chosen k. The output is
``sum_j gate_j * expert_{e_j}(x)``. No capacity limit: every token reaches all its experts, none
is dropped, so the split layer can equal one process exactly.

Expert parallelism (GShard, Lepikhin et al., 2020). Of p ranks, each holds n_experts / p experts:
expert e on rank e // (n_experts / p) (``expert_rank``); the router and everything outside the
MoE layers are whole on every rank, and each rank runs its own tokens (its own requests). A
layer, on each rank (``ExpertParallelMoE.forward``):

1. route its tokens, and sort its (token, choice) rows by expert: the rows for rank j are then
   contiguous, in one run per expert;
2. tell every rank how many rows of each of its experts to expect (a small all-to-all of
   n_experts int64 counts, ``Comm.all_to_all_counts``);
3. dispatch: one all-to-all sends each row (the token's hidden vector, d_model elements) to the
   rank of its expert;
4. each local expert runs once, over the rows that all the ranks sent it;
5. combine: the reverse all-to-all sends each output row back to the token's rank;
6. there, each row is weighted by its gate and the k rows of a token summed.

Bytes (``all_to_all_bytes``). A rank holding T tokens sends T x top_k rows of d_model elements.
With routing uniform over the experts, the fraction (p - 1) / p of them goes to other ranks, so
the dispatch sends T x top_k x d_model x bytes x (p - 1) / p, and the combine sends as much
back: a layer moves twice the formula. The formula is linear in T: with the total tokens of
all ranks it gives the bytes of all ranks. A real routing is not uniform; the exact count for a
given routing (``routed_all_to_all_bytes``) comes from its split sizes, and ``Comm`` counts the
run to it. The counts of step 2 are (p - 1) x n_experts / p x 8 bytes, counted as their own
kind (``count_exchange_bytes``). Gates stay on the token's rank and travel nowhere.

Load imbalance (``expert_load``). Nothing here makes the router spread its tokens evenly; the
rank whose experts get the most rows works longest, and the others wait for it at the combine.
max / mean rows per expert (and per rank) says by how much. Trained MoEs add a balancing loss
(Switch) or a routing bias (DeepSeek-V3), and serving systems cap each expert's rows (a capacity
factor) and drop or re-route the overflow.

``moe_model`` turns a ``Transformer``'s MLPs into MoE layers (random weights: a speed and
equality experiment, not a trained MoE), ``shard_experts`` keeps one rank's experts of each, and
``ep_layer_run`` / ``ep_generate_run`` are rank functions for ``launch`` that check a split
layer and a split model against one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.config import ModelConfig, is_int
from ..core.generate import generate
from ..core.model import MLP, Transformer
from .comm import Comm
from .context import imbalance

COUNT_BYTES = 8  # the per-expert counts travel as int64


def check_expert_parallel(n_experts: int, top_k: int, world_size: int = 1) -> None:
    """ValueError, before any process starts, for a MoE layer or a split that cannot work."""
    for name, value in (("n_experts", n_experts), ("top_k", top_k), ("world size", world_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k {top_k} exceeds n_experts {n_experts}: a token cannot pick more experts than exist")
    if n_experts % world_size:
        raise ValueError(
            f"{n_experts} experts cannot be split evenly over {world_size} ranks ({n_experts} % {world_size} != 0)"
        )


def expert_rank(expert: int, n_experts: int, world_size: int) -> int:
    """The rank that holds ``expert``: experts are dealt out in runs of n_experts / p."""
    return expert // (n_experts // world_size)


def local_experts(n_experts: int, world_size: int, rank: int) -> range:
    """The experts rank ``rank`` holds."""
    m = n_experts // world_size
    return range(rank * m, (rank + 1) * m)


# ---------------------------------------------------------------------------------------------
# Routing and the one-process layer


@dataclass(frozen=True)
class Routing:
    """Where each token goes: ``experts`` (N, k) long, highest router logit first; ``gates`` (N, k),
    each row summing to 1."""

    experts: Tensor
    gates: Tensor


def route(logits: Tensor, top_k: int) -> Routing:
    """Top-k routing, Mixtral's convention: of the logits (N, n_experts), the k largest,
    their softmax as gates."""
    top, experts = logits.topk(top_k, dim=-1)  # (N, k) each
    return Routing(experts, torch.softmax(top.float(), dim=-1).to(logits.dtype))


def round_robin_routing(n_tokens: int, n_experts: int, top_k: int, dtype: torch.dtype = torch.float32) -> Routing:
    """A forced routing, uniform by construction: token i picks experts (i k + j) mod n_experts for
    j < k, with equal gates. Every expert gets the same rows when n_tokens x top_k is a multiple
    of n_experts (so every rank too): the case the byte formula describes."""
    check_expert_parallel(n_experts, top_k)
    experts = (torch.arange(n_tokens)[:, None] * top_k + torch.arange(top_k)) % n_experts  # (N, k)
    return Routing(experts, torch.full((n_tokens, top_k), 1.0 / top_k, dtype=dtype))


def check_routing(routing: Routing, n_tokens: int, n_experts: int, top_k: int) -> None:
    """ValueError for a routing that does not fit the tokens and the layer."""
    shape = (n_tokens, top_k)
    if tuple(routing.experts.shape) != shape or tuple(routing.gates.shape) != shape:
        raise ValueError(
            f"routing must give (tokens, top_k) = {shape} experts and gates, got "
            f"{tuple(routing.experts.shape)} and {tuple(routing.gates.shape)}"
        )
    if routing.experts.numel() and not 0 <= int(routing.experts.min()) <= int(routing.experts.max()) < n_experts:
        raise ValueError(f"routing names an expert outside 0..{n_experts - 1}")


class MoEFeedForward(nn.Module):
    """A router and ``n_experts`` SwiGLU experts of the model's shape (dim -> ffn_dim -> dim), each
    token through its ``top_k`` experts, weighted by its gates. The one-process reference."""

    def __init__(self, config: ModelConfig, n_experts: int, top_k: int):
        super().__init__()
        check_expert_parallel(n_experts, top_k)
        self.n_experts, self.top_k, self.dim = n_experts, top_k, config.dim
        self.router = nn.Linear(config.dim, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(n_experts))

    def route(self, x: Tensor) -> Routing:
        return route(self.router(x), self.top_k)

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """x (..., dim) -> (..., dim); ``routing`` of the flattened tokens forces where they go."""
        shape, x = x.shape, x.reshape(-1, self.dim)  # (N, D)
        routing = self.route(x) if routing is None else routing
        check_routing(routing, x.shape[0], self.n_experts, self.top_k)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = (routing.experts == e).nonzero(as_tuple=True)  # rows routed to e
            if len(token):
                gates = routing.gates[token, choice, None]  # (n_e, 1)
                y.index_add_(0, token, gates * expert(x[token]))
        return y.view(shape)


# ---------------------------------------------------------------------------------------------
# The expert-parallel layer


@dataclass(frozen=True)
class Dispatch:
    """What one forward of an ``ExpertParallelMoE`` exchanged, on its rank."""

    send_splits: list[int]  # rows this rank sent to each rank in the dispatch (its own included)
    recv_splits: list[int]  # rows it received from each rank (and sent back in the combine)
    expert_rows: list[int]  # rows each local expert ran, from every rank: the global load of its experts


class ExpertParallelMoE(nn.Module):
    """One rank's part of a ``MoEFeedForward``: the whole router, its n_experts / p experts, and
    the two all-to-alls that bring it the rows of its experts and send their outputs back."""

    def __init__(self, moe: MoEFeedForward, comm: Comm):
        super().__init__()
        check_expert_parallel(moe.n_experts, moe.top_k, comm.world_size)
        self.n_experts, self.top_k, self.dim, self.comm = moe.n_experts, moe.top_k, moe.dim, comm
        self.local = local_experts(moe.n_experts, comm.world_size, comm.rank)
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[e] for e in self.local)
        self.last_dispatch: Dispatch | None = None

    def route(self, x: Tensor) -> Routing:
        return route(self.router(x), self.top_k)

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """This rank's tokens x (..., dim) -> (..., dim), as ``MoEFeedForward`` gives them."""
        shape, x = x.shape, x.reshape(-1, self.dim)  # (N, D)
        p, m = self.comm.world_size, len(self.local)
        routing = self.route(x) if routing is None else routing
        check_routing(routing, x.shape[0], self.n_experts, self.top_k)
        # 1. sort the (token, choice) rows by expert, so each rank's rows are contiguous
        flat = routing.experts.flatten()  # (N k,): each row's expert
        order = flat.argsort(stable=True)
        token = order // self.top_k  # (N k,): each sorted row's token
        # 2. tell each rank how many rows for each of its experts will come
        sending = torch.bincount(flat, minlength=self.n_experts).view(p, m)
        receiving = self.comm.all_to_all_counts(sending)  # (p, m): rank s, expert i
        send_splits, recv_splits = sending.sum(1).tolist(), receiving.sum(1).tolist()
        # 3. dispatch
        rows = self.comm.all_to_all(x[token], send_splits, recv_splits)  # (R, D)
        # 4. each local expert once, over the rows that every rank sent it
        owner = torch.arange(m).repeat(p).repeat_interleave(receiving.flatten())  # (R,)
        out = torch.empty_like(rows)
        for i, expert in enumerate(self.experts):
            mine = (owner == i).nonzero(as_tuple=True)[0]
            if len(mine):
                out[mine] = expert(rows[mine])
        # 5. combine: the outputs go back, in this rank's sorted order
        back = self.comm.all_to_all(out, recv_splits, send_splits)  # (N k, D)
        # 6. weight each row by its gate, sum each token's k rows
        gates = routing.gates.flatten()[order, None]  # (N k, 1)
        y = torch.zeros_like(x).index_add_(0, token, gates * back)
        self.last_dispatch = Dispatch(send_splits, recv_splits, receiving.sum(0).tolist())
        return y.view(shape)


# ---------------------------------------------------------------------------------------------
# Bytes and load


def all_to_all_bytes(tokens: int, top_k: int, d_model: int, bytes_per_element: int, world_size: int) -> float:
    """Bytes one all-to-all (the dispatch; the combine moves as much back) sends off ``tokens``'
    rank under uniform routing: tokens x top_k x d_model x bytes x (p - 1) / p."""
    return tokens * top_k * d_model * bytes_per_element * (world_size - 1) / world_size


def count_exchange_bytes(n_experts: int, world_size: int) -> int:
    """Bytes a rank sends in the counts exchange before each dispatch: n_experts / p int64 to
    each of the p - 1 other ranks."""
    return (world_size - 1) * (n_experts // world_size) * COUNT_BYTES


def split_sizes(experts: Tensor, n_experts: int, world_size: int) -> list[int]:
    """Rows a rank with routing ``experts`` (N, k) sends to each rank in the dispatch."""
    per_expert = torch.bincount(experts.flatten(), minlength=n_experts)
    return per_expert.view(world_size, -1).sum(1).tolist()


@dataclass(frozen=True)
class AllToAllBytes:
    """One rank's all-to-all bytes in one MoE layer, each to the other ranks."""

    dispatch: int  # its tokens' rows whose expert lives elsewhere
    combine: int  # the outputs of rows other ranks sent it, sent back

    @property
    def total(self) -> int:
        return self.dispatch + self.combine


def routed_all_to_all_bytes(
    experts_by_rank: Sequence[Tensor], n_experts: int, d_model: int, bytes_per_element: int
) -> list[AllToAllBytes]:
    """Exact bytes for a given routing, from its split sizes: ``experts_by_rank[r]`` (N_r, k) is
    rank r's routing, p = len(experts_by_rank). What ``Comm`` counts of an ``ExpertParallelMoE``
    forward as "all_to_all", per rank."""
    p, row = len(experts_by_rank), d_model * bytes_per_element
    splits = [split_sizes(e, n_experts, p) for e in experts_by_rank]  # splits[src][dst]
    return [
        AllToAllBytes(
            dispatch=row * sum(splits[r][j] for j in range(p) if j != r),
            combine=row * sum(splits[s][r] for s in range(p) if s != r),
        )
        for r in range(p)
    ]


@dataclass(frozen=True)
class ExpertLoad:
    """Rows ((token, choice) pairs) each expert and each rank's experts receive."""

    per_expert: list[int]
    per_rank: list[int]

    @property
    def expert_imbalance(self) -> float:
        """max / mean rows per expert: 1.0 when balanced (and when there are no rows)."""
        return imbalance(self.per_expert) if sum(self.per_expert) else 1.0

    @property
    def rank_imbalance(self) -> float:
        """max / mean rows per rank: how long the busiest rank's experts run against a perfect split."""
        return imbalance(self.per_rank) if sum(self.per_rank) else 1.0


def expert_load(experts: Tensor, n_experts: int, world_size: int = 1) -> ExpertLoad:
    """The load of a batch's routing ``experts`` (N, k) (all ranks' tokens together)."""
    check_expert_parallel(n_experts, 1, world_size)
    per_expert = torch.bincount(experts.flatten(), minlength=n_experts)
    return ExpertLoad(per_expert.tolist(), per_expert.view(world_size, -1).sum(1).tolist())


# ---------------------------------------------------------------------------------------------
# A MoE model, split


def moe_model(model: Transformer, n_experts: int, top_k: int, seed: int = 0, std: float = 0.02) -> Transformer:
    """``model`` with each block's MLP replaced by a ``MoEFeedForward`` (in place; returned) whose
    router and experts are random, N(0, std) from ``seed``: the same model on every rank that
    builds it with the same arguments."""
    check_expert_parallel(n_experts, top_k)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        moe = MoEFeedForward(model.config, n_experts, top_k)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                p.copy_(torch.zeros_like(p) if name.endswith("bias") else torch.randn(p.shape, generator=gen) * std)
        layer.mlp = moe.to(device=model.device, dtype=model.dtype)
    return model.eval()


def shard_experts(model: Transformer, comm: Comm) -> Transformer:
    """This rank's part of a MoE model (in place; returned): each ``MoEFeedForward`` becomes an
    ``ExpertParallelMoE`` holding only this rank's experts."""
    for layer in model.layers:
        if isinstance(layer.mlp, MoEFeedForward):
            layer.mlp = ExpertParallelMoE(layer.mlp, comm)
    model.expert_parallel = comm.world_size  # what a timing line or a report names
    return model


# ---------------------------------------------------------------------------------------------
# Checking the split against one process (tests and chapter 15): rank functions for ``launch``


@dataclass(frozen=True)
class EPLayerResult:
    output: Tensor  # (N_r, D): this rank's tokens through the split layer
    counts: dict  # Comm.counts() of the forward
    dispatch: Dispatch


def ep_layer_run(
    rank: int, world_size: int, moe: MoEFeedForward, x_by_rank: Sequence[Tensor], routings=None
) -> EPLayerResult:
    """Rank ``rank``'s tokens ``x_by_rank[rank]`` through its part of ``moe`` (routing
    ``routings[rank]`` when given, else the router's)."""
    comm = Comm()
    layer = ExpertParallelMoE(moe, comm)
    with torch.inference_mode():
        y = layer(x_by_rank[rank], None if routings is None else routings[rank])
    return EPLayerResult(y, comm.counts(), layer.last_dispatch)


@dataclass(frozen=True)
class EPGenerateResult:
    prefill_logits: Tensor  # (T, vocab): every position of this rank's prompt
    tokens: list[int]  # its greedy tokens
    counts: dict  # Comm.counts() of the whole generate call
    local_params: int  # parameters this rank holds


def ep_generate_run(
    rank: int, world_size: int, model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> EPGenerateResult:
    """Rank ``rank`` serves ``prompts[rank]`` on its shard of the MoE ``model``: the logits of the
    prompt, then ``max_new_tokens`` greedy tokens. Every rank takes part in every layer's
    all-to-alls, so every rank runs the same number of forwards (no early stop)."""
    comm = Comm()
    model = shard_experts(model, comm)
    prompt = torch.tensor([list(prompts[rank])])
    with torch.inference_mode():
        logits = model(prompt)[0]
    comm.reset()
    result = generate(model, prompt, max_new_tokens, eos_token_id=None)
    return EPGenerateResult(logits, result.tokens[0].tolist(), comm.counts(), model.num_params())
