"""Structured pruning, as a transformation of a loaded model: removing whole attention heads (K/V
head groups under GQA) and FFN neurons from every layer, so that the matrices shrink and every
matmul is cheaper on any hardware (Michel et al., 2019, "Are Sixteen Heads Really Better than
One?"; Ma et al., 2023, "LLM-Pruner"). The same number goes from every layer (one config
describes them all), chosen in each layer by importance. ``recover`` fine-tunes briefly
afterwards, as LLM-Pruner does (with LoRA there, in full here). ``with_outlier_features`` makes
a copy of a model with outlier features (the same function, rescaled), to show what they do to
pruning and quantization.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from ..core.model import MLP, Attention
from ..training.train import TrainConfig, encode_split, fit, load_tokenizer
from .calibration import capture_inputs
from .prune import _check_prunable, _input_norms
from .quant import linear_layers

# ---------------------------------------------------------------------------------------------
# Structured pruning: whole heads and neurons, the matrices shrink


def _check_fraction(name: str, fraction) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ValueError(f"{name} must be a fraction in [0, 1), got {fraction!r}")


def _blocks(model: nn.Module) -> list[tuple[Attention, MLP]]:
    return [(layer.self_attn, layer.mlp) for layer in model.layers]


def _sliced_linear(linear: nn.Linear, rows: Tensor | None = None, cols: Tensor | None = None) -> nn.Linear:
    """A new linear holding the given output rows and input columns of ``linear`` (all by default)."""
    w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if rows is not None:
        w, b = w[rows], None if b is None else b[rows]
    if cols is not None:
        w = w[:, cols]
    new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b)
    return new


def _keep_count(n: int, fraction: float, unit: str) -> int:
    keep = n - round(fraction * n)
    if keep < 1:
        raise ValueError(f"pruning a fraction {fraction} of {n} {unit} would leave none")
    return keep


def _kept(importance: Tensor, n_keep: int) -> Tensor:
    """Indices of the ``n_keep`` most important units, in their original order."""
    return importance.topk(n_keep).indices.sort().values


def head_group_importance(model: nn.Module, calibration: Tensor | None = None) -> list[Tensor]:
    """Importance of each key/value group of each layer (for MHA a group is one head): per layer
    a (n_kv_heads,) tensor. A query head h adds ``W_o[:, h] y_h`` to the residual stream (y_h its
    attention output (hd,), W_o[:, h] its (D, hd) columns of o_proj); its importance is the squared
    norm of that contribution summed over the calibration tokens, ``tr(W_o_h^T W_o_h Y_h^T Y_h)``.
    Without calibration Y_h^T Y_h is replaced by ``W_v W_v^T`` of its value head (inputs taken as
    white noise): the squared Frobenius norm of the head's output-value circuit W_o_h W_v
    (Elhage et al., 2021). A group's importance sums those of its query heads."""
    blocks = _blocks(model)
    hd = blocks[0][0].head_dim
    grams = _head_input_grams(model, calibration) if calibration is not None else None
    importances = []
    for i, (attn, _) in enumerate(blocks):
        H, Hkv = attn.n_heads, attn.n_kv_heads
        w_o = attn.o_proj.weight.detach().float().view(-1, H, hd)  # (D, H, hd)
        out_gram = torch.einsum("dhk,dhl->hkl", w_o, w_o)  # (H, hd, hd): W_o_h^T W_o_h
        if grams is not None:
            in_gram = grams[i]  # (H, hd, hd): Y_h^T Y_h
        else:
            w_v = attn.qkv_proj.weight.detach().float()[attn.q_size + attn.kv_size :].view(Hkv, hd, -1)
            in_gram = torch.einsum("gkd,gld->gkl", w_v, w_v).repeat_interleave(H // Hkv, dim=0)  # (H, hd, hd)
        per_head = (out_gram * in_gram).sum((1, 2))  # (H,)
        importances.append(per_head.view(Hkv, H // Hkv).sum(1))
    return importances


def _head_input_grams(model: nn.Module, calibration: Tensor) -> list[Tensor]:
    """Per layer, the Gram matrix Y_h^T Y_h (H, hd, hd) of each head's attention output over the
    calibration tokens (the input of o_proj, split by head)."""
    blocks = _blocks(model)
    names = {f"layers.{i}.self_attn.o_proj": i for i in range(len(blocks))}
    grams: dict[int, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        attn = blocks[names[name]][0]
        y = x.detach().float().reshape(-1, attn.n_heads, attn.head_dim)  # (tokens, H, hd)
        g = torch.einsum("nhk,nhl->hkl", y, y)
        i = names[name]
        grams[i] = grams[i] + g if i in grams else g

    capture_inputs(model, names, calibration, record)
    return [grams[i] for i in range(len(blocks))]


def neuron_importance(model: nn.Module, calibration: Tensor | None = None) -> list[Tensor]:
    """Importance of each FFN neuron of each layer: per layer a (ffn_dim,) tensor. Neuron j adds
    ``h_j W_down[:, j]`` to the residual stream (h = silu(gate) * up); the norm of that over the
    calibration tokens is exactly ``||W_down[:, j]||_2 * ||h_j||_2`` (Wanda's score, summed over
    the column). Without calibration ||h_j|| is replaced by ``||W_gate[j]|| * ||W_up[j]||``."""
    blocks = _blocks(model)
    if calibration is not None:
        modules = {f"layers.{i}.mlp.down_proj": mlp.down_proj for i, (_, mlp) in enumerate(blocks)}
        norms = _input_norms(model, calibration, modules)
    importances = []
    for i, (_, mlp) in enumerate(blocks):
        down = mlp.down_proj.weight.detach().float().norm(dim=0)  # (F,)
        if calibration is not None:
            act = norms[f"layers.{i}.mlp.down_proj"]
        else:
            gate, up = mlp.gate_up_proj.weight.detach().float().chunk(2, dim=0)  # (F, D) each
            act = gate.norm(dim=1) * up.norm(dim=1)
        importances.append(down * act)
    return importances


def prune_heads(model: nn.Module, fraction: float = 0.25, calibration: Tensor | None = None) -> nn.Module:
    """Remove the least important ``fraction`` of the attention heads of every layer, in place;
    returns the model. The same number goes in every layer (the config has one n_heads), each
    layer choosing its own by ``head_group_importance`` (with ``calibration``, token ids (n, T),
    from activations; without, from the weights alone). MHA drops single heads: their q, k and v
    rows of qkv_proj and their o_proj columns. GQA drops whole key/value groups (the KV head and
    all its query heads); MQA, with one group, cannot drop heads. ``model.config`` is replaced by
    one with the new n_heads and n_kv_heads (head_dim unchanged); ``model.pruning["dropped_kv_groups"]``
    lists each layer's dropped groups, numbered as before the call."""
    _check_fraction("fraction", fraction)
    _check_prunable(model, "prune heads of")
    config = model.config
    if config.n_kv_heads == 1 and config.n_heads > 1:
        raise ValueError(
            "multi-query attention (one key/value head for all queries) has no head to drop: removing "
            "query heads alone would leave n_heads not a multiple of a group size; not supported"
        )
    n_keep = _keep_count(config.n_kv_heads, fraction, "key/value heads")
    if n_keep == config.n_kv_heads:
        return model
    importances = head_group_importance(model, calibration)
    dropped = {}
    for i, (attn, _) in enumerate(_blocks(model)):
        groups = _kept(importances[i], n_keep)  # (n_keep,) kept key/value groups
        _slice_heads(attn, groups)
        dropped[i] = sorted(set(range(config.n_kv_heads)) - set(groups.tolist()))
    model.config = config.replace(n_heads=n_keep * config.n_rep, n_kv_heads=n_keep)
    model.pruning = {**getattr(model, "pruning", {}), "dropped_kv_groups": dropped}
    return model


def _slice_heads(attn: Attention, groups: Tensor) -> None:
    """Keep only the key/value groups ``groups`` (n_keep,) of one attention layer."""
    hd, rep = attn.head_dim, attn.n_heads // attn.n_kv_heads
    heads = (groups[:, None] * rep + torch.arange(rep)).flatten()  # kept query heads
    q_rows = (heads[:, None] * hd + torch.arange(hd)).flatten()
    kv_rows = (groups[:, None] * hd + torch.arange(hd)).flatten()
    rows = torch.cat([q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows])
    attn.qkv_proj = _sliced_linear(attn.qkv_proj, rows=rows.to(attn.qkv_proj.weight.device))
    attn.o_proj = _sliced_linear(attn.o_proj, cols=q_rows.to(attn.o_proj.weight.device))
    attn.n_heads, attn.n_kv_heads = len(heads), len(groups)
    attn.q_size, attn.kv_size = attn.n_heads * hd, attn.n_kv_heads * hd


def prune_neurons(model: nn.Module, fraction: float = 0.25, calibration: Tensor | None = None) -> nn.Module:
    """Remove the least important ``fraction`` of the FFN neurons of every layer, in place; returns
    the model. The same number goes in every layer, each layer choosing its own by
    ``neuron_importance``: the neuron's rows of both halves of gate_up_proj and its down_proj
    column. ``model.config`` is replaced by one with the new ffn_dim; ``model.pruning["dropped_neurons"]``
    lists each layer's dropped neurons, numbered as before the call."""
    _check_fraction("fraction", fraction)
    _check_prunable(model, "prune neurons of")
    config = model.config
    n_keep = _keep_count(config.ffn_dim, fraction, "FFN neurons")
    if n_keep == config.ffn_dim:
        return model
    importances = neuron_importance(model, calibration)
    dropped = {}
    for i, (_, mlp) in enumerate(_blocks(model)):
        neurons = _kept(importances[i], n_keep).to(mlp.down_proj.weight.device)  # (n_keep,)
        mlp.gate_up_proj = _sliced_linear(mlp.gate_up_proj, rows=torch.cat([neurons, config.ffn_dim + neurons]))
        mlp.down_proj = _sliced_linear(mlp.down_proj, cols=neurons)
        dropped[i] = sorted(set(range(config.ffn_dim)) - set(neurons.tolist()))
    model.config = config.replace(ffn_dim=n_keep)
    model.pruning = {**getattr(model, "pruning", {}), "dropped_neurons": dropped}
    return model


def prune_structured(
    model: nn.Module, heads: float = 0.25, neurons: float = 0.25, calibration: Tensor | None = None
) -> nn.Module:
    """``prune_heads`` then ``prune_neurons``; the neurons' importance is measured on the model
    with its heads already removed (the inputs they will see)."""
    _check_fraction("heads", heads)
    _check_fraction("neurons", neurons)
    prune_heads(model, heads, calibration)
    return prune_neurons(model, neurons, calibration)


# ---------------------------------------------------------------------------------------------
# Recovery: a short fine-tune after pruning


def recover(
    model: nn.Module, train_ids: Tensor | None = None, steps: int = 40, lr: float = 5e-4, **train_options
) -> dict:
    """Fine-tune a pruned model briefly on the training split (``train_ids``, the whole split by
    default) with ``minillm.training.train.fit``; returns fit's log. ``train_options`` are further
    ``TrainConfig`` fields (defaults here: batch_size 8, seq_len 128, warmup steps // 10). The
    zeros of ``prune`` stay zero: their gradients are masked, so AdamW never moves them."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    unknown = set(train_options) - set(TrainConfig.__dataclass_fields__) - {"steps", "lr"}
    if unknown:
        raise ValueError(f"unknown TrainConfig option(s) {sorted(unknown)}")
    options = {"batch_size": 8, "seq_len": 128, "warmup": max(1, steps // 10), "eval_every": steps, **train_options}
    tc = TrainConfig(steps=steps, lr=lr, **options)
    if train_ids is None:
        train_ids = encode_split(load_tokenizer(), "train")
    hooks = _mask_gradients(model) if "pattern" in getattr(model, "pruning", {}) else []
    try:
        return fit(model, tc, train_ids, progress=False)
    finally:
        for hook in hooks:
            hook.remove()


def _mask_gradients(model: nn.Module) -> list:
    """Zero the gradient of every pruned weight: Adam's moments of those weights stay 0, so their
    update is 0, and weight decay of 0 is 0."""
    hooks = []
    for linear in linear_layers(model, model.pruning.get("skip", ())).values():
        keep = linear.weight.detach() != 0
        hooks.append(linear.weight.register_hook(lambda grad, keep=keep: grad * keep))
    return hooks


def with_outlier_features(model, n_features: int = 16, scale: float = 20.0):
    """A copy computing the same function, with outlier features as large LLMs have them (Dettmers
    et al., 2022):
    in each block the n most used inputs of qkv_proj and of gate_up_proj are made ``scale`` times
    larger (their RMSNorm weights) and their weight columns as much smaller."""
    model = copy.deepcopy(model)  # a new model: the argument is left as it is
    with torch.no_grad():
        for layer in model.layers:
            for norm, linear in [
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ]:
                features = (linear.weight.norm(dim=0) * norm.weight.abs()).topk(n_features).indices
                norm.weight[features] *= scale
                linear.weight[:, features] /= scale
    return model
