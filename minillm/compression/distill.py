"""Knowledge distillation: a small student learns the teacher's whole next-token distribution.

Hinton, Vinyals and Dean (2015), "Distilling the Knowledge in a Neural Network": train the student
on the teacher's *soft targets*, the softmax of its logits at a temperature T > 1, which carry
what the hard label does not (which wrong tokens are nearly right). The loss per position is the
forward KL divergence

    KL(p_T || q_T) = sum_v p_T(v) (log p_T(v) - log q_T(v)),   p_T = softmax(z_teacher / T), q_T likewise,

multiplied by T^2: the gradients of the soft term scale as 1/T^2, and the factor keeps their size
comparable across temperatures (and against the hard-label term, when the two are mixed:
``alpha * T^2 * KL + (1 - alpha) * cross_entropy``).

``top_k`` keeps only the teacher's k largest logits per position, renormalized over those k, so
that stored teacher outputs take k values and k token ids per position instead of V values. The
student's log-probabilities are its *full* log-softmax (over all V tokens), gathered at the k
ids, and not renormalized over them: the loss is then a true KL between the truncated teacher
and the student, >= 0, and still pushes down whatever mass the student puts outside the k
tokens (renormalizing the student too would make that mass free). With k = V it is the full loss.

Kim and Rush (2016), "Sequence-Level Knowledge Distillation", distil at the level of whole
sequences instead: the teacher *writes* text, and the student learns it with plain next-token
cross-entropy. Sampled at temperature 1, the teacher's text is drawn from its own distribution p,
so the student's expected loss on it, E_{y~p}[-log q(y)] = H(p) + KL(p || q), is the forward KL
again, estimated from one sampled token per position instead of read off all V logits; and the
text is generated once, so it costs no teacher forward per training step and serves any number of
epochs.

Here: the loss, ``DistillConfig``, the training loop ``distill`` (the optimizer, schedule and
data order of ``training.train.fit``), ``kl_to_teacher`` to measure a student against its
teacher on held-out text, and ``distill_bundled``, which distils minillm-target into a student of
minillm-draft's shape (``minillm-draft-distilled``); then sequence-level distillation:
``TeacherTextConfig`` and ``teacher_corpus`` (the teacher's text) and ``sequence_distill``
(training on it); ``bench.distill.sequence_distill_comparison`` measures such a student as the
saved ones were (speculative decoding is a layer above this one).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..core.checkpoints import BUNDLED_DIR, load, save_pretrained
from ..core.generate import generate
from ..core.model import Transformer
from ..training.train import (
    BUNDLED_SHAPES,
    TrainConfig,
    adamw,
    argmax_agreement,
    encode_split,
    eval_due,
    evaluate,
    lr_at,
    optimizer_step,
    random_windows,
    training_record,
    write_model_card,
)

TEACHER = "minillm-target"
DISTILLED_NAME = "minillm-draft-distilled"

# ---------------------------------------------------------------------------------------------
# The loss


def teacher_distribution(
    teacher_logits: Tensor, temperature: float, top_k: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """The teacher's log-probabilities at ``temperature``: over the whole vocabulary, (..., V) and
    no indices; or over its ``top_k`` largest logits, renormalized, (..., k) with their token ids
    (..., k). The latter is all a stored teacher output needs to keep."""
    logits = teacher_logits.float() / temperature
    if top_k is None:
        return F.log_softmax(logits, dim=-1), None
    values, indices = logits.topk(top_k, dim=-1)  # (..., k) each
    return F.log_softmax(values, dim=-1), indices


def token_kl(student_logits: Tensor, teacher_log_probs: Tensor, indices: Tensor | None, temperature: float) -> Tensor:
    """KL(teacher || student) at ``temperature`` per position: (..., V) -> (...,).

    With ``indices`` (a top-k teacher), the student's full log-softmax is gathered
    at them."""
    student_log_probs = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (..., V)
    if indices is not None:
        student_log_probs = student_log_probs.gather(-1, indices)  # (..., k)
    return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 2.0,
    top_k: int | None = None,
    alpha: float = 1.0,
    labels: Tensor | None = None,
) -> Tensor:
    """Hinton et al.'s loss, averaged over positions: ``alpha * T^2 * KL(p_T || q_T)`` plus
    ``(1 - alpha)`` times the cross-entropy of the student (at T = 1) with the hard ``labels``.

    student_logits, teacher_logits: (..., V); labels: (...) token ids, needed when alpha < 1.
    The teacher's logits are treated as constants (no gradient flows into them)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have the same shape (the same vocabulary), got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    check_distillation_options(temperature, top_k, alpha, vocab_size=student_logits.shape[-1])
    if alpha < 1 and labels is None:
        raise ValueError(f"labels are needed for the hard-label term when alpha < 1 (alpha={alpha})")
    teacher_log_probs, indices = teacher_distribution(teacher_logits.detach(), temperature, top_k)
    loss = alpha * temperature**2 * token_kl(student_logits, teacher_log_probs, indices, temperature).mean()
    if alpha < 1:
        hard = F.cross_entropy(student_logits.flatten(0, -2).float(), labels.flatten())
        loss = loss + (1 - alpha) * hard
    return loss


def check_distillation_options(temperature, top_k, alpha, vocab_size: int | None = None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive integer, got {top_k!r}")
    if top_k is not None and vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary size {vocab_size}, got {top_k}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the weight of the distillation term) must be in [0, 1], got {alpha!r}")


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class DistillConfig(TrainConfig):
    """``TrainConfig``'s optimizer, schedule and data order, plus how the student learns from the
    teacher. Being a TrainConfig, it also trains the hard-label control with ``fit`` unchanged."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 4e-3  # minillm-draft's peak learning rate
    warmup: int = 30
    eval_every: int = 150
    # Of both softmaxes in the KL term (the T^2 factor is applied). 1, not Hinton's usual 2-4: for a
    # draft only the teacher's top choices matter, and in a 120-step trial T = 2 reached a greedy
    # agreement with minillm-target of 13% against 17% for T = 1.
    temperature: float = 1.0
    top_k: int | None = None  # keep only the teacher's k largest logits per position; None: all
    alpha: float = 1.0  # weight of the distillation term; 1 - alpha goes to the hard-label loss

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.warmup > self.steps:
            raise ValueError(f"warmup must be at most steps ({self.steps}), got {self.warmup}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be a non-negative number, got {self.weight_decay!r}")
        check_distillation_options(self.temperature, self.top_k, self.alpha)


def check_pair(teacher: Transformer, student: Transformer) -> None:
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(
            f"teacher and student must share a vocabulary, got {teacher.config.vocab_size} "
            f"and {student.config.vocab_size} tokens"
        )


def distill(
    teacher: Transformer,
    student: Transformer,
    config: DistillConfig,
    train_ids: Tensor,
    valid_ids: Tensor | None = None,
    progress: bool = True,
) -> dict:
    """Train ``student`` in place on the teacher's soft targets, over random windows of ``train_ids``
    drawn as ``fit`` draws them (the same seed gives the same windows). The teacher runs in eval
    mode without gradients; the student is left in eval mode. Returns the log: train loss per
    step, and every ``eval_every`` steps the validation loss and the KL to the teacher (T = 1)."""
    check_pair(teacher, student)
    if len(train_ids) <= config.seq_len + 1:
        raise ValueError(f"train_ids must hold more than seq_len + 1 = {config.seq_len + 1} tokens")
    teacher.eval()
    student.train()
    opt = adamw(student, config)
    gen = torch.Generator().manual_seed(config.seed)
    log: dict = {"train_loss": [], "valid_loss": [], "kl_to_teacher": []}
    t0 = time.perf_counter()
    desc = f"{student.config.name} <- {teacher.config.name}"
    bar = tqdm(range(config.steps), disable=not progress, desc=desc, unit="step")
    for step in bar:
        x, y = (t.to(student.device) for t in random_windows(train_ids, config.seq_len, config.batch_size, gen))
        with torch.no_grad():
            teacher_logits = teacher(x)  # (B, T, V)
        loss = distillation_loss(student(x), teacher_logits, config.temperature, config.top_k, config.alpha, y)
        optimizer_step(student, opt, loss, lr_at(step, config), config)
        log["train_loss"].append(round(loss.item(), 4))
        if valid_ids is not None and eval_due(step, config):
            val = evaluate(student, valid_ids, config.seq_len)
            kl = kl_to_teacher(student, teacher, valid_ids, config.seq_len)
            log["valid_loss"].append([step + 1, round(val, 4)])
            log["kl_to_teacher"].append([step + 1, round(kl, 4)])
            bar.set_postfix(loss=f"{loss.item():.3f}", valid=f"{val:.3f}", kl=f"{kl:.3f}")
    log["seconds"] = round(time.perf_counter() - t0, 1)
    student.eval()
    return log


@torch.no_grad()
def kl_to_teacher(
    student: Transformer,
    teacher: Transformer,
    ids: Tensor,
    seq_len: int,
    temperature: float = 1.0,
    batch_size: int = 16,
) -> float:
    """Mean per-token KL(teacher || student) in nats, at ``temperature`` (no T^2 factor), over
    non-overlapping windows of ``seq_len`` tokens of ``ids`` (held-out text)."""
    check_pair(teacher, student)
    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(f"ids must hold at least seq_len = {seq_len} tokens, got {len(ids)}")
    windows = ids[: n * seq_len].view(n, seq_len).to(student.device)  # (n, seq_len)
    total = 0.0
    for batch in windows.split(batch_size):
        teacher_log_probs, _ = teacher_distribution(teacher(batch), temperature)
        total += token_kl(student(batch), teacher_log_probs, None, temperature).sum().item()
    return total / windows.numel()


# ---------------------------------------------------------------------------------------------
# The bundled distilled draft


BUNDLED_DISTILL = DistillConfig()
REPRODUCE = "python -c 'from minillm.compression.distill import distill_bundled; distill_bundled()'"


def distill_bundled(
    out_dir: Path | None = None, config: DistillConfig = BUNDLED_DISTILL, progress: bool = True
) -> Path:
    """Distil minillm-target into a student of minillm-draft's shape, from random weights (seed
    ``config.seed``, as ``train_model`` starts), on the corpus' training split; save it in HF
    layout with training_log.json and a model card (default: minillm/bundled/minillm-draft-distilled)."""
    teacher, tokenizer = load(TEACHER, device="cpu")
    train_ids, valid_ids = encode_split(tokenizer, "train"), encode_split(tokenizer, "valid")
    torch.manual_seed(config.seed)
    student = Transformer(replace(BUNDLED_SHAPES["draft"], name=DISTILLED_NAME)).init_weights(seed=config.seed)
    log = distill(teacher, student, config, train_ids, valid_ids, progress)
    record = {"teacher": TEACHER, **training_record(student, config, train_ids, valid_ids, log)}
    out_dir = Path(out_dir) if out_dir else BUNDLED_DIR / DISTILLED_NAME
    save_pretrained(student, out_dir, tokenizer, {"training_log.json": json.dumps(record) + "\n"})
    write_distilled_card(out_dir)
    return out_dir


def write_distilled_card(directory: Path) -> str:
    """The model card of a distilled draft: ``write_model_card``'s, with how it was distilled and,
    when training_log.json holds a ``comparison`` (see ``comparison_table``), a table of it."""
    log = json.loads((Path(directory) / "training_log.json").read_text())
    tc = log["train_config"]
    top_k = "all" if tc["top_k"] is None else f"the top {tc['top_k']}"
    notes = [
        f"Distilled from {log['teacher']} (Hinton et al., 2015): trained on the teacher's soft targets "
        f"({top_k} logits per position, temperature {tc['temperature']:g}, loss alpha * T^2 * KL + (1 - alpha) * "
        f"cross-entropy with alpha = {tc['alpha']:g}) instead of the next token alone. KL to the teacher on the "
        f"validation split (T = 1): {log['kl_to_teacher'][-1][1]:.3f} nats/token.",
    ]
    if "comparison" in log:
        notes += ["", comparison_table(log["comparison"])]
    return write_model_card(directory, compare_with=log["teacher"], reproduce=REPRODUCE, notes="\n".join(notes))


def comparison_table(comparison: dict) -> str:
    """Markdown of a training log's ``comparison``: {"models": {name: {figure: value}}, "how": text}."""
    models = comparison["models"]
    columns = list(next(iter(models.values())))
    lines = ["| model | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for name, row in models.items():
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", comparison["how"]])


def draft_figures(draft: Transformer, target: Transformer, valid_ids: Tensor, seq_len: int) -> dict:
    """A draft model's quality, alone and against its target, on held-out ids: validation loss and
    perplexity, KL(target || draft) and greedy next-token agreement."""
    loss = evaluate(draft, valid_ids, seq_len)
    return {
        "valid_loss": loss,
        "valid_ppl": math.exp(loss),
        "kl_to_target": kl_to_teacher(draft, target, valid_ids, seq_len),
        "greedy_agreement": argmax_agreement(draft, target, valid_ids, seq_len),
    }


# ---------------------------------------------------------------------------------------------
# Sequence-level distillation (Kim and Rush, 2016): the student learns the teacher's text


@dataclass
class TeacherTextConfig:
    """What the teacher writes for a sequence-level student: ``n_sequences`` rows, each a window of
    ``prompt_len`` tokens at a random place of the source text, continued by ``new_tokens`` tokens
    the teacher samples at ``temperature`` (0: greedy)."""

    n_sequences: int = 4800  # 300 steps x 16 rows: the soft-label run's budget, each row seen once
    prompt_len: int = 16  # tokens of real text each row starts from; the student is not trained on them
    new_tokens: int = 113  # the teacher's tokens after each prompt: rows of 129 = seq_len 128 + 1
    # 1: the teacher's own distribution, so that cross-entropy on its text estimates KL(teacher ||
    # student); greedy text (0) is one mode per prompt, and a small model's greedy text loops.
    temperature: float = 1.0
    seed: int = 0  # of the prompts' places and of the sampling
    batch_size: int = 128  # rows generated at once, with the KV cache

    def __post_init__(self) -> None:
        for name in ("n_sequences", "prompt_len", "new_tokens", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")

    @property
    def row_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def teacher_token_forwards(self) -> int:
        """Token positions the teacher runs: each prompt once (prefill), then one per new token but
        the last (the last sampled token is never fed back)."""
        return self.n_sequences * (self.row_len - 1)


@torch.no_grad()
def teacher_corpus(
    teacher: Transformer, source_ids: Tensor, config: TeacherTextConfig, progress: bool = False
) -> Tensor:
    """The teacher's text: (n_sequences, prompt_len + new_tokens) token ids, each row a prompt of
    ``prompt_len`` tokens of ``source_ids`` (1-D, e.g. the training split) at a random place, then
    the teacher's continuation of it (``generate`` with the KV cache, ``batch_size`` rows at once,
    batch i sampled with seed ``config.seed + i``, no stop at EOS). The prompts are kept, so that
    the student reads what the teacher continued; the same config gives the same rows."""
    if source_ids.dim() != 1 or len(source_ids) < config.prompt_len:
        raise ValueError(
            f"source_ids must be a 1-D stream of at least prompt_len = {config.prompt_len} tokens, "
            f"got shape {tuple(source_ids.shape)}"
        )
    if config.row_len > teacher.config.max_seq_len:
        raise ValueError(
            f"prompt_len + new_tokens = {config.row_len} exceeds the teacher's context "
            f"max_seq_len = {teacher.config.max_seq_len}"
        )
    teacher.eval()
    gen = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, len(source_ids) - config.prompt_len + 1, (config.n_sequences,), generator=gen)
    prompts = source_ids[starts[:, None] + torch.arange(config.prompt_len)]  # (n, prompt_len)
    rows = []
    desc = f"{teacher.config.name} writes"
    batches = tqdm(prompts.split(config.batch_size), disable=not progress, desc=desc, unit="batch")
    for i, batch in enumerate(batches):
        new = generate(
            teacher,
            batch.to(teacher.device),
            config.new_tokens,
            config.temperature,
            seed=config.seed + i,
            eos_token_id=None,
        ).tokens  # (b, new_tokens)
        rows.append(torch.cat([batch, new.to(batch.device)], dim=1))
    return torch.cat(rows)  # (n, prompt_len + new_tokens)


def sequence_targets(rows: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """Inputs (n, L - 1) and next-token targets (n, L - 1) of rows (n, L); a target
    that is still prompt (real text, not the teacher's) is -100, which cross-entropy
    skips."""
    x, y = rows[:, :-1], rows[:, 1:].clone()
    y[:, : max(0, prompt_len - 1)] = -100
    return x, y


def sequence_distill(
    student: Transformer,
    config: TrainConfig,
    rows: Tensor,
    prompt_len: int = 0,
    valid_ids: Tensor | None = None,
    teacher: Transformer | None = None,
    progress: bool = True,
) -> dict:
    """Train ``student`` in place with plain next-token cross-entropy on teacher-written ``rows``
    (n, seq_len + 1) from ``teacher_corpus``, with ``fit``'s optimizer, schedule and clipping: each
    step ``batch_size`` rows, in an order (seed ``config.seed``) that goes through all rows before
    it repeats one. Targets inside the first ``prompt_len`` tokens of a row (real text) are not
    trained on. The student is left in eval mode. Returns ``distill``'s log: the train loss per
    step, and every ``eval_every`` steps the validation loss and, given the ``teacher``, the KL
    to it (T = 1)."""
    if rows.dim() != 2 or rows.shape[1] != config.seq_len + 1:
        raise ValueError(
            f"rows must be (n, seq_len + 1) = (n, {config.seq_len + 1}) token ids, got shape {tuple(rows.shape)}"
        )
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 0 <= prompt_len <= config.seq_len:
        raise ValueError(f"prompt_len must be an integer in [0, seq_len = {config.seq_len}], got {prompt_len!r}")
    if rows.min() < 0 or rows.max() >= student.config.vocab_size:
        raise ValueError(f"rows hold ids outside the student's vocabulary of {student.config.vocab_size} tokens")
    if teacher is not None:
        check_pair(teacher, student)
    inputs, targets = sequence_targets(rows, prompt_len)  # (n, seq_len) each
    gen = torch.Generator().manual_seed(config.seed)
    epochs = math.ceil(config.steps * config.batch_size / len(rows))
    order = torch.cat([torch.randperm(len(rows), generator=gen) for _ in range(epochs)])
    student.train()
    opt = adamw(student, config)
    log: dict = {"train_loss": [], "valid_loss": [], "kl_to_teacher": []}
    t0 = time.perf_counter()
    bar = tqdm(range(config.steps), disable=not progress, desc=f"{student.config.name} (teacher's text)", unit="step")
    for step in bar:
        idx = order[step * config.batch_size : (step + 1) * config.batch_size]
        x, y = inputs[idx].to(student.device), targets[idx].to(student.device)
        loss = F.cross_entropy(student(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        optimizer_step(student, opt, loss, lr_at(step, config), config)
        log["train_loss"].append(round(loss.item(), 4))
        if valid_ids is not None and eval_due(step, config):
            val = evaluate(student, valid_ids, config.seq_len)
            log["valid_loss"].append([step + 1, round(val, 4)])
            if teacher is not None:
                log["kl_to_teacher"].append(
                    [step + 1, round(kl_to_teacher(student, teacher, valid_ids, config.seq_len), 4)]
                )
            bar.set_postfix(loss=f"{loss.item():.3f}", valid=f"{val:.3f}")
    log["seconds"] = round(time.perf_counter() - t0, 1)
    student.eval()
    return log
