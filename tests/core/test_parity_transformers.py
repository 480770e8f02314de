"""minillm against Hugging Face transformers (a test-only dependency), on tiny random models of
every supported layout, made offline here and saved with ``save_pretrained``."""

import json

import pytest
import torch

import minillm

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=211,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

LAYOUTS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True)),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=4.0)),
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=12)),
    "qwen2-bias-tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=True),
    ),
}


def make_hf_model(layout: str, seed: int = 0):
    config_cls, model_cls, extra = LAYOUTS[layout]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger than the default init, biases included, so logits are peaked
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def save_hf(layout: str, path, **save_kwargs):
    model = make_hf_model(layout)
    model.save_pretrained(path, **save_kwargs)
    return model


def assert_logits_match(hf_model, ours, ids):
    with torch.no_grad():
        expected = hf_model(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"max |logit difference| {diff:.2e} > 1e-4"


def assert_greedy_matches(hf_model, ours, prompt, n=32):
    with torch.no_grad():
        expected = hf_model.generate(
            prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )[:, prompt.shape[1] :]
    got = minillm.generate(ours, prompt, max_new_tokens=n, eos_token_id=None).tokens
    assert torch.equal(got, expected), f"greedy tokens differ:\nours {got}\nhf   {expected}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_and_greedy_tokens_match_transformers(layout, tmp_path):
    hf_model = save_hf(layout, tmp_path)
    ours, tokenizer = minillm.load(tmp_path, device="cpu")
    assert tokenizer is None  # no tokenizer.json was saved
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 40), generator=gen)  # longer than Mistral's window
    assert_logits_match(hf_model, ours, ids)
    assert_greedy_matches(hf_model, ours, ids[:1, :9])


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    hf_model = save_hf("llama-gqa", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "the test should produce several shards"
    ours, _ = minillm.load(tmp_path, device="cpu")
    assert_logits_match(hf_model, ours, torch.randint(0, SMALL["vocab_size"], (2, 16)))


def rewrite_config_old_style(path):
    """The config.json layout of transformers 4.x: rope_theta and rope_scaling at the top level,
    the scaling type under "type"."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(cfg))


def test_old_style_config_with_top_level_rope_keys(tmp_path):
    hf_model = save_hf("llama3-rope", tmp_path)
    rewrite_config_old_style(tmp_path)
    ours, _ = minillm.load(tmp_path, device="cpu")
    assert ours.config.rope_scaling.rope_type == "llama3"
    assert ours.config.rope_scaling.original_max_position_embeddings == 32
    assert_logits_match(hf_model, ours, torch.randint(0, SMALL["vocab_size"], (2, 64)))


def test_tied_checkpoint_has_no_lm_head_tensor(tmp_path):
    from safetensors import safe_open

    save_hf("llama-tied", tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    ours, _ = minillm.load(tmp_path, device="cpu")
    assert ours.lm_head.weight is ours.embed_tokens.weight


def test_dtype_choice(tmp_path):
    save_hf("llama-gqa", tmp_path)
    ours, _ = minillm.load(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours(torch.randint(0, SMALL["vocab_size"], (1, 5))).dtype == torch.bfloat16


def test_minillm_checkpoints_load_in_transformers(tmp_path):
    """save_pretrained writes a real LlamaForCausalLM checkpoint: transformers loads it as is."""
    from tests.conftest import tiny_model

    ours = tiny_model(n_kv_heads=2, tie_embeddings=True)
    minillm.save_pretrained(ours, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_logits_match(hf_model, ours, torch.randint(0, ours.config.vocab_size, (2, 20)))
