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

Batch size 1 only: rows of a batch would accept different paths.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..core.cache import KVCache
from ..core.checkpoints import load, resolve
from ..core.device import hardware_description, synchronize
from ..core.generate import check_request, generate, resolve_eos
from ..core.model import Transformer
from ..core.sampling import SamplingParams, filter_logits
from ..core.tokenizer import Tokenizer
from ..training import corpus
from .speculative import DecodingResult, DecodingStats, single_prompt, stop_at_eos

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
        n heads (all K by default). Each head costs a vocabulary projection: ask only for those used."""
        return torch.stack([lm_head(block(hidden)) for block in self.blocks[:n]])

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
        """The candidate tokens (N,): the root, then each node from its head's top-k; head_logits (K, V)."""
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


def typical_accepts(tokens: Tensor, logits: Tensor, tree: MedusaTree, params: SamplingParams,
                    epsilon: float, delta: float) -> Tensor:  # fmt: skip
    """bool (N,): p(node | parent) > min(epsilon, delta * exp(-H(p))), Medusa's typical acceptance."""
    probs = filter_logits(logits, params).softmax(-1)  # (N, V)
    entropy = -(probs * probs.clamp(min=1e-12).log()).sum(-1)  # (N,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    parents = torch.tensor(tree.parents[1:])
    ok = probs[parents, tokens[1:]] > threshold[parents]
    return torch.cat([torch.ones(1, dtype=torch.bool), ok])


def longest_accepted_path(accepts: Tensor, tree: MedusaTree) -> list[int]:
    """The deepest node whose whole path is accepted -> its path [0, ..., node] of node indices."""
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

    def __init__(self, model: Transformer, heads: MedusaHeads, tree: MedusaTree, cache: KVCache,
                 accepts: Callable[[Tensor, Tensor], Tensor]):  # fmt: skip
        self.model, self.heads, self.tree, self.cache, self.accepts = model, heads, tree, cache, accepts
        self.mask = tree.attention_mask().to(model.device)  # (N, N)
        self.head_logits: Tensor | None = None

    def prefill(self, prompt: list[int]) -> Tensor:
        """Run the prompt; return the next-token logits (V,)."""
        ids = torch.tensor([prompt], device=self.model.device)
        logits, hidden = self.model(ids, cache=self.cache, last_only=True, return_hidden=True)
        self.head_logits = self.heads(hidden[0, -1], self.model.lm_head, self.tree.depth)  # (depth, V)
        return logits[0, -1]

    def step(self, root: int) -> tuple[list[int], Tensor]:
        """One forward over the tree below ``root``; keep the accepted path in the cache.
        Returns the accepted candidate tokens and the next-token logits (V,) after them."""
        tokens = self.tree.tokens(root, self.head_logits).to(self.model.device)  # (N,)
        self.last_tokens = tokens.tolist()
        start = self.cache.length
        positions = (start + self.tree.depths)[None].to(self.model.device)  # (1, N): prefix length + depth
        logits, hidden = self.model(tokens[None], positions, self.cache, tree_mask=self.mask, return_hidden=True)
        path = longest_accepted_path(self.accepts(tokens, logits[0]), self.tree)  # node ids, root first
        self.last_path = path
        self.cache.keep_slots(start, [start + i for i in path])
        last = path[-1]
        self.head_logits = self.heads(hidden[0, last], self.model.lm_head, self.tree.depth)
        return tokens[path[1:]].tolist(), logits[0, last]


def acceptance_rule(acceptance: str, tree: MedusaTree, params: SamplingParams, epsilon: float,
                    delta: float) -> Callable[[Tensor, Tensor], Tensor]:  # fmt: skip
    """(tokens (N,), logits (N, V)) -> which nodes pass, for "greedy" or "typical" acceptance."""
    if acceptance == "greedy":
        return lambda tokens, logits: greedy_accepts(tokens, logits, tree)
    if acceptance == "typical":
        if params.greedy:
            raise ValueError(
                "typical acceptance samples: give a temperature > 0 (greedy acceptance is the greedy mode)"
            )
        return lambda tokens, logits: typical_accepts(tokens, logits, tree, params, epsilon, delta)
    raise ValueError(f"acceptance must be 'greedy' or 'typical', got {acceptance!r}")


def check_fits(prompt: list[int], max_new_tokens: int, tree: MedusaTree, heads: MedusaHeads, config) -> None:
    check_request([prompt], max_new_tokens, config)
    if tree.depth > heads.n_heads:
        raise ValueError(f"the tree is {tree.depth} levels deep but there are only {heads.n_heads} heads")
    if len(prompt) + max_new_tokens + len(tree) > config.max_seq_len:
        raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens + a tree of {len(tree)} exceeds "
                         f"max_seq_len={config.max_seq_len}; use a smaller tree or fewer tokens")  # fmt: skip


@torch.inference_mode()
def medusa_generate(model: Transformer, heads: MedusaHeads, input_ids, max_new_tokens: int,
                    tree: MedusaTree | tuple[int, ...] = DEFAULT_TREE, acceptance: str = "greedy",
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None, epsilon: float = 0.09, delta: float = 0.3,
                    eos_token_id="config", trace: list | None = None) -> DecodingResult:  # fmt: skip
    """Medusa decoding with tree verification. ``acceptance="greedy"`` is lossless (the tokens of
    greedy ``generate``); ``"typical"`` samples with ``temperature`` and is not (see the module).
    ``tree``: a MedusaTree, or top-k per head for ``MedusaTree.product``. A ``trace`` list gets
    one dict per step: the tree's tokens, the accepted path (node ids) and the tokens emitted."""
    tree = tree if isinstance(tree, MedusaTree) else MedusaTree.product(tuple(tree))
    params = SamplingParams(temperature, top_k, top_p, seed)
    accepts = acceptance_rule(acceptance, tree, params, epsilon, delta)
    prompt = single_prompt(input_ids)
    check_fits(prompt, max_new_tokens, tree, heads, model.config)
    eos, generator = set(resolve_eos(eos_token_id, model.config)), params.generator(model.device)
    stats = DecodingStats(tree.depth, target_forwards=1)  # the prefill makes the first token
    synchronize(model.device)
    t0 = time.perf_counter()
    cache = KVCache.for_model(model, 1, len(prompt) + max_new_tokens + len(tree))
    decoder = MedusaDecoder(model, heads, tree, cache, accepts)
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
    return DecodingResult(torch.tensor([new]), stats, time.perf_counter() - t0)


def next_token(logits: Tensor, params: SamplingParams, generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(filter_logits(logits, params).softmax(-1), 1, generator=generator))


# ---------------------------------------------------------------------------------------------
# Training the heads


@dataclass
class MedusaTrainConfig:
    n_heads: int = 4
    n_sequences: int = 384  # self-generated sequences
    prompt_len: int = 32  # corpus tokens each sequence starts from
    new_tokens: int = 96  # tokens the base model writes after each prompt (greedy)
    steps: int = 300
    batch_size: int = 8  # sequences per step
    lr: float = 3e-3
    seed: int = 0


def corpus_windows(tokenizer: Tokenizer, n: int, length: int, seed: int, split: str = "train") -> Tensor:
    """(n, length) token windows starting at random places of the corpus' ``split``."""
    text = corpus.load_text(split)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - 16 * length, (n,), generator=gen).tolist()
    windows = [tokenizer.encode(text[s : s + 16 * length])[1 : 1 + length] for s in starts]  # [0] is <|endoftext|>
    return torch.tensor(windows)


@torch.no_grad()
def self_distillation_data(model: Transformer, prompts: Tensor, tc: MedusaTrainConfig, progress=None) -> Tensor:
    """(n_sequences, prompt_len + new_tokens): the prompts continued greedily by the model itself."""
    rows = []
    for batch in prompts.split(32):
        out = generate(model, batch.to(model.device), tc.new_tokens, eos_token_id=None).tokens
        rows.append(torch.cat([batch, out], dim=1))
        if progress is not None:
            progress(len(batch))
    return torch.cat(rows)


def head_targets(seqs: Tensor, n_heads: int, prompt_len: int) -> Tensor:
    """(K, B, T) targets: head k at position t predicts seqs[t + 1 + k]; -100 where it falls
    outside the sequence or on the corpus prompt (only the model's own text is learned)."""
    B, T = seqs.shape
    targets = torch.full((n_heads, B, T), -100, dtype=torch.long)
    for k in range(1, n_heads + 1):
        targets[k - 1, :, : T - 1 - k] = seqs[:, 1 + k :]
        targets[k - 1, :, : max(0, prompt_len - 1 - k)] = -100
    return targets


@torch.no_grad()
def final_hidden(model: Transformer, seqs: Tensor, batch_size: int = 32) -> Tensor:
    """The frozen base model's final normed hidden states (B, T, D), computed once for training."""
    return torch.cat([model(b.to(model.device), return_hidden=True)[1] for b in seqs.split(batch_size)])


def head_loss(heads: MedusaHeads, lm_head: nn.Linear, hidden: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of each head (K,): hidden (B, T, D), targets (K, B, T)."""
    logits = heads(hidden, lm_head)  # (K, B, T, V)
    losses = F.cross_entropy(logits.flatten(1, 2).transpose(1, 2), targets.flatten(1), reduction="none")
    valid = (targets.flatten(1) != -100).sum(1).clamp(min=1)  # (K,)
    return losses.sum(1) / valid


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, lm_head: nn.Linear, hidden: Tensor, targets: Tensor) -> list[float]:
    """Top-1 accuracy of each head against its targets: a first estimate of its acceptance."""
    best = heads(hidden, lm_head).argmax(-1)  # (K, B, T)
    valid = targets != -100
    return ((best == targets) & valid).flatten(1).sum(1).div(valid.flatten(1).sum(1)).tolist()


def fit_heads(model: Transformer, heads: MedusaHeads, seqs: Tensor, tc: MedusaTrainConfig, bar=None) -> list[float]:
    """AdamW with cosine decay on the heads only (the base model frozen); returns the loss per step."""
    model.requires_grad_(False)
    hidden, targets = final_hidden(model, seqs), head_targets(seqs, heads.n_heads, tc.prompt_len)
    opt = torch.optim.AdamW(heads.parameters(), lr=tc.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, tc.steps, eta_min=tc.lr / 10)
    gen, losses = torch.Generator().manual_seed(tc.seed), []
    heads.train()
    for _ in range(tc.steps):
        idx = torch.randint(0, len(seqs), (tc.batch_size,), generator=gen)
        loss = head_loss(heads, model.lm_head, hidden[idx], targets[:, idx]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(round(loss.item(), 4))
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
    heads.eval()
    return losses


def train_medusa(model_name: str = "minillm-target", out_dir: Path | None = None,
                 tc: MedusaTrainConfig | None = None, progress: bool = True) -> Path:  # fmt: skip
    """Train Medusa heads for a checkpoint and save them beside it (or in ``out_dir``)."""
    from tqdm.auto import tqdm

    tc = tc or MedusaTrainConfig()
    directory = resolve(model_name)
    model, tokenizer = load(directory, device="cpu")
    torch.manual_seed(tc.seed)
    t0 = time.perf_counter()
    bar = tqdm(total=tc.n_sequences, desc="generating", unit="seq", disable=not progress)
    prompts = corpus_windows(tokenizer, tc.n_sequences, tc.prompt_len, tc.seed)
    seqs = self_distillation_data(model, prompts, tc, bar.update)
    bar.close()
    n_valid = max(1, len(seqs) // 10)
    train, valid = seqs[n_valid:], seqs[:n_valid]
    heads = MedusaHeads(model.config.dim, tc.n_heads)
    bar = tqdm(total=tc.steps, desc="training heads", unit="step", disable=not progress)
    losses = fit_heads(model, heads, train, tc, bar)
    bar.close()
    accuracy = head_accuracy(
        heads, model.lm_head, final_hidden(model, valid), head_targets(valid, tc.n_heads, tc.prompt_len)
    )
    meta = {"base_model": directory.name, "parameters": heads.num_params(),
            "vocab_projection": "the base model's lm_head, shared by every head and frozen",
            "train_config": asdict(tc), "seconds": round(time.perf_counter() - t0, 1),
            "hardware": hardware_description(), "valid_top1_accuracy": [round(a, 4) for a in accuracy],
            "final_train_loss": losses[-1], "train_loss_every_10": losses[::10]}  # fmt: skip
    out = Path(out_dir) if out_dir else directory
    out.mkdir(parents=True, exist_ok=True)
    heads.save(out, meta)
    return out


# ---------------------------------------------------------------------------------------------
# Looking at the heads and the tree


def shifted_targets(seqs: Tensor, shift: int, prompt_len: int) -> Tensor:
    """(B, T): seqs[:, t + shift], -100 past the end or where that token is in the prompt."""
    B, T = seqs.shape
    targets = torch.full((B, T), -100, dtype=torch.long)
    targets[:, : max(0, T - shift)] = seqs[:, shift:]
    targets[:, : max(0, prompt_len - shift)] = -100
    return targets


@torch.no_grad()
def head_topk_accuracy(model: Transformer, heads: MedusaHeads, seqs: Tensor, prompt_len: int,
                       ks: tuple[int, ...] = (1, 5), batch_size: int = 8) -> dict[int, list[float]]:  # fmt: skip
    """{k: accuracies}: how often the right token is among the top k of the base LM head (entry 0,
    the next token) and of each Medusa head (entry i, the token i further on), scored on the
    tokens of ``seqs`` (B, T) after the first ``prompt_len``."""
    hits, counts = torch.zeros(len(ks), heads.n_heads + 1), torch.zeros(heads.n_heads + 1)
    for batch in seqs.split(batch_size):
        hidden = final_hidden(model, batch)  # (b, T, D)
        logits = torch.cat([model.lm_head(hidden)[None], heads(hidden, model.lm_head)])  # (K+1, b, T, V)
        top = logits.topk(max(ks), dim=-1).indices.cpu()  # (K+1, b, T, max k)
        targets = torch.stack([shifted_targets(batch, 1 + i, prompt_len) for i in range(heads.n_heads + 1)])
        valid = targets != -100  # (K+1, b, T)
        counts += valid.flatten(1).sum(1)
        for j, k in enumerate(ks):
            found = (top[..., :k] == targets[..., None]).any(-1) & valid
            hits[j] += found.flatten(1).sum(1)
    return {k: (hits[j] / counts.clamp(min=1)).tolist() for j, k in enumerate(ks)}


def tree_layout(tree: MedusaTree) -> list[tuple[float, float]]:
    """(x, y) of each node for a drawing: x its depth, leaves one unit apart, a parent centred on its children."""
    children = [[] for _ in range(len(tree))]
    for i, p in enumerate(tree.parents[1:], start=1):
        children[p].append(i)
    y, next_leaf = [0.0] * len(tree), [0.0]

    def place(i: int) -> float:
        if children[i]:
            y[i] = sum(place(c) for c in children[i]) / len(children[i])
        else:
            y[i], next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        return y[i]

    place(0)
    return [(float(tree.depths[i]), -y[i]) for i in range(len(tree))]


def draw_tree(tree: MedusaTree, labels: list[str] | None = None, accepted: list[int] | None = None,
              title: str = "", ax=None):  # fmt: skip
    """The candidate tree, root at the left, one column per head; ``labels`` per node (default: its
    path), the ``accepted`` path (node ids) in green."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * (tree.depth + 1), 0.32 * len(tree) + 1))
    xy, on_path = tree_layout(tree), set(accepted or [])
    labels = labels or ["root", *("".join(map(str, p)) for p in tree.paths[1:])]
    for i, p in enumerate(tree.parents[1:], start=1):
        good = i in on_path and p in on_path
        ax.plot([xy[p][0], xy[i][0]], [xy[p][1], xy[i][1]], color="tab:green" if good else "0.7",
                lw=2.5 if good else 1, zorder=1)  # fmt: skip
    for i, (x, y) in enumerate(xy):
        color = "#c7e9c0" if i in on_path else "white"
        ax.text(x, y, f"{i}: {labels[i]}", ha="center", va="center", fontsize=8, zorder=2,
                bbox={"boxstyle": "round", "fc": color, "ec": "tab:green" if i in on_path else "0.5"})  # fmt: skip
    ax.set_xticks(range(tree.depth + 1), ["root\n(last token)"] + [f"head {d} top-{k}" for d, k in
                                                                   enumerate(tree.top_k, 1)])  # fmt: skip
    ax.set_yticks([])
    ax.set_xlim(-0.6, tree.depth + 0.6)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    return ax


def plot_mask(mask: Tensor, labels: list[str] | None = None, title: str = "", ax=None):
    """A boolean attention mask as a picture: row i is what token i may see (dark = attends)."""
    import matplotlib.pyplot as plt

    n = mask.shape[0]
    if ax is None:
        _, ax = plt.subplots(figsize=(0.22 * n + 1.5, 0.22 * n + 1.2))
    ax.imshow(mask.cpu().numpy(), cmap="Greys", vmin=0, vmax=1.3)
    ticks = labels or [str(i) for i in range(n)]
    ax.set_xticks(range(n), ticks, rotation=90, fontsize=6)
    ax.set_yticks(range(n), ticks, fontsize=6)
    ax.set(xlabel="key (token attended to)", ylabel="query (token attending)", title=title)
    ax.grid(False)
    return ax
