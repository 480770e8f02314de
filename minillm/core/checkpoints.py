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
from safetensors import SafetensorError, safe_open
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
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    params = dict(_field(cfg, "rope_parameters", dict) or {})
    scaling = dict(_field(cfg, "rope_scaling", dict) or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
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
        raise CheckpointError(f"config.json: {e}") from e


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
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
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
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor names to file names")
        files = [directory / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are not in {directory}: {', '.join(absent)}")
        return files
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
        try:
            unexpected += _read_tensors(file, expected, dtype, device, skip, tensors)
        except (SafetensorError, OSError, RuntimeError) as e:  # truncated, corrupt, not safetensors at all
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e
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


def _read_tensors(file: Path, expected, dtype, device, skip, tensors: dict) -> list[str]:
    """Tensors of one safetensors file into ``tensors``, checked by name and shape; the unexpected names."""
    unexpected = []
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
    return unexpected


def _checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, str(name).removeprefix("torch."), torch.float32)


def load_model(directory: Path, device=None, dtype: torch.dtype | None = None) -> Transformer:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    raw = read_json(cfg_path)
    gen = directory / "generation_config.json"
    if gen.is_file():  # generation_config.json's eos often lists more stop tokens than config.json's
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    try:
        config = config_from_hf(raw, name=directory.name)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from e
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
    tokenizer = _load_tokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    return model, tokenizer


def _load_tokenizer(directory: Path) -> Tokenizer:
    try:
        return Tokenizer.from_dir(directory)
    except CheckpointError:
        raise
    except Exception as e:  # the tokenizers library raises its own exception types for a bad file
        raise CheckpointError(f"{directory / 'tokenizer.json'} cannot be read as a tokenizer: {e}") from e


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
