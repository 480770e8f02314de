"""GPTQ (Frantar et al., 2023, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): round the columns of a weight one at a time, and after each one move
its rounding error onto the columns not yet rounded, in proportion to how the inputs correlate.

For one linear W (N, K) and the Hessian H = 2/n X^T X (K, K) of its calibration inputs X, the
layer's output error ||X W^T - X Q^T||^2 is a quadratic in each row of W with that Hessian
(Optimal Brain Quantization, Frantar & Alistarh, 2022). Rounding column j by e_j and then
updating the remaining columns by -e_j * [H^-1]_{j, j+1:} / [H^-1]_{jj} is that quadratic's
optimal compensation. GPTQ makes it cheap and stable:

- one column order for all rows (left to right), so that the inverse Hessians of all the
  shrinking column sets are read off one Cholesky factor U of H^-1 (upper, H^-1 = U^T U):
  row j of U, divided by U_jj, is the update of column j;
- damping: lambda = damp * mean(diag H) added to the diagonal; a dead input (diag 0, never
  non-zero in the calibration data) gets diag 1 and its weights are set to 0;
- lazy batch updates: inside a block of ``block_size`` columns the error is spread column by
  column; the columns after the block receive the block's errors in one matrix product.

The format is exactly RTN int4's (``quant.int4_group_params`` / ``int4_codes``): w ~ (q - z) * s,
one fp16 scale and one zero point per group of ``group_size`` input weights, computed from the
group's *current* weights (already updated by the errors of the columns before it) when the
first column of the group comes up. With H = identity nothing is compensated and GPTQ is RTN.

``gptq_quantize`` runs it layer by layer over a model (``transform.quantize(method="gptq")``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.model import Transformer
from .calibration import HessianAccumulator, LayerWalk, check_positive_int, options_from
from .quant import QuantizedLinear, QuantSpec, int4_codes, int4_group_params, padded_groups, replace_module


@dataclass(frozen=True)
class Grid:
    """What GPTQ rounds onto: ``params(groups (N, g)) -> scale (N,), zero (N,)`` from a group's
    current weights, and ``codes(w, scale, zero)``, the codes of weights given them (broadcast),
    such that w ~ (codes - zero) * scale."""

    params: Callable[[Tensor], tuple[Tensor, Tensor]]
    codes: Callable[[Tensor, Tensor, Tensor], Tensor]


INT4_GRID = Grid(int4_group_params, int4_codes)  # the stored format: fp16 scales, codes 0..15


@dataclass(frozen=True)
class GPTQOptions:
    block_size: int = 128  # columns rounded between two lazy batch updates (a multiple of the group)
    damp: float = 0.01  # lambda = damp * mean(diag H), added to H's diagonal
    true_sequential: bool = True  # inside a block each linear calibrates on the quantized ones before it
    batch_size: int = 8  # calibration windows per forward

    def __post_init__(self):
        check_positive_int("block_size", self.block_size)
        if not isinstance(self.damp, (int, float)) or not 0 <= self.damp < 1:
            raise ValueError(f"damp must be in [0, 1) (a fraction of the mean of diag H), got {self.damp!r}")
        check_positive_int("batch_size", self.batch_size)

    @classmethod
    def from_options(cls, options: dict) -> GPTQOptions:
        return options_from(cls, options, "GPTQ")


def inverse_hessian_factor(hessian: Tensor, damp: float, size: int | None = None) -> tuple[Tensor, Tensor]:
    """The upper Cholesky factor U of (H + lambda I)^-1 and the mask of dead inputs (diag 0, given
    diag 1). ``size`` > K pads H with an identity block (the padding of a last, short group):
    (size, size) and (size,). In fp64: K is at most a few thousand, and it is done once."""
    k = hessian.shape[0]
    size = size or k
    h = torch.eye(size, dtype=torch.float64, device=hessian.device)  # (size, size)
    h[:k, :k] = hessian.detach().double()
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0
    h.diagonal()[:k] += damp * h.diagonal()[:k].mean()
    lower, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise ValueError(f"the Hessian is not positive definite even with damp={damp}: raise damp")
    h_inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(h_inv, upper=True), dead


def gptq_quantize_weight(
    weight: Tensor,
    hessian: Tensor,
    group_size: int,
    block_size: int = 128,
    damp: float = 0.01,
    grid: Grid = INT4_GRID,
) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ for one weight (N, K) with the Hessian (K, K) of its inputs: codes uint8 (N, G * g)
    in 0..15, scales fp16 (N, G), zeros uint8 (N, G), w ~ (codes - zero) * scale, as RTN's
    ``quantize_int4``. K need not be a multiple of ``group_size``: the last group is padded with
    zero weights (and an identity Hessian there), which round to exactly 0.

    ``grid`` (``Grid``: a group's scale and zero point, and the codes of weights given them) is
    the stored int4 format by default; ``simulated.gptq_round`` passes the b-bit rule of
    ``simulated.rtn_nbit`` to measure GPTQ at 3 and 2 bits."""
    codes, scales, zeros = gptq_round_weight(weight, hessian, group_size, block_size, damp, grid)
    return codes.to(torch.uint8), scales.half(), zeros.to(torch.uint8)


def gptq_round_weight(
    weight: Tensor,
    hessian: Tensor,
    group_size: int,
    block_size: int = 128,
    damp: float = 0.01,
    grid: Grid = INT4_GRID,
) -> tuple[Tensor, Tensor, Tensor]:
    """``gptq_quantize_weight`` in fp32: codes (N, G * g), scales (N, G), zeros (N, G), as the
    grid computed them (for int4 the scales are fp16 values already)."""
    spec = QuantSpec("int4", group_size)  # validates the group size
    GPTQOptions(block_size=block_size, damp=damp)  # validates block_size and damp
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(
            f"the Hessian must be ({k}, {k}) for a weight of {k} input features, got {tuple(hessian.shape)}"
        )
    g = spec.group_size
    w = padded_groups(weight.detach().float(), g).flatten(1).clone()  # (N, K'), K' = G * g
    k_padded = w.shape[1]
    u, dead = inverse_hessian_factor(hessian, damp, k_padded)
    u = u.to(w.dtype)  # (K', K')
    w[:, dead] = 0
    block = max(block_size // g, 1) * g  # whole groups per block: a group's parameters see its updated weights
    codes = torch.empty_like(w)  # (N, K')
    scales = torch.empty(n, k_padded // g, device=w.device)  # (N, G)
    zeros = torch.empty_like(scales)
    for i1 in range(0, k_padded, block):
        i2 = min(i1 + block, k_padded)
        quantize_block(w, u, i1, i2, g, codes, scales, zeros, grid)
    return codes, scales, zeros


def quantize_block(
    w: Tensor, u: Tensor, i1: int, i2: int, g: int, codes: Tensor, scales: Tensor, zeros: Tensor, grid: Grid = INT4_GRID
):
    """Columns i1:i2 of w (N, K'), one by one with error feedback inside the block,
    then the lazy update of the columns after it.

    Writes codes, scales and zeros; updates w in place."""
    w1 = w[:, i1:i2].clone()  # (N, B): the block, updated as its columns are rounded
    u1 = u[i1:i2, i1:i2]  # (B, B)
    err = torch.zeros_like(w1)  # (N, B): each column's scaled rounding error
    for j in range(i2 - i1):
        col = i1 + j
        if col % g == 0:  # a new group: its range from its current (updated) weights
            scale, zero = grid.params(w1[:, j : j + g])  # (N,), (N,)
            scales[:, col // g], zeros[:, col // g] = scale, zero
        q = grid.codes(w1[:, j], scale, zero)  # (N,)
        codes[:, col] = q
        err[:, j] = (w1[:, j] - (q - zero) * scale) / u1[j, j]
        w1[:, j + 1 :] -= err[:, j, None] * u1[j, j + 1 :][None]
    w[:, i2:] -= err @ u[i1:i2, i2:]


def _int4_linear(linear: nn.Linear, spec: QuantSpec, codes: Tensor, scales: Tensor, zeros: Tensor) -> QuantizedLinear:
    q = QuantizedLinear(linear.in_features, linear.out_features, spec, linear.bias is not None, linear.weight.device)
    q.set_int4(codes, scales, zeros)
    if linear.bias is not None:
        q.bias = linear.bias.detach().clone()
    return q


def _quantize_linear(model: nn.Module, name: str, stats: HessianAccumulator, spec: QuantSpec, opts: GPTQOptions):
    linear = model.get_submodule(name)
    int4 = gptq_quantize_weight(linear.weight, stats.hessian, spec.group_size, opts.block_size, opts.damp)
    replace_module(model, name, _int4_linear(linear, spec, *int4))


@torch.no_grad()
def gptq_quantize(model: Transformer, spec: QuantSpec, calibration: Tensor, targets: dict, **options) -> Transformer:
    """GPTQ every target linear of ``model`` in place (``gptq_walk``), each replaced by a
    ``QuantizedLinear`` holding its int4 codes. ``options``: the fields of ``GPTQOptions``."""
    opts = GPTQOptions.from_options(options)
    if spec.scheme != "int4":
        raise ValueError(f"GPTQ is implemented for int4, got {spec.scheme!r}")

    def process(name: str, stats: HessianAccumulator) -> None:
        _quantize_linear(model, name, stats, spec, opts)

    return gptq_walk(model, calibration, targets, opts, process)


def gptq_walk(
    model: Transformer,
    calibration: Tensor,
    targets: dict,
    opts: GPTQOptions,
    process: Callable[[str, HessianAccumulator], None],
) -> Transformer:
    """Block by block: the calibration batches (n, T) run through the blocks already processed,
    the Hessians of one block's linears are collected, ``process(name, stats)`` rounds (or
    prunes, ``sparsegpt``) and replaces each, then the next block. With ``true_sequential``
    each linear of a block sees the processed outputs of those before it (qkv, then o_proj, then
    gate_up, then down). The LM head (a tied one reads the final norm) comes last."""
    walk = LayerWalk(model, calibration, opts.batch_size)
    for _, run, names in walk.blocks(targets):
        if opts.true_sequential:
            order = walk.call_order(run, names)
            missing = [n for n in names if n not in order]
            if missing:
                raise ValueError(f"{missing} read no input during calibration: GPTQ has no Hessian for them")
            for name in order:
                process(name, _read(walk.statistics(run, [name])[name], name))
        else:
            stats = walk.statistics(run, names)
            for name in names:
                process(name, _read(stats[name], name))
    return model


def _read(stats: HessianAccumulator, name: str) -> HessianAccumulator:
    if stats.rows == 0:
        raise ValueError(f"{name} read no input during calibration: there is no Hessian for it")
    return stats
