"""Hugging Face ``config.json`` <-> ``ModelConfig``, with every field checked.

Reads the layouts that old and new transformers versions write (``rope_parameters`` or
``rope_theta`` + ``rope_scaling``), refuses architectures and options minillm does not implement,
and turns every malformed field into a ``CheckpointError`` that names it: a missing required
field, a value of the wrong JSON type, an impossible value (through ``ModelConfig``'s checks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the reason in the message."""


def read_json(path: Path, what: str = "") -> dict:
    """A checkpoint's JSON file as a dict, or a CheckpointError naming the file and the problem."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object {what}, got a {type(value).__name__}")
    return value


def _rope_from_hf(cfg: dict) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from either layout: ``rope_parameters`` (transformers >= 5) or
    top-level ``rope_theta`` + ``rope_scaling`` (older versions, where the type key was ``type``
    before ``rope_type``)."""
    params = dict(_field(cfg, "rope_parameters", dict) or {})
    scaling = dict(_field(cfg, "rope_scaling", dict) or {})
    theta = params.pop("rope_theta", None)
    theta = _field(cfg, "rope_theta", (int, float), 10000.0) if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"unsupported RoPE scaling type {rope_type!r} (supported: default, linear, llama3)")
    if rope_type == "default":
        return float(theta), RopeScaling()
    known = {
        k: merged[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k in merged
    }
    try:
        return float(theta), RopeScaling(rope_type, **known)
    except ValueError as e:
        raise CheckpointError(f"config.json: rope scaling: {e}") from e


def _field(cfg: dict, key: str, kind: type | tuple[type, ...], default=None):
    """``cfg[key]`` when it is of ``kind`` (None or absent: ``default``), else a CheckpointError naming it."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool) and bool not in _kinds(kind)):
        names = " or ".join(k.__name__ for k in _kinds(kind)).replace("dict", "object").replace("str", "string")
        raise CheckpointError(f"config.json: {key} must be {names}, got {value!r} ({type(value).__name__})")
    return value


def _kinds(kind) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _flag(cfg: dict, key: str) -> bool:
    return _field(cfg, key, bool, False)


def config_from_hf(cfg: dict, name: str = "custom") -> ModelConfig:
    """A ModelConfig from the dict in a Hugging Face ``config.json``."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    archs = _field(cfg, "architectures", list, [])
    if not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures must be a list of class names, got {archs!r}")
    model_type = _field(cfg, "model_type", str)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if _field(cfg, "hidden_act", str, "silu") != "silu":
        raise CheckpointError(f"unsupported activation {cfg['hidden_act']!r}; only silu (SwiGLU) is supported")
    theta, scaling = _rope_from_hf(cfg)
    window = cfg.get("sliding_window")
    if family == "qwen2":
        layer_types = _field(cfg, "layer_types", list, [])
        if _flag(cfg, "use_sliding_window") or "sliding_attention" in layer_types:
            raise CheckpointError("Qwen2 checkpoints with sliding-window layers are not supported")
        window = None
    if family == "llama":
        window = None
    missing = [k for k in REQUIRED_FIELDS if k not in cfg]
    if missing:
        raise CheckpointError(f"config.json lacks required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    try:
        return _model_config(cfg, family, theta, scaling, window, name)
    except ValueError as e:  # a field of the wrong type or an impossible value, named by ModelConfig
        message = re.sub(r"ModelConfig\.(\w+)", lambda m: _hf_name(m.group(1)), str(e))
        raise CheckpointError(f"config.json: {message}") from e


# ModelConfig's field -> the config.json key it is read from, for error messages
HF_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
}


def _hf_name(field: str) -> str:
    """'n_heads' -> 'num_attention_heads (ModelConfig.n_heads)'; a field of the same name as is."""
    return f"{HF_NAMES[field]} (ModelConfig.{field})" if field in HF_NAMES else field


def _model_config(cfg: dict, family: str, theta: float, scaling: RopeScaling, window, name: str) -> ModelConfig:
    n_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim"),  # None: ModelConfig checks that the heads divide the width
        ffn_dim=cfg["intermediate_size"],
        max_seq_len=_field(cfg, "max_position_embeddings", int, 2048),
        norm_eps=_field(cfg, "rms_norm_eps", (int, float), 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=family == "qwen2" or _flag(cfg, "attention_bias"),
        o_bias=family == "llama" and _flag(cfg, "attention_bias"),
        mlp_bias=_flag(cfg, "mlp_bias"),
        tie_embeddings=_flag(cfg, "tie_word_embeddings"),
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_field(cfg, "eos_token_id", (int, list)),
        name=name,
    )


def config_to_hf(config: ModelConfig) -> dict:
    """A LlamaForCausalLM ``config.json`` dict (transformers >= 5 layout) for a ModelConfig."""
    if config.qkv_bias != config.o_bias:
        raise ValueError("a Llama config.json cannot express q/k/v bias without an output bias")
    s = config.rope_scaling
    rope = {"rope_type": s.rope_type, "rope_theta": config.rope_theta}
    if s.rope_type != "default":
        rope["factor"] = s.factor
    if s.rope_type == "llama3":
        rope.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # older transformers read these two top-level keys
        "rope_scaling": rope if s.rope_type != "default" else None,
        "rope_parameters": rope,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
        "torch_dtype": "float32",
    }
