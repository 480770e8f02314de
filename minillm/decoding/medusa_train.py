"""Training Medusa heads (Cai et al. 2024, Medusa-1): the base model frozen, the heads trained on
text the base model generated itself (self-distillation), with cross-entropy on its greedy tokens.

Here: the training options (``MedusaTrainConfig``), the self-distilled data, each head's targets
and loss, the training loop (``fit_heads``, ``train_medusa``: ``python -m minillm train medusa``),
and how often each head is right (``head_accuracy``, ``head_topk_accuracy``). The heads
themselves and decoding with them are in ``medusa``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.checkpoints import load, resolve
from ..core.device import hardware_description
from ..core.generate import generate
from ..core.model import Transformer
from ..training.corpus import corpus_prompts
from .medusa import MedusaHeads


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

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_sequences", "prompt_len", "new_tokens", "steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


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


def train_medusa(
    model_name: str = "minillm-target",
    out_dir: Path | None = None,
    tc: MedusaTrainConfig | None = None,
    progress: bool = True,
) -> Path:
    """Train Medusa heads for a checkpoint and save them beside it (or in ``out_dir``)."""
    tc = tc or MedusaTrainConfig()
    directory = resolve(model_name)
    model, tokenizer = load(directory, device="cpu")
    torch.manual_seed(tc.seed)
    t0 = time.perf_counter()
    bar = tqdm(total=tc.n_sequences, desc="generating", unit="seq", disable=not progress)
    prompts = torch.tensor(corpus_prompts(tokenizer, tc.n_sequences, tc.prompt_len, "train", "random", tc.seed))
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
    meta = {
        "base_model": directory.name,
        "parameters": heads.num_params(),
        "vocab_projection": "the base model's lm_head, shared by every head and frozen",
        "train_config": asdict(tc),
        "seconds": round(time.perf_counter() - t0, 1),
        "hardware": hardware_description(),
        "valid_top1_accuracy": [round(a, 4) for a in accuracy],
        "final_train_loss": losses[-1],
        "train_loss_every_10": losses[::10],
    }
    out = Path(out_dir) if out_dir else directory
    out.mkdir(parents=True, exist_ok=True)
    heads.save(out, meta)
    return out


# ---------------------------------------------------------------------------------------------
# Looking at the heads


def shifted_targets(seqs: Tensor, shift: int, prompt_len: int) -> Tensor:
    """(B, T): seqs[:, t + shift], -100 past the end or where that token is in the prompt."""
    B, T = seqs.shape
    targets = torch.full((B, T), -100, dtype=torch.long)
    targets[:, : max(0, T - shift)] = seqs[:, shift:]
    targets[:, : max(0, prompt_len - shift)] = -100
    return targets


@torch.no_grad()
def head_topk_accuracy(
    model: Transformer,
    heads: MedusaHeads,
    seqs: Tensor,
    prompt_len: int,
    ks: tuple[int, ...] = (1, 5),
    batch_size: int = 8,
) -> dict[int, list[float]]:
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
