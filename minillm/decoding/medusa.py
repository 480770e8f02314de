"""Medusa: extra decoding heads that guess several tokens ahead, verified as a tree in one forward.

Cai et al. (2024), "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". Head k (k = 1..K) reads the base model's final hidden state at position t and predicts
the token at t + 1 + k (the base LM head predicts t + 1). Each head is one residual block,
h + SiLU(W h + b), followed by a projection to the vocabulary. Here the projection is the base
model's own (frozen) LM head, shared by every head, rather than a trained copy per head: a head
is then D*D + D parameters (66K for the bundled target, not 1.1M), so the trained heads are a
small file. W starts at zero, so an untrained head predicts exactly what the LM head does (the
paper's initialization). The base model stays frozen (Medusa-1); the heads are trained on text
the base model generated itself (self-distillation), with cross-entropy on its greedy tokens.

Decoding: the candidates form a tree, each level from one head's top-k (``MedusaTree``: a fixed
set of paths such as (0,), (1,), (0, 0), ...). The tree's tokens go through the base model in one
forward, each node attending only to its ancestors (``tree_mask``) at position prefix + depth.
Then one path is accepted, its keys and values kept (``KVCache.keep_slots``), the rest dropped:

- greedy acceptance: a node is accepted when it is its parent's argmax, so the output is exactly
  greedy decoding's (lossless);
- typical acceptance (the paper's): a node is accepted when its probability under the base
  model exceeds min(epsilon, delta * exp(-entropy)); faster at temperature > 0, but the output
  no longer follows the base model's distribution (not lossless).

Here: the heads, the tree, acceptance and decoding (``medusa_generate``, its options in
``MedusaOptions``); training the heads is in ``medusa_train``, the drawings in ``viz.decoding``.
Batch size 1 only: rows of a batch would accept different paths.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..core.checkpoints import resolve
from ..core.compiled import CachedForward, CompiledForward, cached_forward
from ..core.device import synchronize
from ..core.generate import check_request, resolve_eos
from ..core.model import Transformer
from ..core.sampling import SamplingParams, filter_logits
from .common import DecodingResult, DecodingStats, single_prompt, stop_at_eos, warm_up

HEADS_FILE, CONFIG_FILE = "medusa_heads.safetensors", "medusa_config.json"


class ResidualBlock(nn.Module):
    """h + SiLU(W h + b); W and b start at zero, so the block starts as the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K heads on a frozen base model; head k predicts the token k + 1 positions after the next."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")
        self.blocks = nn.ModuleList(ResidualBlock(dim) for _ in range(n_heads))

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: Tensor, lm_head: nn.Linear, n: int | None = None) -> Tensor:
        """hidden (..., D), the base model's final normed states -> logits (n, ..., V) of the first
        n heads (all K by default). Each head costs a vocabulary projection: ask only for those used.
        The heads' states go through the LM head together, one matrix product that reads its
        V x D weight once, not once per head (the decoding loop's largest cost outside the forward)."""
        return lm_head(torch.stack([block(hidden) for block in self.blocks[:n]]))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: Path, meta: dict) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(Path(directory) / HEADS_FILE), metadata={"format": "pt"})
        config = {"n_heads": self.n_heads, "dim": self.blocks[0].linear.in_features, **meta}
        (Path(directory) / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")

    @classmethod
    def load(cls, name_or_path, device=None, dtype: torch.dtype | None = None) -> MedusaHeads:
        """The heads saved beside a checkpoint (e.g. ``MedusaHeads.load("minillm-target")``)."""
        directory = resolve(name_or_path)
        if not (directory / HEADS_FILE).is_file():
            raise ValueError(f"no Medusa heads in {directory} (python -m minillm train medusa makes them)")
        config = json.loads((directory / CONFIG_FILE).read_text())
        heads = cls(config["dim"], config["n_heads"])
        heads.load_state_dict(load_file(str(directory / HEADS_FILE)))
        return heads.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------
# The candidate tree


class MedusaTree:
    """A fixed tree of candidates: each path (i_1, ..., i_d) is the node taking the i_1-th best
    token of head 1, then the i_2-th best of head 2, ... Node 0 is the root (the last token)."""

    def __init__(self, paths: list[tuple[int, ...]]):
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("a tree needs non-empty paths of non-negative indices")
        index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        missing = [p for p in paths if p[:-1] not in index]
        if missing:
            raise ValueError(f"every prefix of a path must be a path too; missing the parents of {missing[:3]}")
        self.paths = [(), *paths]
        self.parents = [-1] + [index[p[:-1]] for p in paths]
        self.depths = torch.tensor([len(p) for p in self.paths])  # (N,)
        self.top_k = [1 + max(p[d] for p in paths if len(p) > d) for d in range(max(map(len, paths)))]

    @classmethod
    def product(cls, top_k: tuple[int, ...]) -> MedusaTree:
        """Every combination of each head's top ``top_k[d]`` tokens (sum of products of nodes)."""
        levels = [list(itertools.product(*(range(k) for k in top_k[:d]))) for d in range(1, len(top_k) + 1)]
        return cls([p for level in levels for p in level])

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.top_k)

    def attention_mask(self) -> Tensor:
        """bool (N, N): node i sees node j exactly when j is i or one of i's ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def tokens(self, root: int, head_logits: Tensor) -> Tensor:
        """The candidate tokens (N,): the root, then each node from its head's top-k;
        head_logits (K, V)."""
        top = [head_logits[d].topk(k).indices.tolist() for d, k in enumerate(self.top_k)]
        return torch.tensor([root] + [top[len(p) - 1][p[-1]] for p in self.paths[1:]])


# Head 1's top 3, head 2's top 2, head 3's top 1: 3 + 6 + 6 = 15 candidates. Small, because on a CPU
# a forward's cost grows with its tokens; on a GPU a wider tree (the paper's has 63 nodes) is nearly free.
DEFAULT_TREE = (3, 2, 1)


# ---------------------------------------------------------------------------------------------
# Acceptance


def greedy_accepts(tokens: Tensor, logits: Tensor, tree: MedusaTree) -> Tensor:
    """bool (N,): node i is its parent's argmax. tokens (N,), logits (N, V)."""
    best = logits.argmax(-1)  # (N,)
    ok = tokens[1:] == best[tree.parents[1:]]
    return torch.cat([torch.ones(1, dtype=torch.bool), ok])


def typical_accepts(
    tokens: Tensor, logits: Tensor, tree: MedusaTree, params: SamplingParams, epsilon: float, delta: float
) -> Tensor:
    """bool (N,): p(node | parent) > min(epsilon, delta * exp(-H(p))), Medusa's typical acceptance."""
    probs = filter_logits(logits, params).softmax(-1)  # (N, V)
    entropy = -(probs * probs.clamp(min=1e-12).log()).sum(-1)  # (N,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    parents = torch.tensor(tree.parents[1:])
    ok = probs[parents, tokens[1:]] > threshold[parents]
    return torch.cat([torch.ones(1, dtype=torch.bool), ok])


def longest_accepted_path(accepts: Tensor, tree: MedusaTree) -> list[int]:
    """The deepest node whose whole path is accepted -> its path [0, ..., node] of node
    indices."""
    alive = accepts.clone()
    for i in range(1, len(tree)):  # parents come before children
        alive[i] &= alive[tree.parents[i]]
    node = int((tree.depths * alive).argmax())  # the first deepest live node
    path = [node]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


# ---------------------------------------------------------------------------------------------
# Decoding


class MedusaDecoder:
    """The base model, its heads, the candidate tree and the KV cache; one ``step`` per forward.

    The cache holds every token but the last (the root of the next tree); ``head_logits`` (depth, V)
    are the guesses, of as many heads as the tree is deep, for the tokens after the root.
    """

    def __init__(
        self,
        model: Transformer,
        heads: MedusaHeads,
        tree: MedusaTree,
        fwd: CachedForward | CompiledForward,
        accepts: Callable[[Tensor, Tensor], Tensor],
    ):
        self.model, self.heads, self.tree, self.fwd, self.accepts = model, heads, tree, fwd, accepts
        self.mask = tree.attention_mask().to(model.device)  # (N, N)
        self.head_logits: Tensor | None = None

    def prefill(self, prompt: list[int]) -> Tensor:
        """Run the prompt; return the next-token logits (V,)."""
        ids = torch.tensor([prompt], device=self.model.device)
        logits, hidden = self.fwd(ids, last_only=True, return_hidden=True)
        self.head_logits = self.heads(hidden[0, -1], self.model.lm_head, self.tree.depth)  # (depth, V)
        return logits[0, -1]

    def step(self, root: int) -> tuple[list[int], Tensor]:
        """One forward over the tree below ``root``; keep the accepted path in the cache.
        Returns the accepted candidate tokens and the next-token logits (V,) after them."""
        tokens = self.tree.tokens(root, self.head_logits).to(self.model.device)  # (N,)
        self.last_tokens = tokens.tolist()
        start = self.fwd.length
        positions = (start + self.tree.depths)[None].to(self.model.device)  # (1, N): prefix length + depth
        logits, hidden = self.fwd(tokens[None], positions, tree_mask=self.mask, return_hidden=True)
        path = longest_accepted_path(self.accepts(tokens, logits[0]), self.tree)  # node ids, root first
        self.last_path = path
        self.fwd.keep_slots(start, [start + i for i in path])
        last = path[-1]
        self.head_logits = self.heads(hidden[0, last], self.model.lm_head, self.tree.depth)
        return tokens[path[1:]].tolist(), logits[0, last]


@dataclass(frozen=True)
class MedusaOptions:
    """How ``medusa_generate`` builds and accepts its candidates."""

    tree: MedusaTree | tuple[int, ...] = DEFAULT_TREE  # a MedusaTree, or top-k per head for MedusaTree.product
    acceptance: str = "greedy"  # "greedy" (lossless) or "typical" (samples; not lossless)
    sampling: SamplingParams = SamplingParams()  # typical acceptance needs a temperature > 0
    epsilon: float = 0.09  # typical acceptance: a node passes when p > min(epsilon, delta * exp(-entropy))
    delta: float = 0.3

    def __post_init__(self) -> None:
        if not isinstance(self.tree, MedusaTree):
            object.__setattr__(self, "tree", MedusaTree.product(tuple(self.tree)))
        if self.acceptance not in ("greedy", "typical"):
            raise ValueError(f"acceptance must be 'greedy' or 'typical', got {self.acceptance!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.acceptance == "typical" and self.sampling.greedy:
            raise ValueError(
                "typical acceptance samples: give sampling a temperature > 0 (greedy acceptance is the greedy mode)"
            )
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def acceptance_rule(options: MedusaOptions) -> Callable[[Tensor, Tensor], Tensor]:
    """(tokens (N,), logits (N, V)) -> which nodes pass, for "greedy" or "typical" acceptance."""
    tree = options.tree
    if options.acceptance == "greedy":
        return lambda tokens, logits: greedy_accepts(tokens, logits, tree)
    return lambda tokens, logits: typical_accepts(
        tokens, logits, tree, options.sampling, options.epsilon, options.delta
    )


def check_fits(prompt: list[int], max_new_tokens: int, tree: MedusaTree, heads: MedusaHeads, config) -> None:
    check_request([prompt], max_new_tokens, config)
    if tree.depth > heads.n_heads:
        raise ValueError(f"the tree is {tree.depth} levels deep but there are only {heads.n_heads} heads")
    if len(prompt) + max_new_tokens + len(tree) > config.max_seq_len:
        raise ValueError(
            f"prompt of {len(prompt)} + {max_new_tokens} new tokens + a tree of {len(tree)} exceeds "
            f"max_seq_len={config.max_seq_len}; use a smaller tree or fewer tokens"
        )


@torch.inference_mode()
def medusa_generate(
    model: Transformer,
    heads: MedusaHeads,
    input_ids,
    max_new_tokens: int,
    options: MedusaOptions | None = None,
    eos_token_id="config",
    trace: list | None = None,
    compile: bool = False,
) -> DecodingResult:
    """Medusa decoding with tree verification. Greedy acceptance (the default ``MedusaOptions``) is
    lossless (the tokens of greedy ``generate``); typical acceptance samples and is not (see the
    module). A ``trace`` list gets one dict per step: the tree's tokens, the accepted path (node ids)
    and the tokens emitted. ``compile=True`` verifies each tree through one compiled graph, compiled
    before the timer starts."""
    options = options or MedusaOptions()
    tree, params = options.tree, options.sampling
    accepts = acceptance_rule(options)
    prompt = single_prompt(input_ids)
    check_fits(prompt, max_new_tokens, tree, heads, model.config)
    eos, generator = set(resolve_eos(eos_token_id, model.config)), params.generator(model.device)
    stats = DecodingStats(tree.depth, target_forwards=1)  # the prefill makes the first token
    fwd = cached_forward(model, 1, len(prompt) + max_new_tokens + len(tree), compile, widths=(len(tree),))
    decoder = MedusaDecoder(model, heads, tree, fwd, accepts)
    compile_time = warm_up([fwd], [len(tree)], tree_mask=decoder.mask)
    synchronize(model.device)
    t0 = time.perf_counter()
    new = [next_token(decoder.prefill(prompt), params, generator)]
    while len(new) < max_new_tokens and new[-1] not in eos:
        accepted, logits = decoder.step(new[-1])
        emitted = stop_at_eos(accepted + [next_token(logits, params, generator)], eos)[: max_new_tokens - len(new)]
        if trace is not None:
            trace.append({"tokens": decoder.last_tokens, "path": decoder.last_path, "emitted": emitted})
        stats.record(tree.depth, len(accepted), len(emitted))
        new += emitted
    stats.new_tokens = len(new)
    synchronize(model.device)
    return DecodingResult(torch.tensor([new]), stats, time.perf_counter() - t0, compile_time, fwd.forward_seconds)


def next_token(logits: Tensor, params: SamplingParams, generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(filter_logits(logits, params).softmax(-1), 1, generator=generator))
