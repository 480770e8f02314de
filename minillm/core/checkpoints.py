"""Loading and saving checkpoints in the Hugging Face layout.

A checkpoint is a directory with ``config.json``, the weights as ``model.safetensors`` or as
shards listed in ``model.safetensors.index.json``, and usually ``tokenizer.json``. This module
reads the config (as written by old and new transformers versions), checks every tensor by
name and shape, and never unpickles anything: safetensors holds raw tensors only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, RopeScaling
from .device import best_device
from .model import Transformer, rope_inv_freq
from .tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"
# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the reason in the message."""


def bundled_models() -> list[str]:
    """Names of the trained models that ship inside the package."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope_from_hf(cfg: dict) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from either layout: ``rope_parameters`` (transformers >= 5) or
    top-level ``rope_theta`` + ``rope_scaling`` (older versions, where the type key was ``type``
    before ``rope_type``)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"unsupported RoPE scaling type {rope_type!r} (supported: default, linear, llama3)")
    if rope_type == "default":
        return float(theta), RopeScaling()
    known = {
        k: merged[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k in merged
    }
    return float(theta), RopeScaling(rope_type, **known)


def config_from_hf(cfg: dict, name: str = "custom") -> ModelConfig:
    """A ModelConfig from the dict in a Hugging Face ``config.json``."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported activation {cfg['hidden_act']!r}; only silu (SwiGLU) is supported")
    theta, scaling = _rope_from_hf(cfg)
    window = cfg.get("sliding_window")
    if family == "qwen2":
        layer_types = set(cfg.get("layer_types") or [])
        if cfg.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise CheckpointError("Qwen2 checkpoints with sliding-window layers are not supported")
        window = None
    if family == "llama":
        window = None
    n_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=family == "llama" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
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


# ---------------------------------------------------------------------------------------------
# Resolving a name to a directory


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local directory, a bundled model's name, or a hub id downloaded when online."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name in bundled_models():
        return BUNDLED_DIR / name
    if path.exists():
        raise CheckpointError(f"{name} is a file; pass the checkpoint directory that holds config.json")
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointError(
            f"no checkpoint directory at {name!r}, and it is neither a bundled model "
            f"({', '.join(bundled_models()) or 'none'}) nor a hub id like 'org/name'"
        )
    return _download(name)


def _download(hub_id: str) -> Path:
    offline_hint = f"pass a local path to a downloaded copy of {hub_id!r} instead"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise CheckpointError(f"{hub_id!r} looks like a hub id but HF_HUB_OFFLINE is set; {offline_hint}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise CheckpointError(
            f"loading hub id {hub_id!r} needs huggingface_hub (pip install huggingface_hub); or {offline_hint}"
        ) from e
    patterns = [
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as e:  # network errors come in many types
        raise CheckpointError(
            f"could not download {hub_id!r} from the Hugging Face hub "
            f"({type(e).__name__}: {e}); if you are offline, {offline_hint}"
        ) from e


# ---------------------------------------------------------------------------------------------
# Weights


def fused_parts(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """minillm's stacked projections -> the Hugging Face matrices they hold, with their rows."""
    q, kv, f = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    return {
        "self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "mlp.gate_up_proj": [("mlp.gate_proj", f), ("mlp.up_proj", f)],
    }


def _fused_key(name: str, parts: dict) -> tuple[str, str, str] | None:
    """'layers.3.mlp.gate_up_proj.weight' -> ('layers.3.', 'mlp.gate_up_proj', 'weight')."""
    for fused in parts:
        marker = f".{fused}."
        if marker in name:
            prefix, param = name.split(marker)
            return prefix + ".", fused, param
    return None


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """minillm tensor names -> Hugging Face names, the stacked projections split apart."""
    parts, out = fused_parts(config), {}
    for name, tensor in state.items():
        key = _fused_key(name, parts)
        if key is None:
            out[name] = tensor
            continue
        prefix, fused, param = key
        pieces = tensor.split([rows for _, rows in parts[fused]], dim=0)
        out.update({f"{prefix}{hf}.{param}": piece for (hf, _), piece in zip(parts[fused], pieces)})
    return out


def from_hf_state_dict(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> minillm's, stacking q/k/v and gate/up (the inverse of to_hf_state_dict).

    Every member of a group must be present (load_state_dict checks that first)."""
    parts, out = fused_parts(config), dict(tensors)
    for name in tensors:
        for fused, members in parts.items():
            first = f".{members[0][0]}."  # e.g. ".self_attn.q_proj."
            if first in name:
                prefix, param = name.split(first)
                group = [f"{prefix}.{hf}.{param}" for hf, _ in members]
                out[f"{prefix}.{fused}.{param}"] = torch.cat([out.pop(n) for n in group], dim=0)
    return out


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return shards
    found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
    raise CheckpointError(
        f"no safetensors weights in {directory} (found: {found}); "
        "pickled .bin/.pt checkpoints are not loaded because unpickling can run code"
    )


def load_state_dict(
    directory: Path,
    expected: dict[str, torch.Size],
    dtype: torch.dtype,
    device: torch.device,
    skip: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Read every tensor, check names and shapes against ``expected``, convert dtype/device.

    Tensors named in ``skip`` (or ending in IGNORED_SUFFIXES) are passed over if present."""
    tensors: dict[str, torch.Tensor] = {}
    unexpected = []
    for file in _weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key.removeprefix("model.")
                if name.endswith(IGNORED_SUFFIXES) or name in skip:
                    continue
                if name not in expected:
                    unexpected.append(key)
                    continue
                t = f.get_tensor(key)
                if t.shape != expected[name]:
                    raise CheckpointError(
                        f"shape mismatch for tensor {key!r}: expected {tuple(expected[name])}, got {tuple(t.shape)}"
                    )
                tensors[name] = t.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(sorted(unexpected)[:10])}" + (" ..." if len(unexpected) > 10 else "")
            )
        raise CheckpointError(f"checkpoint in {directory} does not fit its config: " + "; ".join(parts))
    return tensors


def _checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, str(name).removeprefix("torch."), torch.float32)


def load_model(directory: Path, device=None, dtype: torch.dtype | None = None) -> Transformer:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    raw = json.loads(cfg_path.read_text())
    gen = directory / "generation_config.json"
    if gen.is_file():  # generation_config.json's eos often lists more stop tokens than config.json's
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    config = config_from_hf(raw, name=directory.name)
    device = torch.device(device) if device is not None else best_device()
    if dtype is None:  # the checkpoint's own dtype on an accelerator; fp32 on a CPU
        dtype = torch.float32 if device.type == "cpu" else _checkpoint_dtype(raw)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k: v.shape for k, v in to_hf_state_dict(model.state_dict(), config).items()}
    skip: tuple[str, ...] = ()
    if config.tie_embeddings:  # the head is the embedding; some tied checkpoints store a copy anyway
        expected.pop("lm_head.weight")
        skip = ("lm_head.weight",)
    state = from_hf_state_dict(load_state_dict(directory, expected, dtype, device, skip), config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if set(missing) - {"lm_head.weight"} or unexpected:  # load_state_dict checked names: a bug if reached
        raise CheckpointError(f"internal error mapping {directory}: missing {missing}, unexpected {unexpected}")
    model.inv_freq = rope_inv_freq(config).to(device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def load(name_or_path: str | os.PathLike, device=None, dtype: torch.dtype | None = None):
    """Load ``(model, tokenizer)`` from a local HF-layout directory, a bundled model's name, or a
    hub id (downloaded only when online). The tokenizer is None when there is no tokenizer.json.
    """
    directory = resolve(name_or_path)
    model = load_model(directory, device, dtype)
    tokenizer = Tokenizer.from_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return model, tokenizer


def save_pretrained(
    model: Transformer,
    directory: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` as a LlamaForCausalLM checkpoint that both minillm and transformers load."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {
        f"model.{k}" if not k.startswith("lm_head") else k: v.detach().to("cpu").contiguous()
        for k, v in to_hf_state_dict(model.state_dict(), config).items()
    }
    if config.tie_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(config)
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": hf["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out
