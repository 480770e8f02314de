"""ModelConfig: validation, derived fields, parameter counts and the presets of real models."""

import dataclasses

import pytest
import torch

from minillm import PRESETS, ModelConfig, RopeScaling, Transformer, preset
from minillm.core.config import ceil_div
from tests.conftest import tiny_config


def meta_param_count(cfg: ModelConfig) -> int:
    """Parameters of the model built from cfg, counted without allocating any memory."""
    with torch.device("meta"):
        return Transformer(cfg).num_params()  # a tied lm_head is one tensor, counted once


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(dim=48, n_heads=6, n_kv_heads=4), "n_kv_heads"),
        (dict(n_heads=4, n_kv_heads=8), "n_kv_heads"),  # more KV heads than query heads
        (dict(dim=30, n_heads=4), "head_dim"),  # 30 / 4 is not whole: must say to set head_dim
        (dict(dim=30, n_heads=4), "n_heads"),
        (dict(dim=28, n_heads=4, n_kv_heads=4), "head_dim"),  # head_dim 7 is odd: RoPE rotates pairs
        (dict(head_dim=9), "head_dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(dim=0), "dim"),
        (dict(n_layers=0), "n_layers"),
        (dict(n_heads=0, n_kv_heads=None), "n_heads"),
        (dict(n_heads=0, n_kv_heads=1), "n_heads"),
        (dict(n_heads=-4, n_kv_heads=None), "n_heads"),
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(n_kv_heads=-2), "n_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=-8), "head_dim"),
        (dict(ffn_dim=0), "ffn_dim"),
        (dict(max_seq_len=0), "max_seq_len"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=-16), "sliding_window"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(rope_scaling={"rope_type": "yarn"}), "rope_type"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), "factor"),
        (
            dict(rope_scaling={"rope_type": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
            "high_freq_factor",
        ),
    ],
)
def test_invalid_configs_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


@pytest.mark.parametrize("rope_type", ["yarn", "Linear", "", "dynamic"])
def test_rope_scaling_refuses_unknown_types_and_lists_the_known(rope_type):
    with pytest.raises(ValueError, match="rope_type") as info:
        RopeScaling(rope_type)
    assert all(known in str(info.value) for known in ("default", "linear", "llama3"))


def test_valid_edge_configs_are_accepted():
    tiny_config(dim=30, n_heads=4, head_dim=8)  # an explicit head_dim need not divide dim
    tiny_config(n_heads=4, n_kv_heads=1)
    tiny_config(sliding_window=1)
    tiny_config(max_seq_len=1)
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def test_configs_are_frozen_and_replace_validates():
    cfg = tiny_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 64
    wider = cfg.replace(max_seq_len=256)
    assert wider.max_seq_len == 256 and cfg.max_seq_len == 128
    assert wider.replace(max_seq_len=128) == cfg
    with pytest.raises(ValueError, match="n_kv_heads"):
        cfg.replace(n_kv_heads=3)


# --- derived fields ----------------------------------------------------------------------------


def test_defaults_derive_n_kv_heads_and_head_dim():
    cfg = ModelConfig(dim=64, n_heads=8)
    assert cfg.n_kv_heads == 8 and cfg.head_dim == 8
    assert ModelConfig(dim=64, n_heads=8, head_dim=16).head_dim == 16


@pytest.mark.parametrize(
    "n_heads, n_kv_heads, n_rep",
    [(8, None, 1), (8, 8, 1), (8, 4, 2), (8, 2, 4), (8, 1, 8), (9, 3, 3), (14, 2, 7)],
)
def test_n_rep_is_query_heads_per_kv_head(n_heads, n_kv_heads, n_rep):
    cfg = ModelConfig(dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads)
    assert cfg.n_rep == n_rep
    assert cfg.n_rep * cfg.n_kv_heads == cfg.n_heads


EOS_CASES = [(None, ()), (0, (0,)), (2, (2,)), ((5, 6), (5, 6)), ([7, 8, 9], (7, 8, 9))]


@pytest.mark.parametrize("eos, ids", EOS_CASES)
def test_eos_ids_is_always_a_tuple(eos, ids):
    cfg = tiny_config(eos_token_id=eos)
    assert cfg.eos_ids == ids and isinstance(cfg.eos_ids, tuple)
    hash(cfg)  # a list of EOS ids was turned into a tuple, so the frozen config stays hashable


def test_rope_scaling_dict_becomes_a_dataclass():
    cfg = tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert cfg.rope_scaling == RopeScaling("linear", factor=2.0)


# --- parameter counts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(n_kv_heads=1),
        dict(n_kv_heads=4),
        dict(head_dim=16),
        dict(tie_embeddings=True),
        dict(qkv_bias=True),
        dict(o_bias=True),
        dict(mlp_bias=True),
        dict(qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True, head_dim=12, n_kv_heads=1),
    ],
)
def test_num_params_matches_a_built_model(overrides):
    cfg = tiny_config(**overrides)
    model = Transformer(cfg)
    assert cfg.num_params() == model.num_params() == sum(p.numel() for p in model.parameters())
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    assert cfg.num_params(include_embeddings=False) == cfg.num_params() - embeddings


@pytest.mark.parametrize("name", PRESETS)
def test_every_presets_num_params_matches_the_model_built_from_it(name):
    cfg = PRESETS[name]
    assert cfg.name == name
    assert cfg.num_params() == meta_param_count(cfg)


@pytest.mark.parametrize(
    "name, total",
    [
        ("Llama-3-8B", 8.03e9),
        ("Llama-3-70B", 70.554e9),
        ("Llama-3.2-1B", 1.236e9),  # tied embeddings: the 262M-parameter matrix is counted once
        ("Llama-3.2-3B", 3.213e9),
        ("Llama-2-7B", 6.738e9),
        ("Llama-2-13B", 13.016e9),
        ("Llama-2-70B", 68.977e9),
        ("Mistral-7B-v0.3", 7.248e9),
        ("TinyLlama-1.1B", 1.100e9),
        ("SmolLM2-135M", 134.5e6),
        ("SmolLM2-360M", 361.8e6),
        ("SmolLM2-1.7B", 1.711e9),
        ("Qwen2.5-0.5B", 494e6),
        ("Qwen2.5-1.5B", 1.544e9),
    ],
)
def test_known_parameter_totals(name, total):
    assert preset(name).num_params() == pytest.approx(total, rel=0.01)


def test_tied_presets_are_the_tied_models():
    tied = {name for name, cfg in PRESETS.items() if cfg.tie_embeddings}
    assert {"Llama-3.2-1B", "Llama-3.2-3B", "SmolLM2-135M", "Qwen2.5-0.5B"} <= tied
    assert not tied & {"Llama-3-8B", "Llama-2-7B", "Mistral-7B-v0.3"}
    assert preset("Qwen2.5-0.5B").qkv_bias and not preset("Llama-3-8B").qkv_bias


# --- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["Llama-3-8B", "llama-3-8b", "LLAMA-3-8B", "lLaMa-3-8b"])
def test_preset_is_case_insensitive(spelling):
    assert preset(spelling) == PRESETS["Llama-3-8B"]
    assert preset(spelling).name == "Llama-3-8B"


def test_preset_overrides_change_only_those_fields():
    cfg = preset("smollm2-135m", max_seq_len=1024, n_layers=2)
    base = PRESETS["SmolLM2-135M"]
    assert cfg.max_seq_len == 1024 and cfg.n_layers == 2
    assert cfg.replace(max_seq_len=base.max_seq_len, n_layers=base.n_layers) == base
    assert base.max_seq_len == 8192 and base.n_layers == 30  # the registry is not modified
    with pytest.raises(ValueError, match="n_kv_heads"):  # overrides are validated
        preset("SmolLM2-135M", n_kv_heads=2)


@pytest.mark.parametrize("name", ["Llama-4-400B", "", "gpt2", "llama-3-8"])
def test_unknown_preset_raises_key_error_listing_the_known(name):
    with pytest.raises(KeyError) as info:
        preset(name)
    message = str(info.value)
    assert "unknown preset" in message
    assert all(known in message for known in PRESETS)


def test_preset_shapes_are_consistent():
    for name, cfg in PRESETS.items():
        assert cfg.n_heads * cfg.head_dim == cfg.dim, name  # every preset uses dim // n_heads
        assert cfg.eos_ids, name
        assert cfg.max_seq_len >= 2048, name
    assert preset("Llama-3-8B").n_rep == 4 and preset("Llama-2-7B").n_rep == 1
    assert preset("Llama-3.2-1B").rope_scaling.rope_type == "llama3"


@pytest.mark.parametrize("n, d, expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (5, 1, 5)])
def test_ceil_div(n, d, expected):
    assert ceil_div(n, d) == expected


def test_the_kv_bytes_formula_is_one_and_every_layer_uses_it():
    """ModelConfig.kv_bytes is the one formula: the cache sizes (kv.memory), a handoff
    (serving.handoff), a transfer (measure.links) and a tensor-parallel rank (parallel.predict)."""
    from minillm.kv.memory import kv_bytes_per_token, kv_cache_bytes
    from minillm.measure.links import kv_bytes
    from minillm.parallel.predict import rank_kv_bytes
    from minillm.serving.handoff import kv_handoff_bytes

    c = preset("Llama-3-8B")
    assert c.kv_bytes(4096, 2) == 2 * 32 * 8 * 128 * 4096 * 2
    assert kv_bytes_per_token(c, "bf16") == c.kv_bytes(1, 2) and kv_cache_bytes(c, 4096, 3, "bf16") == 3 * c.kv_bytes(
        4096
    )
    assert kv_bytes(c, 4096, 2) == kv_handoff_bytes(c, 4096, 2) == c.kv_bytes(4096, 2)
    assert rank_kv_bytes(c, 4, 2, 1024, 2) == c.kv_bytes(2 * 1024, 2) / 4  # 8 K/V heads over 4 ranks
