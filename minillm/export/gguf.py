"""A minillm model as a GGUF file that llama.cpp runs: ``python -m minillm export gguf``.

GGUF (ggml's single-file format, github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds a
header, typed key-value metadata, one info record per tensor (name, shape, ggml type, offset)
and then the aligned tensor data. llama.cpp builds its model from the metadata of one
architecture, here ``llama`` (``llama.context_length``, ``llama.block_count``, ...), finds the
weights by its own tensor names (``token_embd``, ``blk.N.attn_q``, ...), and rebuilds the
tokenizer from ``tokenizer.ggml.*``: the token strings, their types and, for a byte-level BPE
(``tokenizer.ggml.model = "gpt2"``), the merges and the name of the pre-tokenizer's regex.

Three conversions sit between minillm's layout and that one:

- minillm stacks q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``): they are split back into
  Hugging Face's matrices (``core.checkpoints.to_hf_state_dict``) and written one by one.
- Hugging Face's Llama rotates each (i, i + hd/2) pair of a head (rotate-half); llama.cpp's
  ``llama`` rope rotates adjacent pairs (2i, 2i + 1). Reordering the rows of W_q and W_k within
  each head (``permute_for_interleaved_rope``: row 2i <- i, row 2i + 1 <- i + hd/2) makes the
  adjacent rotation of the new layout compute the rotate-half one of the old. Attention scores
  are dot products of q and k over the head dimension, so the same reordering of both leaves
  them unchanged; W_v and W_o keep their layout.
- Weights are stored F32, F16, Q8_0 (blocks of 32 weights: one fp16 scale and 32 int8 codes,
  ``quantize_q8_0``) or Q4_0 (blocks of 32: one fp16 scale and 32 4-bit codes, ``quantize_q4_0``),
  written here with numpy; norms always F32, as llama.cpp's converter does. In a Q4_0 file the
  token embedding is Q4_0 too and the output matrix Q8_0 (llama.cpp's own Q4_0 recipe keeps the
  output at a higher precision: it sets every logit).

A model minillm quantized (``minillm.compression.quantize``, or a saved quantized directory) is
exported from its dequantized weights: Q8_0 then rounds them a second time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..compression.quant import QuantizedLinear
from ..core.checkpoints import to_hf_state_dict
from ..core.config import ModelConfig, RopeScaling
from ..core.model import Transformer, rope_inv_freq
from ..core.tokenizer import Tokenizer

FILE_TYPES = ("f32", "f16", "q8_0", "q4_0")
LLAMA_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # general.file_type: ALL_F32, MOSTLY_F16, ...
Q8_0_BLOCK = 32  # weights per Q8_0 block; a block is 2 bytes of fp16 scale + 32 int8 codes
Q4_0_BLOCK = 32  # weights per Q4_0 block; a block is 2 bytes of fp16 scale + 16 bytes of 4-bit codes
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # tokenizer.ggml.token_type

# Hugging Face tensor names (as core.checkpoints writes them) -> llama.cpp's, per block and global.
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}


class ExportError(ValueError):
    """A model, tokenizer or option this exporter cannot write, with the reason."""


def require_gguf():
    """The ``gguf`` package (llama.cpp's own writer of the format), or an error saying how to get it."""
    try:
        import gguf
    except ImportError as e:
        raise ExportError("exporting GGUF needs the gguf package: pip install gguf (or minillm[gguf])") from e
    return gguf


# ---------------------------------------------------------------------------------------------
# RoPE layouts


def permute_for_interleaved_rope(w: Tensor, n_heads: int) -> Tensor:
    """Rows of W_q or W_k (n_heads * hd, dim) from the rotate-half layout to the interleaved one:
    within each head, row 2i is old row i and row 2i + 1 is old row i + hd/2."""
    rows, dim = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, dim).transpose(1, 2).reshape(rows, dim)


def unpermute_from_interleaved_rope(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``permute_for_interleaved_rope``."""
    rows, dim = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def apply_rope_interleaved(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """llama.cpp's ``llama`` rope: rotate each adjacent pair (2i, 2i + 1) of x (B, H, T, hd) by
    position * inv_freq[i]; positions (T,)."""
    angles = positions.float()[:, None] * inv_freq  # (T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, H, T, hd/2)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Q8_0


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float32, cols a multiple of 32 -> (rows, cols / 32 * 34) bytes of Q8_0 blocks.

    Each block of 32 weights keeps d = max|w| / 127 as fp16 and the codes round(w / d) as int8
    (rounded half away from zero, as ggml's reference quantizer does)."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(rows, cols // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127  # (rows, n_blocks, 1)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, 1 / d, 0)
    scaled = blocks * inverse
    codes = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    scale_bytes = d.astype("<f2").view(np.uint8)  # (rows, n_blocks, 2)
    return np.concatenate([scale_bytes, codes.view(np.uint8)], axis=-1).reshape(rows, -1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """(rows, n_blocks * 34) bytes of Q8_0 blocks -> (rows, n_blocks * 32) float32."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 2 + Q8_0_BLOCK)
    d = blocks[..., :2].copy().view("<f2").astype(np.float32)  # (rows, n_blocks, 1)
    codes = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (codes * d).reshape(rows, -1)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float32, cols a multiple of 32 -> (rows, cols / 32 * 18) bytes of Q4_0 blocks.

    Each block keeps d = m / -8 as fp16, m its weight of largest magnitude (sign included), and
    the codes q = min(15, floor(w / d + 8.5)), so w ~ (q - 8) * d: m itself is code 0 (-8 d) and
    the other end of the range reaches 7 d. Byte j holds weight j in its low nibble and weight
    j + 16 in its high one."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(rows, cols // Q4_0_BLOCK, Q4_0_BLOCK)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)  # (rows, n, 1)
    d = peak / -8
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, 1 / d, 0)
    codes = np.minimum(15, np.floor(blocks * inverse + 8.5)).astype(np.uint8)
    half = Q4_0_BLOCK // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    scale_bytes = d.astype("<f2").view(np.uint8)
    return np.concatenate([scale_bytes, packed], axis=-1).reshape(rows, -1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """(rows, n_blocks * 18) bytes of Q4_0 blocks -> (rows, n_blocks * 32) float32."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 2 + Q4_0_BLOCK // 2)
    d = blocks[..., :2].copy().view("<f2").astype(np.float32)
    packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.float32)
    return ((codes - 8) * d).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# Weights


def float_weights(model: Transformer) -> tuple[dict[str, Tensor], bool]:
    """Every weight as fp32 in minillm's names (quantized layers dequantized), and whether any was."""
    state = {n: p.detach().float().cpu() for n, p in model.named_parameters(remove_duplicate=False)}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, layer in quantized.items():
        state[f"{name}.weight"] = layer.dequantized_weight(torch.float32).cpu()
        if layer.bias is not None:
            state[f"{name}.bias"] = layer.bias.detach().float().cpu()
    return state, bool(quantized)


def check_exportable(config: ModelConfig) -> None:
    """ExportError for the options llama.cpp's ``llama`` architecture does not express this way."""
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        raise ExportError(f"{config.name} has linear biases; the GGUF exporter writes bias-free Llama models only")
    if config.sliding_window is not None:
        raise ExportError(f"{config.name} uses a sliding window, which the llama architecture does not have")


def llama_cpp_tensors(model: Transformer) -> tuple[dict[str, Tensor], bool]:
    """llama.cpp's tensor name -> fp32 tensor, Q and K permuted for its rope; and whether the model
    was quantized. ``output.weight`` only when the head is not the embedding."""
    config = model.config
    state, quantized = float_weights(model)
    tied = getattr(model.lm_head, "weight", None) is model.embed_tokens.weight  # a quantized head has none
    lm_head = state.pop("lm_head.weight")
    out = {}
    for name, tensor in to_hf_state_dict(state, config).items():
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)  # "layers", "3", "self_attn.q_proj.weight"
        if rest == "self_attn.q_proj.weight":
            tensor = permute_for_interleaved_rope(tensor, config.n_heads)
        elif rest == "self_attn.k_proj.weight":
            tensor = permute_for_interleaved_rope(tensor, config.n_kv_heads)
        out[f"blk.{layer}.{BLOCK_NAMES[rest]}"] = tensor
    if not tied:
        out["output.weight"] = lm_head
    freqs = rope_freq_factors(config)
    if freqs is not None:
        out["rope_freqs.weight"] = freqs
    return out, quantized


def rope_freq_factors(config: ModelConfig) -> Tensor | None:
    """Llama 3.1's scaled frequencies as llama.cpp takes them: a divisor per pair (rope_freqs)."""
    if config.rope_scaling.rope_type != "llama3":
        return None
    default = dataclasses.replace(config, rope_scaling=RopeScaling())
    return rope_inv_freq(default) / rope_inv_freq(config)


def stored(tensor: Tensor, file_type: str, gguf, name: str = "") -> tuple[np.ndarray, object]:
    """(array, ggml type) for one tensor: 1-D ones stay F32; Q8_0 and Q4_0 need rows of whole
    blocks (else F16); in a Q4_0 file the output matrix is Q8_0."""
    w = tensor.numpy().astype(np.float32)
    T = gguf.GGMLQuantizationType
    if file_type == "f32" or w.ndim == 1:
        return w, T.F32
    if file_type == "q4_0" and name == "output.weight":
        file_type = "q8_0"
    if file_type == "q8_0" and w.shape[-1] % Q8_0_BLOCK == 0:
        return quantize_q8_0(w), T.Q8_0
    if file_type == "q4_0" and w.shape[-1] % Q4_0_BLOCK == 0:
        return quantize_q4_0(w), T.Q4_0
    return w.astype(np.float16), T.F16


# ---------------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True)
class GGUFVocab:
    """A byte-level BPE tokenizer in GGUF's terms."""

    tokens: list[str]  # by id, padded to the embedding's rows
    token_types: list[int]
    merges: list[str]  # "left right", highest priority first
    pre: str  # llama.cpp's name for the pre-tokenizer's split regex ("gpt-2")
    bos_id: int | None
    eos_id: int | None
    add_bos: bool


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int) -> GGUFVocab:
    """The tokenizer as ``tokenizer.ggml.*`` wants it; ExportError unless it is GPT-2-style byte-level BPE."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ExportError(
            "the GGUF exporter writes byte-level BPE tokenizers with GPT-2's split regex only "
            f"(found model {model.get('type')!r}, pre-tokenizer {pre.get('type')!r})"
        )
    by_id = {i: t for t, i in model["vocab"].items()}
    types = dict.fromkeys(by_id, TOKEN_NORMAL)
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    if max(by_id) >= vocab_size:
        raise ExportError(f"the tokenizer has id {max(by_id)}, beyond the model's {vocab_size} embeddings")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, TOKEN_UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if any(len(m.split(" ")) != 2 for m in merges):
        raise ExportError("a BPE merge has a space inside a token, which GGUF's 'left right' merges cannot hold")
    bos = tokenizer.bos_id
    add_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    # "gpt-2" (with the hyphen) is llama.cpp's name for GPT-2's split regex; the model type is "gpt2"
    return GGUFVocab(tokens, token_types, merges, "gpt-2", bos, tokenizer.eos_id, add_bos)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class GGUFExport:
    """What ``export_gguf`` wrote."""

    path: Path
    file_type: str
    tensors: int
    bytes: int
    requantized: bool  # the model was quantized by minillm: its dequantized weights were written

    def summary(self) -> str:
        note = " (from the dequantized weights of a minillm-quantized model)" if self.requantized else ""
        return f"wrote {self.path}: {self.tensors} tensors, {self.file_type.upper()}{note}, {self.bytes / 1e6:.1f} MB"


def add_metadata(writer, config: ModelConfig, file_type: str, gguf) -> None:
    """The ``general.*`` and ``llama.*`` keys llama.cpp builds its model from."""
    writer.add_name(config.name)
    writer.add_file_type(LLAMA_FILE_TYPE[file_type])
    writer.add_quantization_version(2)  # ggml's current block layouts (GGML_QNT_VERSION)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.rope_scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)


def add_vocab(writer, vocab: GGUFVocab, chat_template: str | None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(vocab.add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def export_gguf(
    model: Transformer, tokenizer: Tokenizer, path: str | os.PathLike, file_type: str = "f32"
) -> GGUFExport:
    """Write ``model`` and ``tokenizer`` to ``path`` as a GGUF file of architecture ``llama``."""
    if file_type not in FILE_TYPES:
        raise ExportError(f"GGUF type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    gguf = require_gguf()
    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        reason = "it is a directory" if path.is_dir() else f"no directory {path.parent}"
        raise ExportError(f"cannot write {path}: {reason}")
    check_exportable(model.config)
    vocab = gguf_vocab(tokenizer, model.config.vocab_size)
    tensors, requantized = llama_cpp_tensors(model)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, model.config, file_type, gguf)
    add_vocab(writer, vocab, tokenizer.chat_template)
    for name, tensor in tensors.items():
        array, ggml_type = stored(tensor, file_type, gguf, name)
        writer.add_tensor(name, array, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFExport(path, file_type, len(tensors), path.stat().st_size, requantized)


def export_checkpoint(name_or_path: str | os.PathLike, path: str | os.PathLike, file_type: str = "f32") -> GGUFExport:
    """Load a bundled model, a checkpoint directory or a saved quantized one on the CPU, and export it."""
    from ..runtime import RuntimeOptions, load_model

    if file_type not in FILE_TYPES:  # before loading
        raise ExportError(f"GGUF type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    require_gguf()
    model, tokenizer = load_model(name_or_path, RuntimeOptions(device="cpu", dtype=torch.float32))
    if tokenizer is None:
        raise ExportError(f"{name_or_path} has no tokenizer.json; a GGUF file for llama.cpp needs the tokenizer")
    return export_gguf(model, tokenizer, path, file_type)
