"""The two trained models that ship in the package: they load like hub checkpoints, the target is
clearly better than its draft, the pair agrees often enough for speculative decoding, and their
text looks like their corpus."""

import json
import re

import pytest
import torch

import minillm
from minillm.core.checkpoints import BUNDLED_DIR
from minillm.training.train import TOKENIZER_DIR, argmax_agreement, encode_split, evaluate

pytestmark = pytest.mark.xdist_group("bundled")  # one worker loads them once
NAMES = ("minillm-target", "minillm-draft")


@pytest.fixture(scope="module")
def pair():
    target, tok = minillm.load("minillm-target", device="cpu")
    draft, _ = minillm.load("minillm-draft", device="cpu")
    return target, draft, tok


@pytest.fixture(scope="module")
def valid_ids(pair):
    return encode_split(pair[2], "valid")[:12_288]


def test_both_are_listed_and_fit_the_size_budget():
    assert set(NAMES) <= set(minillm.bundled_models())
    total = sum(f.stat().st_size for name in NAMES for f in (BUNDLED_DIR / name).iterdir())
    assert total <= 40 * 2**20, f"bundled models take {total / 2**20:.1f} MiB > 40 MiB"


def test_one_shared_tokenizer():
    reference = (TOKENIZER_DIR / "tokenizer.json").read_bytes()
    for name in NAMES:
        assert (BUNDLED_DIR / name / "tokenizer.json").read_bytes() == reference


def test_draft_is_about_ten_times_smaller(pair):
    target, draft, _ = pair
    ratio = target.num_params() / draft.num_params()
    assert 8 <= ratio <= 12, ratio
    assert 3e6 <= target.num_params() <= 10e6


def test_target_is_clearly_better_than_draft(pair, valid_ids):
    target, draft, _ = pair
    t_loss, d_loss = evaluate(target, valid_ids, 256), evaluate(draft, valid_ids, 256)
    assert t_loss < d_loss - 0.2, (t_loss, d_loss)  # measured: 3.50 vs 3.77 nats on the whole split
    assert t_loss < 3.7, f"target validation loss {t_loss:.3f}: not trained enough to write like its corpus"


def test_training_logs_agree_with_a_fresh_evaluation(pair, valid_ids):
    for model, name in zip(pair[:2], NAMES):
        log = json.loads((BUNDLED_DIR / name / "training_log.json").read_text())
        assert log["parameters"] == model.num_params()
        assert log["seconds"] <= 40 * 60, f"{name} took {log['seconds'] / 60:.0f} min to train"
        fresh = evaluate(model, encode_split(pair[2], "valid"), log["train_config"]["seq_len"])
        assert abs(fresh - log["final_valid_loss"]) < 1e-3


def test_draft_and_target_agree_often_enough_for_speculation(pair, valid_ids):
    target, draft, _ = pair
    assert argmax_agreement(draft, target, valid_ids) >= 0.5


def sampled_text(model, tok, prompt: str, n: int = 160) -> str:
    return tok.decode(minillm.generate(model, tok.encode(prompt), n, temperature=0.8, top_p=0.95, seed=0).tokens[0])


def test_code_it_writes_is_indented_like_python(pair):
    target, _, tok = pair
    text = sampled_text(target, tok, "import os\n\n\ndef list_files(directory):")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    four_space = sum((len(ln) - len(ln.lstrip(" "))) % 4 == 0 for ln in lines)
    assert len(lines) >= 5 and four_space >= 0.9 * len(lines), text
    assert re.search(r"\b(def|return|if|for|self|import|raise|class)\b", text), text


def test_prose_it_writes_uses_the_corpus_vocabulary(pair):
    target, _, tok = pair
    known = set(re.findall(r"[A-Za-z]+", minillm.training.corpus.load_text("train")))
    words = re.findall(r"[A-Za-z]+", sampled_text(target, tok, 'The "while" statement\n*********************\n\n'))
    assert len(words) >= 40
    assert sum(w in known for w in words) >= 0.9 * len(words), words


def test_model_cards_state_their_figures():
    for name in NAMES:
        card = (BUNDLED_DIR / name / "README.md").read_text()
        log = json.loads((BUNDLED_DIR / name / "training_log.json").read_text())
        assert f"{log['parameters']:,}" in card
        assert "PSF" in card and "validation loss" in card and "training time" in card


def test_transformers_loads_the_bundled_target_unchanged(pair):
    transformers = pytest.importorskip("transformers")
    target, _, tok = pair
    directory = BUNDLED_DIR / "minillm-target"
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    text = "class Queue:\n    def put(self, item):\n"
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(x).logits - target(x)).abs().max() <= 1e-4
