"""Training the bundled models: a byte-level BPE tokenizer and two Llama-shaped decoders.

``python -m minillm train tokenizer`` and ``python -m minillm train model --size target|draft``
reproduce the checkpoints under ``minillm/bundled``: fixed seeds, a fixed number of steps, the
committed corpus. Plain next-token prediction with AdamW, linear warmup and cosine decay.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm

from ..core.checkpoints import BUNDLED_DIR, load, save_pretrained
from ..core.config import ModelConfig
from ..core.device import hardware_description
from ..core.generate import generate
from ..core.model import Transformer
from ..core.tokenizer import Tokenizer
from . import corpus

TOKENIZER_DIR = BUNDLED_DIR.parent / "data" / "tokenizer"
VOCAB_SIZE = 4096
# A minimal chat template, so that chat clients can talk to the bundled models: they were trained on
# documentation and source, never on dialogues, so their answers read like their corpus, not like
# an assistant's. Each message is "role: content" on its own line after the document separator.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(vocab_size: int = VOCAB_SIZE, out_dir: Path = TOKENIZER_DIR) -> Tokenizer:
    """Byte-level BPE on the training split. ``<|endoftext|>`` separates documents, and the
    tokenizer puts it in front of every encoded text, as the start of a document."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[corpus.EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.documents("train"), trainer)
    eot = tok.token_to_id(corpus.EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{corpus.EOT} $A", pair=f"{corpus.EOT} $A {corpus.EOT} $B", special_tokens=[(corpus.EOT, eot)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped = Tokenizer(tok, bos_token=corpus.EOT, eos_token=corpus.EOT, chat_template=CHAT_TEMPLATE)
    wrapped.save(out_dir)
    return wrapped


def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TOKENIZER_DIR)


def encode_split(tokenizer: Tokenizer, split: str) -> torch.Tensor:
    """The whole split as one stream of ids, each document preceded by <|endoftext|>."""
    ids: list[int] = []
    for doc in corpus.documents(split):
        ids.extend(tokenizer.encode(doc))
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    seed: int = 0


_BUNDLED = dict(vocab_size=VOCAB_SIZE, max_seq_len=1024, tie_embeddings=True, bos_token_id=0, eos_token_id=0)
BUNDLED_SHAPES = {
    # ~6M parameters: MHA, so that chapter 5 can convert it to GQA/MQA and measure the cost.
    "target": ModelConfig(name="minillm-target", dim=256, n_layers=6, n_heads=8, ffn_dim=704, **_BUNDLED),
    # ~10x fewer parameters, the same tokenizer: the draft model of chapters 7-9.
    "draft": ModelConfig(name="minillm-draft", dim=96, n_layers=2, n_heads=4, ffn_dim=256, **_BUNDLED),
}
BUNDLED_TRAINING = {
    "target": TrainConfig(steps=850, batch_size=24, seq_len=256, lr=3e-3, warmup=50, eval_every=170),
    "draft": TrainConfig(steps=1200, batch_size=24, seq_len=256, lr=4e-3, eval_every=150),
}


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: Transformer, ids: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``ids``."""
    model.eval()
    n = (len(ids) - 1) // seq_len
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch_size):
        logits = model(x[i : i + batch_size])
        total += F.cross_entropy(logits.flatten(0, 1).float(), y[i : i + batch_size].flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def train_model(
    config: ModelConfig,
    tc: TrainConfig,
    train_ids: torch.Tensor,
    valid_ids: torch.Tensor,
    progress: bool = True,
) -> tuple[Transformer, dict]:
    """Train from scratch on random windows of ``train_ids``; return the model and a log."""
    torch.manual_seed(tc.seed)
    model = Transformer(config).init_weights(seed=tc.seed)
    return model, fit(model, tc, train_ids, valid_ids, progress)


def adamw(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW at ``tc.lr``, betas (0.9, 0.95), weight decay on the matrices only (not on norm gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )


def random_windows(
    ids: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows at random places of ``ids``: inputs x and next tokens y, (batch_size, seq_len) each."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator).tolist()
    x = torch.stack([ids[s : s + seq_len] for s in starts])
    y = torch.stack([ids[s + 1 : s + seq_len + 1] for s in starts])
    return x, y


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, tc: TrainConfig):
    """One update at learning rate ``lr``: backward, gradient norm clipped to ``tc.grad_clip``, step."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()


def eval_due(step: int, tc: TrainConfig) -> bool:
    """Whether to evaluate after ``step`` (0-based): every ``tc.eval_every`` steps and after the last."""
    return (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps


def fit(
    model: Transformer,
    tc: TrainConfig,
    train_ids: torch.Tensor,
    valid_ids: torch.Tensor | None = None,
    progress: bool = True,
) -> dict:
    """AdamW with warmup and cosine decay on random windows of ``train_ids``; the model is left in
    eval mode. Returns the log: train loss per step, validation loss every ``eval_every`` steps."""
    model.train()
    opt = adamw(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    log: dict = {"train_loss": [], "valid_loss": []}
    t0 = time.perf_counter()
    bar = tqdm(range(tc.steps), disable=not progress, desc=model.config.name, unit="step")
    for step in bar:
        x, y = random_windows(train_ids, tc.seq_len, tc.batch_size, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer_step(model, opt, loss, lr_at(step, tc), tc)
        log["train_loss"].append(round(loss.item(), 4))
        if valid_ids is not None and eval_due(step, tc):
            val = evaluate(model, valid_ids, tc.seq_len)
            log["valid_loss"].append([step + 1, round(val, 4)])
            bar.set_postfix(loss=f"{loss.item():.3f}", valid=f"{val:.3f}")
    log["seconds"] = round(time.perf_counter() - t0, 1)
    model.eval()
    return log


def train_bundled(size: str, out_dir: Path | None = None, steps: int | None = None, progress: bool = True) -> Path:
    """Train one of the bundled models ("target" or "draft") and save it in HF layout."""
    if size not in BUNDLED_SHAPES:
        raise ValueError(f"size must be one of {sorted(BUNDLED_SHAPES)}, got {size!r}")
    config, tc = BUNDLED_SHAPES[size], BUNDLED_TRAINING[size]
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if steps is not None:
        tc = TrainConfig(**{**asdict(tc), "steps": steps, "eval_every": min(tc.eval_every, steps)})
    tokenizer = load_tokenizer()
    train_ids, valid_ids = encode_split(tokenizer, "train"), encode_split(tokenizer, "valid")
    model, log = train_model(config, tc, train_ids, valid_ids, progress=progress)
    out_dir = Path(out_dir) if out_dir else BUNDLED_DIR / config.name
    record = training_record(model, tc, train_ids, valid_ids, log)
    save_pretrained(model, out_dir, tokenizer, {"training_log.json": json.dumps(record) + "\n"})
    write_model_card(out_dir)
    return out_dir


def training_record(
    model: Transformer, tc: TrainConfig, train_ids: torch.Tensor, valid_ids: torch.Tensor, log: dict
) -> dict:
    """What training_log.json holds (the model card reads it): the recipe, the data, the machine, the log."""
    return {
        "model": model.config.name,
        "parameters": model.num_params(),
        "train_config": asdict(tc),
        "train_tokens": len(train_ids),
        "valid_tokens": len(valid_ids),
        "hardware": hardware_description(),
        "final_valid_loss": log["valid_loss"][-1][1],
        **log,
    }


@torch.no_grad()
def argmax_agreement(draft: Transformer, target: Transformer, ids: torch.Tensor, seq_len: int = 256) -> float:
    """Fraction of positions where two models' argmax next tokens agree, over windows of ``ids``.

    A first estimate of the greedy acceptance rate of speculative decoding with this pair."""
    n = len(ids) // seq_len
    x = ids[: n * seq_len].view(n, seq_len)
    agree = sum((draft(b).argmax(-1) == target(b).argmax(-1)).sum().item() for b in x.split(16))
    return agree / x.numel()


def write_model_card(
    directory: Path,
    sample_prompt: str = "def read_config(path):",
    compare_with: str | None = None,
    reproduce: str | None = None,
    notes: str = "",
) -> str:
    """README.md for a bundled model, every figure read from its training log or measured here.

    ``compare_with`` names another model (e.g. the target of a draft) whose greedy next-token
    agreement with this one on the validation split is reported. ``reproduce`` is the command
    that retrains it (default: ``python -m minillm train model --size ...``); ``notes``, markdown
    put before the sample."""
    directory = Path(directory)
    log = json.loads((directory / "training_log.json").read_text())
    model, tok = load(directory, device="cpu")
    c, tc = model.config, log["train_config"]
    retrain = "python -m minillm train model --size " + c.name.removeprefix("minillm-")
    valid = encode_split(tok, "valid")
    loss = evaluate(model, valid, tc["seq_len"])
    lines = [
        f"# {c.name}",
        "",
        f"A {log['parameters'] / 1e6:.2f}M-parameter Llama-architecture model trained from scratch for the "
        "minillm book. It is small enough to train on a laptop CPU and large enough to generate text that "
        'looks like its corpus. Load it with `minillm.load("' + c.name + '")` or, as a LlamaForCausalLM, '
        "with transformers.",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | {c.n_layers} layers, d_model {c.dim}, {c.n_heads} heads ({c.n_kv_heads} KV heads), "
        f"SwiGLU {c.ffn_dim}, RoPE theta {c.rope_theta:g}, tied embeddings |",
        f"| parameters | {log['parameters']:,} |",
        f"| context | trained on {tc['seq_len']}-token windows; RoPE lets it run to max_seq_len {c.max_seq_len}, "
        f"but text is best within the first {tc['seq_len']} positions |",
        f"| tokenizer | byte-level BPE, {c.vocab_size} tokens, shared by minillm-target and minillm-draft |",
        "| corpus | CPython 3.11's pydoc reference topics (English prose) and its top-level standard-library "
        "modules (Python source); see minillm/data/pystdlib |",
        "| license | PSF License Agreement (the corpus's); see minillm/data/pystdlib/LICENSE.txt |",
        f"| training | {tc['steps']} steps x {tc['batch_size']} x {tc['seq_len']} tokens "
        f"({tc['steps'] * tc['batch_size'] * tc['seq_len'] / 1e6:.1f}M tokens, "
        f"{tc['steps'] * tc['batch_size'] * tc['seq_len'] / log['train_tokens']:.1f} epochs of "
        f"{log['train_tokens'] / 1e6:.2f}M), AdamW, peak lr {tc['lr']:g}, cosine, seed {tc['seed']} |",
        f"| training time | {log['seconds'] / 60:.1f} min on {log['hardware']} |",
        f"| validation loss | {loss:.3f} nats/token (perplexity {math.exp(loss):.1f}) on "
        f"{log['valid_tokens']:,} held-out tokens |",
        "",
        f"Reproduce: `{reproduce or retrain}`.",
    ]
    if compare_with is not None:
        other, _ = load(compare_with, device="cpu")
        agreement = argmax_agreement(model, other, valid, tc["seq_len"])
        lines += [
            "",
            f"Greedy next-token agreement with {compare_with} on the validation split: {agreement:.1%} "
            "(a first estimate of the acceptance rate of greedy speculative decoding).",
        ]
    if notes:
        lines += ["", notes.strip()]
    lines += [
        "",
        "## Sample (temperature 0.8, top-p 0.95, seed 0, 80 tokens)",
        "",
        "```python",
        sample_prompt + tok.decode(generate(model, tok.encode(sample_prompt), 80, 0.8, top_p=0.95, seed=0).tokens[0]),
        "```",
        "",
    ]
    card = "\n".join(lines)
    (directory / "README.md").write_text(card)
    return card
