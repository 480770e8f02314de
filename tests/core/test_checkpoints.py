"""Loading checkpoints: round trips, the hub path, and a clear error for every way one can be wrong."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import minillm
from minillm.core.checkpoints import CheckpointError, resolve
from minillm.core.hf_config import config_from_hf
from minillm.core.tokenizer import StreamDecoder, Tokenizer
from tests.conftest import tiny_model


def small_tokenizer() -> Tokenizer:
    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=97,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n", "héllo wörld, 你好"] * 5, trainer)
    return Tokenizer(tok, bos_token=None, eos_token="<eos>")


@pytest.fixture
def saved(tmp_path):
    model = tiny_model(vocab_size=300)
    minillm.save_pretrained(model, tmp_path, small_tokenizer())
    return model, tmp_path


def edit_weights(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_round_trip_keeps_logits_and_tokenizer(saved):
    model, path = saved
    loaded, tok = minillm.load(path, device="cpu")
    ids = torch.randint(0, 300, (2, 17))
    assert torch.equal(loaded(ids), model(ids))
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tok._tok.token_to_id("<eos>")
    assert loaded.config.replace(name="tiny") == model.config


def test_stream_decoder_never_splits_a_character():
    tok = small_tokenizer()
    text = "héllo wörld, 你好"
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def llama_style_tokenizer() -> Tokenizer:
    """SentencePiece's way (Llama 2, TinyLlama): "▁" for a space, byte-fallback tokens for what
    the vocabulary lacks (你 is three of them), and the first leading space stripped on decoding:
    a token's text depends on where it stands."""
    vocab = {"▁a": 0, "▁b": 1, "c": 2, "<0xE4>": 3, "<0xBD>": 4, "<0xA0>": 5, "▁": 6, "<0xC3>": 7, "<0xA9>": 8}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="c"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(tok)


# Token ids of llama_style_tokenizer, each group one whole character (你 and é split over their bytes)
LLAMA_CHARACTERS = [[0], [1], [2], [6], [3, 4, 5], [7, 8]]


@settings(max_examples=200, deadline=None)
@given(
    byte_level=st.lists(st.integers(0, 96), max_size=40),
    llama_style=st.lists(st.sampled_from(LLAMA_CHARACTERS), max_size=20),
)
def test_streamed_text_joins_to_the_decoded_ids(byte_level, llama_style):
    """The pieces joined are what decoding every id at once gives: for byte-level tokens any ids at
    all, broken characters included; for SentencePiece's, whole characters in any order (with
    byte fallback a broken character turns the bytes before it into replacement characters after
    they were printed, which no stream can take back)."""
    for tok, ids in ((small_tokenizer(), byte_level), (llama_style_tokenizer(), sum(llama_style, []))):
        stream = StreamDecoder(tok)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


def test_stream_decoder_decodes_a_window_not_every_id_so_far():
    tok = small_tokenizer()
    decoded = []
    real = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)
    ids = tok.encode("def add(a, b):\n    return a + b\n" * 20)
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) == real(ids)
    assert max(decoded) <= 4, "each token costs a decode of a few ids, not of all of them"


def test_unsupported_architecture_lists_the_supported_ones(saved):
    _, path = saved
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2"):
        minillm.load(path)


def test_missing_tensor_is_named(saved):
    _, path = saved
    edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        minillm.load(path)


def test_unexpected_tensor_is_named(saved):
    _, path = saved
    edit_weights(path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight"):
        minillm.load(path)


def test_shape_mismatch_names_tensor_expected_and_got(saved):
    _, path = saved
    edit_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight': expected \(32,\), got \(31,\)"):
        minillm.load(path)


def test_pickled_weights_are_refused_not_unpickled(saved, monkeypatch):
    _, path = saved
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load must not be called"))
    with pytest.raises(CheckpointError, match=r"no safetensors weights.*unpickling"):
        minillm.load(path)


def test_hub_id_while_offline_says_to_pass_a_local_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"HF_HUB_OFFLINE.*local path"):
        minillm.load("meta-llama/Llama-3.2-1B")


def test_hub_id_downloads_through_huggingface_hub(saved, monkeypatch):
    import huggingface_hub

    _, path = saved
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, tok = minillm.load("some-org/some-model", device="cpu")
    assert calls[0][0] == "some-org/some-model"
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in calls[0][1])
    assert model.config.vocab_size == 300 and tok is not None


def test_hub_failure_is_a_clear_error(monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def unreachable(*a, **k):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(CheckpointError, match=r"could not download 'org/x'.*local path"):
        minillm.load("org/x")


def test_unknown_name_is_a_clear_error():
    with pytest.raises(CheckpointError, match=r"neither a bundled model"):
        minillm.load("no-such-model")
    with pytest.raises(CheckpointError, match=r"no checkpoint directory"):
        resolve("./does/not/exist")


def test_cpu_default_dtype_is_float32_and_explicit_dtype_wins(saved):
    _, path = saved
    edit_config(path, torch_dtype="bfloat16")
    assert minillm.load(path, device="cpu")[0].dtype == torch.float32
    assert minillm.load(path, device="cpu", dtype=torch.float16)[0].dtype == torch.float16


def test_generation_config_eos_list_is_used(saved):
    _, path = saved
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    model, _ = minillm.load(path, device="cpu")
    assert model.config.eos_ids == (5, 7)


BASE = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=100,
)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "unsupported RoPE scaling type 'yarn'"),
        (dict(hidden_act="gelu"), "unsupported activation 'gelu'"),
        (dict(num_key_value_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "sliding-window layers"),
        (dict(architectures=[], model_type="phi"), "unsupported architecture"),
    ],
)
def test_bad_configs_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**BASE, **changes})


def test_config_variants_from_old_and_new_transformers():
    new = config_from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    old = config_from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": None})
    assert new.rope_theta == old.rope_theta == 5e5
    linear_old = config_from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear_old.rope_scaling.rope_type == "linear" and linear_old.rope_scaling.factor == 2.0
    qwen = config_from_hf(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}
    )
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    mistral = config_from_hf({**BASE, "model_type": "mistral", "architectures": None, "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias
