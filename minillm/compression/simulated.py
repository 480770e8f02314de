"""Simulated quantization: what a format's rounding costs in quality, measured without a kernel
that stores or multiplies it (chapter 12). Weights are replaced by their rounded values in the
model's own dtype, and activations are rounded on their way into each linear, so the model
computes in floating point exactly what the format would give; its speed is another question
(``quant.QuantizedLinear`` and its kernels answer it for int8 and int4).

- ``rtn_nbit``: asymmetric b-bit codes per group, int2 and int3 as well as int4: the rule of
  ``quant.int4_group_params`` with 2^b - 1 steps;
- ``gptq_round``: GPTQ's error feedback (``gptq``) onto the same b-bit grid, where the notes'
  claim that calibration keeps 3 bits usable is tested;
- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al., 2023): 16 levels at quantiles of a
  standard normal, each block of 64 weights scaled by its largest magnitude;
- ``w8a8``: int8 weights per output channel and int8 activations per token (each row of x
  scaled by its own absmax / 127 on the fly), the arithmetic of an int8 matrix product;
- ``smooth``: SmoothQuant's migration (Xiao et al., 2023) before W8A8: each input channel j of
  a linear is divided by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and its weight column
  multiplied by s_j, folded into the op before as AWQ folds its scales (``awq.fold_scale``), so
  that outlier channels of the activations hand part of their range to the weights.

    simulated = round_weights(copy.deepcopy(model), lambda w: rtn_nbit(w, 3, 128))
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..core.model import Transformer
from .awq import can_fold, fold_scale, kv_groups
from .calibration import capture_inputs
from .fastpath import quantize_tokens
from .gptq import GPTQOptions, Grid, gptq_round_weight, gptq_walk
from .quant import dequantize_int8, linear_layers, padded_groups, quantize_int8

NF4_BLOCK = 64  # weights per absmax scale, QLoRA's default


def check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}")


def nbit_group_params(groups: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Scale and zero point (...,), (...,) of each group (..., g) for ``bits``-bit asymmetric
    codes: the group's range, widened to include 0, cut into 2^bits - 1 steps (an fp32 scale);
    the zero point is the code of 0."""
    levels = 2**bits - 1
    lo = groups.amin(dim=-1).clamp(max=0).float()
    hi = groups.amax(dim=-1).clamp(min=0).float()
    scale = ((hi - lo) / levels).clamp(min=1e-8)
    return scale, torch.round(-lo / scale).clamp(0, levels)


def nbit_codes(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """The codes 0..2^bits - 1 of w given the scale and zero point that apply to it (broadcast)."""
    return (torch.round(w.float() / scale) + zero).clamp(0, 2**bits - 1)


def nbit_grid(bits: int) -> Grid:
    """``rtn_nbit``'s rule as the grid GPTQ rounds onto (``gptq.Grid``)."""
    check_bits(bits)
    return Grid(lambda groups: nbit_group_params(groups, bits), lambda w, s, z: nbit_codes(w, s, z, bits))


def rtn_nbit(w: Tensor, bits: int, group_size: int) -> Tensor:
    """Round to nearest with ``bits``-bit asymmetric codes per group of ``group_size`` inputs:
    w (N, K) -> the dequantized weights (N, K), fp32 (``nbit_group_params``, ``nbit_codes``)."""
    check_bits(bits)
    k = w.shape[1]
    groups = padded_groups(w.float(), group_size)  # (N, G, g)
    scale, zero = nbit_group_params(groups, bits)  # (N, G) each
    codes = nbit_codes(groups, scale[..., None], zero[..., None], bits)  # (N, G, g)
    return ((codes - zero[..., None]) * scale[..., None]).flatten(1)[:, :k]


@torch.no_grad()
def gptq_round(
    model: Transformer, bits: int, group_size: int, calibration: Tensor, skip: tuple[str, ...] = (), **options
) -> Transformer:
    """GPTQ at ``bits`` bits, simulated, in place: every nn.Linear (but ``skip``) is rounded by
    GPTQ's error feedback onto ``rtn_nbit``'s grid, block by block on ``calibration`` (token ids
    (n, T)) as ``gptq.gptq_quantize`` walks, and its weight replaced by the dequantized values
    (a tied head is untied, as ``round_weights`` does). With an identity Hessian it is
    ``rtn_nbit``. ``options``: the fields of ``gptq.GPTQOptions``. Returns the model."""
    grid = nbit_grid(bits)
    opts = GPTQOptions.from_options(options)
    embedding = getattr(model, "embed_tokens", None)

    def process(name: str, stats) -> None:
        linear = model.get_submodule(name)
        codes, scales, zeros = gptq_round_weight(
            linear.weight, stats.hessian, group_size, opts.block_size, opts.damp, grid
        )  # (N, G * g), (N, G), (N, G)
        groups = codes.view(codes.shape[0], -1, group_size)  # (N, G, g)
        dequantized = (groups - zeros[..., None]) * scales[..., None]
        _set_weight(linear, embedding, dequantized.flatten(1)[:, : linear.in_features])

    return gptq_walk(model, calibration, linear_layers(model, skip), opts, process)


def nf4_levels() -> Tensor:
    """The 16 NormalFloat levels in [-1, 1]: 8 positive and 7 negative quantiles of a standard
    normal, evenly spaced in probability from the tail to the middle, and an exact 0, each side
    normalized so that its outermost level is 1 (QLoRA's asymmetric construction: one more level
    on the positive side, and 0 stays exact)."""
    tail = 0.5 * (1 / 32 + 1 / 30)  # the outermost level's probability, between the two halves' steps
    ndtri = torch.special.ndtri
    positive = ndtri(torch.linspace(1 - tail, 0.5, 9, dtype=torch.float64)[:-1])  # 8 levels > 0
    negative = -ndtri(torch.linspace(1 - tail, 0.5, 8, dtype=torch.float64)[:-1])  # 7 levels < 0
    levels = torch.cat(
        [positive / positive.max(), torch.zeros(1, dtype=torch.float64), negative / negative.abs().max()]
    )
    return levels.sort().values.float()


def nf4(w: Tensor, block: int = NF4_BLOCK) -> Tensor:
    """NF4: each block of ``block`` consecutive weights (row-major) divided by its absmax, every
    weight replaced by the nearest NormalFloat level, times the absmax again: w -> the
    dequantized weights, fp32, same shape."""
    flat = w.float().flatten()
    pad = (-flat.numel()) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)  # (B, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    levels = nf4_levels().to(w.device)
    codes = ((blocks / absmax)[..., None] - levels).abs().argmin(dim=-1)  # (B, block)
    return (levels[codes] * absmax).flatten()[: flat.numel()].view(w.shape)


def nf4_bits_per_weight(block: int = NF4_BLOCK, scale_bits: int = 32) -> float:
    """4 bits per code plus one absmax per block (fp32 in QLoRA before its double quantization)."""
    return 4 + scale_bits / block


@torch.no_grad()
def round_weights(model: nn.Module, rounding: Callable[[Tensor], Tensor], skip: tuple[str, ...] = ()) -> nn.Module:
    """Every nn.Linear's weight (but those named in ``skip``) replaced, in place, by
    ``rounding(weight)`` in the weight's dtype; a head tied to the embedding is untied first, so
    the lookup keeps its original table. Returns the model."""
    embedding = getattr(model, "embed_tokens", None)
    for linear in linear_layers(model, skip).values():
        _set_weight(linear, embedding, rounding(linear.weight.detach()))
    return model


def _set_weight(linear: nn.Linear, embedding: nn.Module | None, rounded: Tensor) -> None:
    """The linear's weight replaced by ``rounded`` (in its dtype); a head tied to the embedding is
    untied first, so the lookup keeps its original table."""
    rounded = rounded.to(linear.weight.dtype)
    if embedding is not None and linear.weight is embedding.weight:
        linear.weight = nn.Parameter(rounded, requires_grad=linear.weight.requires_grad)
    else:
        linear.weight.data.copy_(rounded)


def quantize_rows_int8(x: Tensor) -> Tensor:
    """Per-token (per-row) symmetric int8 of activations x (..., K), dequantized: each row's
    absmax maps to 127. What a W8A8 kernel multiplies (``fastpath.quantize_tokens``), in floating
    point."""
    a, t = quantize_tokens(x.reshape(-1, x.shape[-1]))
    return (a.float() * t).to(x.dtype).view(x.shape)


def w8a8(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Simulated W8A8, in place: int8 per-channel weights (``quant.quantize_int8``) and a forward
    pre-hook on each of those linears rounding its input to per-token int8. Returns the model
    (the hooks stay on it: use a copy)."""
    round_weights(model, lambda w: dequantize_int8(*quantize_int8(w)), skip)
    for linear in linear_layers(model, skip).values():
        linear.register_forward_pre_hook(lambda module, args: (quantize_rows_int8(args[0]), *args[1:]))
    return model


@torch.no_grad()
def smoothing_scales(weight: Tensor, input_absmax: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's s (K,): max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j, where
    max|W_j| is the largest magnitude of weight column j; a dead channel keeps s = 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-8)  # (K,)
    x_max = input_absmax.float().clamp(min=1e-8)
    s = x_max.pow(alpha) / w_max.pow(1 - alpha)
    return torch.where(input_absmax > 0, s, torch.ones_like(s))


@torch.no_grad()
def smooth(model: Transformer, calibration: Tensor, alpha: float = 0.5) -> Transformer:
    """SmoothQuant's migration, in place: each block linear's input channels divided by
    ``smoothing_scales`` (from the largest |x| per channel on ``calibration``, token ids (B, T))
    and its weight columns multiplied by them, folded into the op before; the model computes the
    same function. The LM head is left alone (its input is also the hidden state other heads
    read). Every scale is computed on the original model before any is folded."""
    absmax: dict[str, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        absmax[name] = torch.maximum(absmax[name], m) if name in absmax else m

    names = [n for n in linear_layers(model) if n != "lm_head" and can_fold(model, n)]
    capture_inputs(model, names, calibration, record)
    scales = {}
    for name in names:
        s = smoothing_scales(model.get_submodule(name).weight, absmax[name], alpha)
        groups = kv_groups(model, name)
        if groups is not None:  # o_proj: one scale per (kv head, dim), shared by its query heads
            s = s.view(groups).mean(dim=1, keepdim=True).expand(groups).flatten()
        scales[name] = s
    for name, s in scales.items():
        fold_scale(model, name, s)
    return model


def smoothed_w8a8(model: Transformer, calibration: Tensor, alpha: float = 0.5) -> Transformer:
    """A copy of ``model`` smoothed (``smooth``), then W8A8 (``w8a8``)."""
    return w8a8(smooth(copy.deepcopy(model), calibration, alpha))


__all__ = [
    "gptq_round",
    "nbit_codes",
    "nbit_group_params",
    "nbit_grid",
    "nf4",
    "nf4_bits_per_weight",
    "nf4_levels",
    "quantize_rows_int8",
    "round_weights",
    "rtn_nbit",
    "smooth",
    "smoothed_w8a8",
    "smoothing_scales",
    "w8a8",
]
