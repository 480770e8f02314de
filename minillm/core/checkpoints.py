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

from .config import ModelConfig
from .device import best_device
from .hf_config import CheckpointError, config_from_hf, config_to_hf, read_json
from .model import Transformer, rope_inv_freq
from .tokenizer import Tokenizer

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"
DEFAULT_MODEL = "minillm-target"  # what the commands and benchmarks load unless told otherwise
# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def bundled_models() -> list[str]:
    """Names of the trained models that ship inside the package."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


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


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (all shards of a sharded one)."""
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
    for file in weight_files(directory):  # one shard at a time on the host, then on the device
        read: dict[str, torch.Tensor] = {}
        unexpected += _read_tensors(file, expected, skip, read)
        tensors.update({name: t.to(device=device, dtype=dtype) for name, t in read.items()})
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


def _read_tensors(file: Path, expected, skip, tensors: dict) -> list[str]:
    """Tensors of one safetensors file into ``tensors``, checked by name and shape; the unexpected names.

    Only reading the file is wrapped: a truncated or corrupt file is a CheckpointError naming it;
    ``load_state_dict`` moves each file's tensors afterwards, so an out-of-memory error fails as itself."""
    unexpected = []
    try:
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
                tensors[name] = t
    except (SafetensorError, OSError) as e:  # truncated, corrupt, not safetensors at all
        raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    return unexpected


def _checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, str(name).removeprefix("torch."), torch.float32)


def read_config(directory: Path) -> tuple[ModelConfig, dict]:
    """A checkpoint directory's model config (and its raw config.json, merged with generation_config's eos)."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    raw = read_json(cfg_path)
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "minillm":
        raise CheckpointError(
            f"{directory} holds a model quantized by minillm ({quant.get('scheme')}): load it with "
            "minillm.load (the runtime), which rebuilds its quantized layers"
        )
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(
            f"{directory} is a quantized checkpoint ({method}), a format minillm does not read; load the "
            "unquantized model and quantize it with minillm.compression.quantize"
        )
    gen = directory / "generation_config.json"
    if gen.is_file():  # generation_config.json's eos often lists more stop tokens than config.json's
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    try:
        config = config_from_hf(raw, name=directory.name)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from e
    return config, raw


def load_model(directory: Path, device=None, dtype: torch.dtype | None = None) -> Transformer:
    config, raw = read_config(directory)
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
    extra_config: dict | None = None,
) -> Path:
    """Write ``model`` as a LlamaForCausalLM checkpoint that both minillm and transformers load.

    ``extra_config`` adds entries to config.json (a quantized model records its scheme there)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {
        f"model.{k}" if not k.startswith("lm_head") else k: v.detach().to("cpu").contiguous()
        for k, v in to_hf_state_dict(model.state_dict(), config).items()
    }
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # absent when the head was replaced (e.g. quantized)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(config)
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    hf.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": hf["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out
