"""Sequence-level distillation: the teacher's text (its prompts kept, seeded, the teacher's own
greedy tokens at temperature 0), a student that learns it, clear errors for bad input, and the
saved comparison measured on the same figures as the bundled one."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.bench.distill import FIGURES, SEQUENCE_REPRODUCE, speculative_figures
from minillm.compression.distill import (
    DISTILLED_NAME,
    DistillConfig,
    TeacherTextConfig,
    sequence_distill,
    sequence_targets,
    teacher_corpus,
)
from minillm.core.checkpoints import BUNDLED_DIR
from tests.conftest import tiny_model

SAVED = Path(__file__).resolve().parents[2] / "minillm" / "results" / "cpu-epyc-2core" / "distill_sequence.json"


def source(n=400, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def text_config(**overrides):
    return TeacherTextConfig(**{**dict(n_sequences=10, prompt_len=5, new_tokens=12, batch_size=4), **overrides})


def test_rows_are_source_prompts_continued_by_the_teacher():
    ids, config = source(), text_config()
    rows = teacher_corpus(tiny_model(), ids, config)
    assert rows.shape == (10, 17) and rows.dtype == torch.long
    windows = ids.unfold(0, 5, 1)  # (396, 5): every prompt the source holds
    for prompt in rows[:, :5]:
        assert (windows == prompt).all(1).any()


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text():
    teacher, ids = tiny_model(), source()
    first, again = (teacher_corpus(teacher, ids, text_config()) for _ in range(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, teacher_corpus(teacher, ids, text_config(seed=1)))


def test_at_temperature_zero_the_continuations_are_the_teachers_greedy_tokens():
    teacher, config = tiny_model(), text_config(temperature=0.0)
    rows = teacher_corpus(teacher, source(), config)
    with torch.no_grad():
        best = teacher(rows[:, :-1]).argmax(-1)  # (n, L - 1): the argmax after each prefix
    assert torch.equal(rows[:, 5:], best[:, 4:])
    # greedy text does not depend on how the rows were batched
    assert torch.equal(rows, teacher_corpus(teacher, source(), text_config(temperature=0.0, batch_size=7)))


def test_prompt_targets_are_skipped():
    rows = torch.arange(20).view(2, 10)
    x, y = sequence_targets(rows, prompt_len=4)
    assert torch.equal(x, rows[:, :-1])
    assert (y[:, :3] == -100).all() and torch.equal(y[:, 3:], rows[:, 4:])


def held_out_loss(student, rows, prompt_len):
    x, y = sequence_targets(rows, prompt_len)
    with torch.no_grad():
        return F.cross_entropy(student(x).flatten(0, 1), y.flatten(), ignore_index=-100).item()


def test_training_on_the_teachers_text_lowers_the_loss_on_more_of_it():
    teacher, student = tiny_model(seed=5), tiny_model(seed=1).train()
    text = TeacherTextConfig(n_sequences=64, prompt_len=4, new_tokens=29, batch_size=64)
    rows = teacher_corpus(teacher, source(), text)
    held_out = teacher_corpus(teacher, source(seed=1), TeacherTextConfig(**{**vars(text), "seed": 1}))
    config = DistillConfig(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup=4, eval_every=20)
    before = held_out_loss(student, held_out, 4)
    log = sequence_distill(student, config, rows, 4, source(seed=2), teacher, progress=False)
    after = held_out_loss(student, held_out, 4)
    assert len(log["train_loss"]) == 40 and [s for s, _ in log["kl_to_teacher"]] == [20, 40]
    assert after < before - 0.3, (before, after)
    assert not student.training


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_sequences", 0),
        ("prompt_len", 1.5),
        ("new_tokens", -1),
        ("batch_size", True),
        ("temperature", -0.5),
        ("temperature", float("inf")),
        ("seed", -1),
    ],
)
def test_teacher_text_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        TeacherTextConfig(**{field: value})


def test_bad_input_is_refused():
    teacher = tiny_model()
    with pytest.raises(ValueError, match="source_ids"):
        teacher_corpus(teacher, source().view(20, 20), text_config())
    with pytest.raises(ValueError, match="source_ids"):
        teacher_corpus(teacher, source(n=3), text_config())
    with pytest.raises(ValueError, match="max_seq_len"):
        teacher_corpus(teacher, source(), text_config(new_tokens=124))
    rows = teacher_corpus(teacher, source(), text_config())  # (10, 17)
    config = DistillConfig(steps=2, batch_size=2, seq_len=16, warmup=0)
    with pytest.raises(ValueError, match="seq_len"):
        sequence_distill(tiny_model(), DistillConfig(steps=2, batch_size=2, seq_len=8, warmup=0), rows, progress=False)
    with pytest.raises(ValueError, match="prompt_len"):
        sequence_distill(tiny_model(), config, rows, prompt_len=17, progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        sequence_distill(tiny_model(vocab_size=50), config, rows, progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        sequence_distill(tiny_model(), config, rows, teacher=tiny_model(vocab_size=50), progress=False)


def test_a_draft_that_is_the_target_has_every_proposal_accepted():
    target = tiny_model()
    prompts = [source(n=8, seed=s).tolist() for s in range(2)]
    figures = speculative_figures(target, target, prompts, new_tokens=20, k=4)
    assert figures["acceptance_rate"] == 1.0
    # each prompt: rounds of 4 proposals + 1 token while 5 fit, then the rest: 20 tokens in 4 forwards
    assert figures["tokens_per_target_forward"] == pytest.approx(5.0)


@pytest.mark.skipif(not SAVED.is_file(), reason="no saved sequence-level comparison")
def test_saved_comparison_has_its_fields_and_the_bundled_figures():
    record = json.loads(SAVED.read_text())
    bundled = json.loads((BUNDLED_DIR / DISTILLED_NAME / "training_log.json").read_text())
    saved_rows = bundled["comparison"]["models"]
    for field in ("model", "teacher", "figures", "settings", "cost", "seconds", "check", "hardware", "how"):
        assert field in record, field
    assert record["teacher"] == bundled["teacher"] and record["threads"] == 1
    assert record["reproduce"] == SEQUENCE_REPRODUCE  # the command that wrote it, as it is now
    for row in saved_rows.values():  # the new student is scored on exactly the saved figures
        assert set(row) == set(record["figures"]) == set(FIGURES)
    remeasured = record["check"]["bundled minillm-draft-distilled, re-measured"]
    assert remeasured == pytest.approx(saved_rows[DISTILLED_NAME], rel=1e-6)  # the same measurement
    settings, tc = record["settings"], bundled["train_config"]
    assert settings["steps_x_batch_x_seq_len"] == [tc["steps"], tc["batch_size"], tc["seq_len"]]
    assert settings["train_config"]["seed"] == tc["seed"] and settings["train_config"]["lr"] == tc["lr"]
    text = settings["teacher_text"]
    assert settings["teacher_tokens_generated"] == text["n_sequences"] * text["new_tokens"]
    assert record["cost"]["teacher_token_forwards_soft_labels"] == tc["steps"] * tc["batch_size"] * tc["seq_len"]
    assert record["seconds"]["generation"] > 0 and record["seconds"]["training"] > 0
    TeacherTextConfig(**text)  # the recipe passes validation
