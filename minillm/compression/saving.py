"""Saving and loading a quantized model: safetensors for the packed tensors, and the scheme in
config.json as ``quantization_config`` (``quant_method: "minillm"``), so that loading rebuilds
the same quantized layers before it reads their tensors. The q/k/v and gate/up stacks are split
into Hugging Face names as for an unquantized checkpoint (rows are output channels, so a
quantized matrix splits the same way). Loading never unpickles anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..core.checkpoints import from_hf_state_dict, resolve, save_pretrained
from ..core.device import best_device
from ..core.hf_config import CheckpointError, config_from_hf, read_json
from ..core.model import Transformer, rope_inv_freq
from ..core.tokenizer import Tokenizer
from .quant import QuantizedLinear, QuantSpec, prepare_kernels, quantized_layers, replace_module

QUANT_METHOD = "minillm"


def save_quantized(model: Transformer, directory: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Path:
    """Write a model returned by ``quantize`` (tensors + config.json with its quantization_config)."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("the model has no quantized layers: save it with minillm.save_pretrained")
    spec = next(iter(layers.values())).spec
    record = getattr(model, "quantization", {})
    config = {
        "quant_method": QUANT_METHOD,
        "scheme": spec.scheme,
        "group_size": spec.group_size,
        "method": record.get("method", "rtn"),
        "modules": sorted(layers),
    }
    return save_pretrained(model, directory, tokenizer, extra_config={"quantization_config": config})


def load_quantized(name_or_path: str | os.PathLike, device=None, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a directory written by ``save_quantized``.

    ``dtype`` is the compute dtype of everything not quantized (embedding, norms, activations):
    by default the saved one. On a CPU PyTorch's packed int8/int4 kernels want bf16."""
    directory = resolve(name_or_path)
    raw = read_json(directory / "config.json") if (directory / "config.json").is_file() else None
    if raw is None:
        raise CheckpointError(f"no config.json in {directory}")
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{directory} is not a model quantized by minillm (no minillm quantization_config)")
    try:
        config = config_from_hf(raw, name=directory.name)
        spec = QuantSpec(quant["scheme"], quant.get("group_size"))
        modules = list(quant["modules"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{directory}: quantization_config is not valid: {e}") from e
    device = torch.device(device) if device is not None else best_device()
    dtype = dtype or getattr(torch, str(raw.get("torch_dtype", "float32")), torch.float32)
    with torch.device("meta"):
        model = Transformer(config)
    for name in modules:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{directory}: quantization_config names {name!r}, which the model has not") from None
        layer = QuantizedLinear(linear.in_features, linear.out_features, spec, linear.bias is not None, "meta")
        replace_module(model, name, layer)
    state = _read_state(directory, config, dtype, device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    head_tied = config.tie_embeddings and "lm_head" not in modules
    if set(missing) - ({"lm_head.weight"} if head_tied else set()) or unexpected:
        raise CheckpointError(
            f"checkpoint in {directory} does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    model.inv_freq = rope_inv_freq(config).to(device)
    if head_tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.quantization = {k: quant.get(k) for k in ("scheme", "group_size", "method")}
    prepare_kernels(model.eval())
    tokenizer = Tokenizer.from_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return model.eval().requires_grad_(False), tokenizer  # for inference, as quantize() leaves it


def _read_state(directory: Path, config, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    file = directory / "model.safetensors"
    try:
        tensors = {k.removeprefix("model."): v for k, v in load_file(str(file)).items()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from e
    state = from_hf_state_dict(tensors, config)
    # Floating-point tensors outside the quantized layers take the compute dtype; the packed
    # codes, their scales and zero points stay exactly as saved.
    packed = (".qweight", ".scales", ".zeros")
    return {
        k: (v if k.endswith(packed) or not v.is_floating_point() else v.to(dtype)).to(device) for k, v in state.items()
    }


def is_quantized_checkpoint(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` is a local directory saved by ``save_quantized``."""
    config = Path(name_or_path) / "config.json"
    if not config.is_file():
        return False
    quant = read_json(config).get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD
