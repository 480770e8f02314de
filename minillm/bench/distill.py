"""Sequence-level distillation measured as the saved students were (chapter 12): a student
trained on the teacher's text (``compression.distill``), scored by ``student_figures``, the
figures of minillm-draft-distilled's saved comparison: ``compression.distill.draft_figures`` on
held-out text and ``speculative_figures`` as the target's draft in greedy speculative decoding.
Here, a layer above both, because the second needs ``decoding``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor

from ..compression.distill import (
    BUNDLED_DISTILL,
    DISTILLED_NAME,
    TEACHER,
    TeacherTextConfig,
    draft_figures,
    sequence_distill,
    teacher_corpus,
)
from ..core.checkpoints import BUNDLED_DIR, load
from ..core.device import hardware_description
from ..core.model import Transformer
from ..decoding.common import merged
from ..decoding.speculative import speculative_generate
from ..training.corpus import corpus_prompts
from ..training.train import BUNDLED_SHAPES, TrainConfig, encode_split


def speculative_figures(
    draft: Transformer,
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = 64,
    k: int = 4,
) -> dict:
    """A draft's figures as ``target``'s drafter in greedy speculative decoding, all prompts pooled
    (``merged``): new tokens per target forward, and the per-position acceptance rate, proposals
    accepted over the positions the target checked (``DecodingStats.acceptance_rate``, not the
    fraction of all proposals kept)."""
    total = merged([speculative_generate(target, draft, list(p), new_tokens, k=k).stats for p in prompts])
    return {"tokens_per_target_forward": total.tokens_per_target_forward, "acceptance_rate": total.acceptance_rate}


SEQUENCE_DISTILLED_NAME = "minillm-draft-seq-distilled"
BUNDLED_TEACHER_TEXT = TeacherTextConfig()
SEQUENCE_REPRODUCE = (
    "MINILLM_THREADS=1 python -c 'from minillm.bench.distill import sequence_distill_comparison as c; "
    'c("minillm/results/cpu-epyc-2core/distill_sequence.json")\''
)
FIGURES = ("valid_ppl", "kl_to_target", "greedy_agreement", "tokens_per_target_forward", "acceptance_rate")


def student_figures(student: Transformer, teacher: Transformer, valid_ids: Tensor, prompts) -> dict:
    """The figures of the saved comparison in minillm-draft-distilled's training_log.json: on 128-token
    windows of ``valid_ids``, ``draft_figures``; on ``prompts``, ``speculative_figures`` (K = 4, 64 new tokens)."""
    figures = {
        **draft_figures(student, teacher, valid_ids, 128),
        **speculative_figures(student, teacher, prompts),
    }
    return {name: figures[name] for name in FIGURES}


def sequence_distill_comparison(
    out_path: str | Path | None = None,
    text: TeacherTextConfig = BUNDLED_TEACHER_TEXT,
    config: TrainConfig = BUNDLED_DISTILL,
    progress: bool = True,
) -> dict:
    """Sequence-level distillation of minillm-target into minillm-draft's shape, measured as the
    saved students were: the teacher writes ``text`` from the training split, a student (seed
    ``config.seed``, as ``distill_bundled`` starts) trains on it for the soft-label run's budget
    (``config``), and is scored by ``student_figures``; the bundled minillm-draft-distilled is
    re-measured beside it, as a check that the figures are comparable. Returns the record,
    written as JSON to ``out_path`` if given."""
    teacher, tokenizer = load(TEACHER, device="cpu")
    train_ids, valid_ids = encode_split(tokenizer, "train"), encode_split(tokenizer, "valid")
    t0 = time.perf_counter()
    rows = teacher_corpus(teacher, train_ids, text, progress)
    generation_seconds = time.perf_counter() - t0
    torch.manual_seed(config.seed)
    student = Transformer(replace(BUNDLED_SHAPES["draft"], name=SEQUENCE_DISTILLED_NAME)).init_weights(seed=config.seed)
    log = sequence_distill(student, config, rows, text.prompt_len, valid_ids, teacher, progress)
    t0 = time.perf_counter()
    prompts = corpus_prompts(tokenizer, 8, 64)
    figures = student_figures(student, teacher, valid_ids, prompts)
    bundled, _ = load(DISTILLED_NAME, device="cpu")
    saved = json.loads((BUNDLED_DIR / DISTILLED_NAME / "training_log.json").read_text())
    remeasured = student_figures(bundled, teacher, valid_ids, prompts)
    measuring_seconds = time.perf_counter() - t0
    trained = config.steps * config.batch_size * config.seq_len
    record = {
        "model": SEQUENCE_DISTILLED_NAME,
        "teacher": TEACHER,
        "figures": figures,
        "settings": {
            "teacher_text": asdict(text),
            "teacher_tokens_generated": text.n_sequences * text.new_tokens,
            "train_config": asdict(config),
            "steps_x_batch_x_seq_len": [config.steps, config.batch_size, config.seq_len],
            "student_input_tokens": trained,
            "student_trained_targets": config.steps
            * config.batch_size
            * (config.seq_len - max(0, text.prompt_len - 1)),
            "epochs_of_teacher_text": trained / (len(rows) * config.seq_len),
        },
        "cost": {
            "teacher_token_forwards_soft_labels": trained,
            "teacher_token_forwards_sequence_level": text.teacher_token_forwards,
            "soft_label_training_seconds_saved": saved["seconds"],
            "hard_label_training_seconds_saved": saved.get("control_seconds"),
            "note": "Soft labels run the teacher over every training token, at every step and again in every "
            "epoch (one forward of 16 x 128 tokens per step). Sequence-level distillation runs it once, to "
            "write the text (a prefill of each prompt, then one token per step of generation with the KV "
            "cache), and the text then serves any number of epochs; training itself is the hard-label cost.",
        },
        "seconds": {
            "generation": round(generation_seconds, 1),
            "training": log["seconds"],
            "measuring": round(measuring_seconds, 1),
        },
        "check": {
            "bundled minillm-draft-distilled, re-measured": remeasured,
            "saved": saved["comparison"]["models"][DISTILLED_NAME],
        },
        "log": {k: v for k, v in log.items() if k != "seconds"},
        "hardware": hardware_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "reproduce": SEQUENCE_REPRODUCE,
        "how": (
            f"Sequence-level distillation (Kim and Rush, 2016): minillm-target continued {text.n_sequences} prompts "
            f"of {text.prompt_len} tokens, each at a random place of the training split (seed {text.seed}), by "
            f"{text.new_tokens} tokens sampled at temperature {text.temperature:g} (`teacher_corpus`); a student of "
            f"minillm-draft's shape, from the same initial weights (seed {config.seed}) as the soft-label and "
            f"hard-label students, trained on that text with plain next-token cross-entropy (the prompts' own "
            f"tokens not trained on), {config.steps} steps x {config.batch_size} x {config.seq_len} tokens with "
            "`fit`'s AdamW, warmup and cosine decay (`sequence_distill`). Figures as in minillm-draft-distilled's "
            "training_log.json comparison: on the validation split, in 128-token windows, perplexity, "
            "KL(target || draft) in nats/token and greedy next-token agreement; as minillm-target's draft in greedy "
            "speculative decoding (K = 4, 64 new tokens on each of 8 prompts of 64 tokens from "
            "`training.corpus.corpus_prompts(tokenizer, 8, 64)`), new tokens per target forward and the "
            "per-position acceptance rate (acceptance_rate: proposals accepted over the positions the target "
            "checked), all prompts pooled."
        ),
    }
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(record, indent=1) + "\n")
    return record
