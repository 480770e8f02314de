"""AWQ (Lin et al., 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale up the input channels that carry large activations before rounding, and
scale their inputs down by as much, so that the weights that matter most lose least.

For a linear y = x W^T and a positive scale s per input channel, y = (x / s) (W * s)^T exactly;
rounding W * s instead of W shrinks the relative error of the scaled-up columns (their group's
step hardly grows: one column rarely sets a group's range). AWQ takes s = mean|x|^alpha per
channel (normalized by sqrt(max * min)) and searches alpha on a grid in [0, 1) for the smallest
output error ||X W^T - (X / s) Q(W * s)^T|| on the calibration inputs. alpha = 0 is RTN, so the
search never does worse than RTN on the data it sees. The error is read off the Hessian of the
inputs, ||X D^T||^2 = n/2 tr(D H D^T) with D = W - Q(W * s) / s: no activations are kept.

The 1/s is folded into the op that produces the input, so that nothing is added at run time
(``fold_scale``; exact before rounding):

- qkv_proj reads input_layernorm and gate_up_proj reads post_attention_layernorm: the norm's
  weight is divided by s (each norm feeds exactly one stacked linear, so its one s is searched
  for all of q, k and v at once, and for gate and up);
- down_proj reads silu(gate) * up, linear in up: the up rows of gate_up_proj are divided;
- o_proj reads the attention output, linear in v: the v rows of qkv_proj are divided. Each
  kv head serves n_heads / n_kv_heads query heads (GQA), so o_proj's scales are searched tied
  across the query heads of a group: one scale per (kv head, dim);
- lm_head reads the final norm, whose weight could take the fold too (``scale_lm_head``; a
  tied head is untied for it, the embedding lookup keeps the original matrix). It is off by
  default: the final norm's output is also what ``forward(return_hidden=True)`` returns, and
  heads trained on those hidden states (Medusa) would then be fed x / s instead of x. On the
  bundled target the LM head's scale search gained nothing measurable (its clip search does).

Then, as AWQ does, a clipping ratio is searched per group (``clip``): each group's range
[min, max] shrunk to r * [min, max] for r on a grid down to 1 - ``max_shrink``, the one of least
output error on that group's inputs kept (the format's range always includes 0, so the
asymmetric range shrinks at both ends). The stored format is RTN int4 of the scaled, clipped
weight: ``QuantizedLinear.from_linear``.

``awq_quantize`` runs it layer by layer over a model (``transform.quantize(method="awq")``): the
statistics of block i are those of its inputs with blocks < i already quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.model import Transformer
from .calibration import HessianAccumulator, LayerWalk, check_positive_int, options_from
from .quant import QuantizedLinear, QuantSpec, dequantize_int4, padded_groups, quantize_int4, replace_module


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid - 1)/grid}
    clip: bool = True  # search a clipping ratio per group after scaling
    clip_grid: int = 20  # ratios 1, 1 - 1/clip_grid, ... down to 1 - max_shrink
    max_shrink: float = 0.5
    scale_lm_head: bool = False  # fold the LM head's scales into the final norm (see the module docstring)
    batch_size: int = 8  # calibration windows per forward

    def __post_init__(self):
        for name in ("grid", "clip_grid", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.max_shrink, (int, float)) or not 0 <= self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink!r}")

    @classmethod
    def from_options(cls, options: dict) -> AWQOptions:
        return options_from(cls, options, "AWQ")


# ---------------------------------------------------------------------------------------------
# The search, for one linear


def output_error(weight: Tensor, approx: Tensor, hessian: Tensor) -> Tensor:
    """tr(D H D^T) for D = weight - approx (N, K) and H (K, K) = 2/n X^T X: twice the mean over
    the n calibration rows of the squared output error ||x D^T||^2."""
    d = (weight - approx).float()
    return ((d @ hessian) * d).sum()


def rtn_int4(weight: Tensor, group_size: int) -> Tensor:
    """What RTN int4 makes of weight (N, K): the dequantized (N, K)."""
    return dequantize_int4(*quantize_int4(weight, group_size), weight.shape[1])


def activation_scales(mean_abs: Tensor, alpha: float, kv_groups: tuple[int, int, int] | None = None) -> Tensor:
    """s = mean|x|^alpha (K,), normalized by sqrt(max * min).

    ``kv_groups`` (n_kv_heads, heads per kv head, head_dim): the channels of one kv
    head's query heads share their mean first."""
    m = mean_abs.float().clamp(min=1e-4 * mean_abs.max().item() + 1e-12)  # a dead channel is not scaled to 0
    if kv_groups is not None:
        m = m.view(kv_groups).mean(dim=1, keepdim=True).expand(kv_groups).flatten()
    s = m.pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_scale(
    weight: Tensor, stats: HessianAccumulator, group_size: int, grid: int = 20, kv_groups=None
) -> tuple[Tensor, float]:
    """The AWQ scale (K,) of least output error on the calibration inputs, and that
    error (see ``output_error``); alpha = 0 (s = 1, RTN) is on the grid."""
    w = weight.detach().float()  # (N, K)
    best_s, best_err = None, float("inf")
    for i in range(grid):
        s = activation_scales(stats.mean_abs, i / grid, kv_groups)  # (K,)
        err = output_error(w, rtn_int4(w * s, group_size) / s, stats.hessian).item()
        if err < best_err:
            best_s, best_err = s, err
    return best_s, best_err


def search_clip(
    weight: Tensor, hessian: Tensor, group_size: int, clip_grid: int = 20, max_shrink: float = 0.5
) -> Tensor:
    """weight (N, K) with each group clamped to r * [min, max], r on the grid 1, 1 - 1/clip_grid,
    ... >= 1 - max_shrink, chosen per (row, group) for the least error on that group's inputs
    (the group's diagonal block of the Hessian (K, K))."""
    n, k = weight.shape
    g = group_size
    w = padded_groups(weight.detach().float(), g)  # (N, G, g)
    n_groups = w.shape[1]
    h = torch.zeros(n_groups * g, n_groups * g, device=w.device)
    h[:k, :k] = hessian
    blocks = torch.stack([h[i * g : (i + 1) * g, i * g : (i + 1) * g] for i in range(n_groups)])  # (G, g, g)
    lo, hi = w.amin(dim=-1, keepdim=True).clamp(max=0), w.amax(dim=-1, keepdim=True).clamp(min=0)  # (N, G, 1)
    best_w, best_err = w, torch.full((n, n_groups), float("inf"), device=w.device)
    for i in range(int(max_shrink * clip_grid) + 1):
        r = 1 - i / clip_grid
        clipped = torch.maximum(torch.minimum(w, r * hi), r * lo)  # (N, G, g)
        d = w - rtn_int4(clipped.flatten(1), g).view_as(w)  # (N, G, g)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)  # (N, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_w = torch.where(better[..., None], clipped, best_w)
    return best_w.flatten(1)[:, :k]


# ---------------------------------------------------------------------------------------------
# Folding 1/s into the op before

BLOCK_LINEAR = r"layers\.(\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.gate_up_proj|mlp\.down_proj)"


def fold_scale(model: Transformer, name: str, s: Tensor) -> None:
    """Multiply the input channels of linear ``name`` by s (K,) and divide what it reads by s in
    the op that produces it: the model computes the same function (up to rounding). A tied LM
    head is untied first. ValueError for a linear with no such op, or an s it cannot take."""
    linear = model.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{name} is not an nn.Linear (already quantized?): scales fold into full-precision weights")
    if s.shape != (linear.in_features,) or not bool((s > 0).all()) or not bool(s.isfinite().all()):
        raise ValueError(f"the scale of {name} must be positive and finite, shape ({linear.in_features},)")
    divide_input = _input_producer(model, name)
    if divide_input is None:
        raise ValueError(f"{name} has no preceding op to fold a scale into")
    s = s.to(linear.weight.device)
    with torch.no_grad():
        divide_input(s.to(linear.weight.dtype))
        if name == "lm_head" and linear.weight is model.embed_tokens.weight:
            linear.weight = nn.Parameter(linear.weight.detach() * s.to(linear.weight.dtype))  # untie
        else:
            linear.weight.mul_(s.to(linear.weight.dtype))


def can_fold(model: Transformer, name: str) -> bool:
    return _input_producer(model, name) is not None


def kv_groups(model: Transformer, name: str) -> tuple[int, int, int] | None:
    """(n_kv_heads, heads per kv head, head_dim) for an o_proj (its scales are tied across the
    query heads of one kv head), None for the other linears."""
    if re.fullmatch(r"layers\.\d+\.self_attn\.o_proj", name) is None:
        return None
    c = model.config
    return c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim


def _input_producer(model: Transformer, name: str):
    """A function that divides by s (K,) the input of linear ``name``, or None."""
    if name == "lm_head":
        return model.norm.weight.div_
    match = re.fullmatch(BLOCK_LINEAR, name)
    if match is None:
        return None
    layer = model.layers[int(match.group(1))]
    kind = match.group(2)
    if kind == "self_attn.qkv_proj":
        return layer.input_layernorm.weight.div_
    if kind == "mlp.gate_up_proj":
        return layer.post_attention_layernorm.weight.div_
    if kind == "mlp.down_proj":
        f = model.config.ffn_dim
        return lambda s: _divide_rows(layer.mlp.gate_up_proj, f, 2 * f, s, "mlp.gate_up_proj")
    attn = layer.self_attn
    v_start = attn.q_size + attn.kv_size

    def divide_v(s: Tensor) -> None:
        per_kv_head = s.view(kv_groups(model, name))  # (Hkv, rep, hd)
        if not bool((per_kv_head == per_kv_head[:, :1]).all()):
            raise ValueError(f"{name}'s scales must be equal across the query heads of each kv head (GQA)")
        _divide_rows(attn.qkv_proj, v_start, v_start + attn.kv_size, per_kv_head[:, 0].flatten(), "self_attn.qkv_proj")

    return divide_v


def _divide_rows(linear: nn.Module, start: int, stop: int, s: Tensor, what: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{what} is already quantized: scales fold into full-precision weights")
    linear.weight[start:stop] /= s[:, None]
    if linear.bias is not None:
        linear.bias[start:stop] /= s


# ---------------------------------------------------------------------------------------------
# The model


@torch.no_grad()
def awq_quantize(model: Transformer, spec: QuantSpec, calibration: Tensor, targets: dict, **options) -> Transformer:
    """AWQ every target linear of ``model`` in place, block by block: the statistics of a block's
    linears are collected on the outputs of the blocks already quantized; each linear's scale is
    searched and folded (last linear of the block first, so that a fold into an earlier linear's
    rows comes before that linear's own search), then each is clipped and rounded. The LM head
    comes last. ``options``: the fields of ``AWQOptions``."""
    opts = AWQOptions.from_options(options)
    if spec.scheme != "int4":
        raise ValueError(f"AWQ is implemented for int4, got {spec.scheme!r}")
    walk = LayerWalk(model, calibration, opts.batch_size)
    for _, run, names in walk.blocks(targets):
        stats = walk.statistics(run, names)
        unread = [n for n in names if stats[n].rows == 0]
        if unread:
            raise ValueError(f"{unread} read no input during calibration: AWQ has no statistics for them")
        scales = {}
        for name in reversed(walk.call_order(run, names)):
            scales[name] = _scale_and_fold(model, name, stats[name], spec, opts)
        for name in names:
            _round(model, name, stats[name], scales[name], spec, opts)
    return model


def _scale_and_fold(model, name: str, stats: HessianAccumulator, spec: QuantSpec, opts: AWQOptions) -> Tensor:
    linear = model.get_submodule(name)
    if not can_fold(model, name) or (name == "lm_head" and not opts.scale_lm_head):
        return torch.ones(linear.in_features, device=linear.weight.device)
    s, _ = search_scale(linear.weight, stats, spec.group_size, opts.grid, kv_groups(model, name))
    if not bool((s == 1).all()):
        fold_scale(model, name, s)
    return s


def _round(model, name: str, stats: HessianAccumulator, s: Tensor, spec: QuantSpec, opts: AWQOptions) -> None:
    linear = model.get_submodule(name)
    w = linear.weight.detach().float()  # (N, K), already W * s
    if opts.clip:
        hessian = stats.hessian / (s[:, None] * s[None, :])  # the Hessian of the scaled inputs x / s
        w = search_clip(w, hessian, spec.group_size, opts.clip_grid, opts.max_shrink)
    replace_module(model, name, QuantizedLinear.from_linear(linear, spec, weight=w))
