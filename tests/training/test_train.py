"""The corpus, the tokenizer and the training loop that made the bundled models."""

import json

import torch

import minillm
from minillm.training import corpus
from minillm.training.train import TOKENIZER_DIR, TrainConfig, evaluate, load_tokenizer, lr_at, train_model
from tests.conftest import tiny_config


def test_committed_corpus_matches_its_manifest():
    manifest = json.loads((corpus.DATA_DIR / "manifest.json").read_text())
    assert manifest["license"] == "PSF-2.0" and (corpus.DATA_DIR / "LICENSE.txt").is_file()
    for split in ("train", "valid"):
        docs = corpus.documents(split)
        assert len(docs) == len(manifest["splits"][split]["documents"])
        assert len(corpus.load_text(split)) == manifest["splits"][split]["characters"]
    train_names = set(manifest["splits"]["train"]["documents"])
    assert not train_names & set(manifest["splits"]["valid"]["documents"]), "validation documents leak into train"
    text = corpus.load_text("train")
    assert "def " in text and "Assert statements are a convenient way" in text  # Python source and English prose


def test_build_corpus_writes_both_splits(tmp_path):
    manifest = corpus.build_corpus(tmp_path)
    assert (tmp_path / "train.txt.gz").stat().st_size > 100_000
    n = sum(len(s["documents"]) for s in manifest["splits"].values())
    assert len(manifest["splits"]["valid"]["documents"]) == n // corpus.VALID_EVERY


def test_tokenizer_round_trips_corpus_text_and_marks_document_starts():
    tok = load_tokenizer()
    sample = corpus.documents("valid")[0][:3000]
    ids = tok.encode(sample)
    assert ids[0] == tok.bos_id == tok.eos_id  # <|endoftext|> opens every document
    assert tok.decode(ids) == sample
    assert len(ids) < len(sample) / 2.5, "BPE should compress corpus text well below one token per 2.5 chars"
    assert tok.vocab_size == 4096
    assert (TOKENIZER_DIR / "tokenizer.json").is_file()


def test_learning_rate_warms_up_then_decays_to_the_floor():
    tc = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, tc) for s in range(100)]
    assert lrs[0] < lrs[9] == max(lrs)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert abs(lrs[-1] - 1e-4) < 2e-6


def test_training_lowers_the_loss_and_saves_a_loadable_checkpoint(tmp_path):
    tok = load_tokenizer()
    ids = torch.tensor(tok.encode(corpus.load_text("valid")[:40_000]))
    split = int(len(ids) * 0.9)
    cfg = tiny_config(vocab_size=tok.vocab_size, dim=48, max_seq_len=64, tie_embeddings=True, eos_token_id=0)
    tc = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=3e-3, warmup=5, eval_every=40)
    untrained = evaluate(minillm.Transformer(cfg).init_weights(seed=0), ids[split:], 32)
    model, log = train_model(cfg, tc, ids[:split], ids[split:], progress=False)
    assert log["valid_loss"][-1][1] < untrained - 1.0
    assert len(log["train_loss"]) == 40
    minillm.save_pretrained(model, tmp_path, tok)
    loaded, loaded_tok = minillm.load(tmp_path, device="cpu")
    x = ids[:20][None]
    assert torch.equal(loaded(x), model(x))
    assert loaded_tok.encode("x = 1") == tok.encode("x = 1")
