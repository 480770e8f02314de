"""Pruning, as a transformation of a loaded model: zeroing weights (sparsity) and removing whole
attention heads and FFN neurons (structured pruning, which shrinks the matrices).

Weight sparsity (``prune``) keeps each matrix's shape and stores its mask as the zeros in the
weight. Which weights go is decided by a score, compared within each output row:

- ``magnitude``: ``|W_ij|`` (Han et al., 2015, "Learning both Weights and Connections").
- ``wanda``: ``|W_ij| * ||X_j||_2``, the weight times the norm of its input feature over
  calibration tokens (Sun et al., 2024, "A Simple and Effective Pruning Approach for Large
  Language Models"). A weight on a large activation matters more than its size says; no
  retraining and no second-order information. Its edge over magnitude comes from outlier
  features, a few input dimensions with far larger activations than the rest (Dettmers et al.,
  2022, "LLM.int8()"), which large models grow; a model without them, like the bundled ones,
  prunes about as well by magnitude. The paper prunes block by block, feeding each block the
  outputs of the blocks already pruned; here every layer's input norms are collected from the
  unpruned model in one pass, which is simpler (on the bundled target at 50% the two came within
  0.3% in perplexity).

Two patterns: ``unstructured`` drops the ``sparsity`` fraction of lowest-scored weights in every
row; ``2:4`` keeps the 2 best of every 4 consecutive input weights (50%), the pattern NVIDIA's
sparse tensor cores run at up to twice the dense speed (Mishra et al., 2021, "Accelerating
Sparse Deep Neural Networks"). ``semi_structured`` converts such weights to PyTorch's sparse
format on a GPU that has those kernels; zeros alone save no time on a dense matmul.

Structured pruning (``prune_heads``, ``prune_neurons``) removes the least important heads and
neurons of every layer (Michel et al., 2019, "Are Sixteen Heads Really Better than One?";
Ma et al., 2023, "LLM-Pruner"): the matrices shrink and every matmul is cheaper on any hardware.
``recover`` fine-tunes briefly afterwards, as LLM-Pruner does (with LoRA there, in full here).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..core.model import MLP, Attention
from ..training.train import TrainConfig, encode_split, fit, load_tokenizer
from .quant import linear_layers, quantized_layers

METHODS = ("magnitude", "wanda")
PATTERNS = ("unstructured", "2:4")
CALIBRATION_BATCH = 8  # calibration windows per forward pass


# ---------------------------------------------------------------------------------------------
# Calibration: statistics of the inputs of chosen layers


def _check_calibration(calibration: Tensor) -> None:
    if not isinstance(calibration, Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        got = tuple(calibration.shape) if isinstance(calibration, Tensor) else type(calibration).__name__
        raise ValueError(f"calibration must be a LongTensor of token ids (n, T), got {got}")


@torch.no_grad()
def _capture_inputs(
    model: nn.Module, calibration: Tensor, modules: dict[str, nn.Module], record: Callable[[str, Tensor], None]
) -> None:
    """Run the calibration windows through the model; ``record(name, x)`` sees the input x
    (..., in_features) of each named module at every call."""
    _check_calibration(calibration)
    hooks = [
        module.register_forward_hook(lambda _m, args, _out, name=name: record(name, args[0]))
        for name, module in modules.items()
    ]
    was_training = model.training
    model.eval()
    try:
        for batch in calibration.to(model.device).split(CALIBRATION_BATCH):
            model(batch)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)


def _input_norms(model: nn.Module, calibration: Tensor, modules: dict[str, nn.Module]) -> dict[str, Tensor]:
    """``||X_j||_2`` of every input feature j of every named module over all calibration tokens:
    name -> (in_features,) fp32. One pass over the model as it is (Wanda's activation statistic)."""
    sums: dict[str, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        sq = x.detach().float().pow(2).flatten(0, -2).sum(0)  # (in_features,)
        sums[name] = sums[name] + sq if name in sums else sq

    _capture_inputs(model, calibration, modules, record)
    return {name: s.sqrt() for name, s in sums.items()}


# ---------------------------------------------------------------------------------------------
# Weight sparsity


def _check_sparsity(sparsity, pattern: str) -> None:
    if pattern == "2:4":
        if sparsity is not None and sparsity != 0.5:
            raise ValueError(f"sparsity of the 2:4 pattern is 0.5 (2 of every 4 weights); got sparsity={sparsity!r}")
        return
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be a fraction in [0, 1), got {sparsity!r}")


def unstructured_mask(score: Tensor, sparsity: float) -> Tensor:
    """Keep-mask (N, K) bool: in each row the ``round(sparsity * K)`` lowest scores are dropped."""
    n_drop = round(sparsity * score.shape[1])
    keep = torch.ones_like(score, dtype=torch.bool)
    if n_drop:
        lowest = score.topk(n_drop, dim=1, largest=False).indices  # (N, n_drop)
        keep.scatter_(1, lowest, False)
    return keep


def two_four_mask(score: Tensor) -> Tensor:
    """Keep-mask (N, K) bool: in every group of 4 consecutive inputs the 2 highest scores stay."""
    n, k = score.shape
    groups = score.view(n, k // 4, 4)
    best = groups.topk(2, dim=-1).indices  # (N, K/4, 2)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, best, True)
    return keep.view(n, k)


def _scores(weight: Tensor, input_norm: Tensor | None) -> Tensor:
    """Magnitude |W| (N, K), times the input feature norms (K,) for Wanda."""
    score = weight.detach().float().abs()
    return score if input_norm is None else score * input_norm.to(score.device)[None, :]


def _check_prunable(model: nn.Module, what: str) -> None:
    if quantized_layers(model):
        raise ValueError(f"the model is quantized: {what} the full-precision model first, then quantize")


def prune(
    model: nn.Module,
    method: str = "magnitude",
    sparsity: float | None = 0.5,
    pattern: str = "unstructured",
    calibration: Tensor | None = None,
    skip: Iterable[str] = ("lm_head",),
) -> nn.Module:
    """Zero the least important weights of every ``nn.Linear`` in place; returns the model.

    ``method`` "magnitude" | "wanda" (needs ``calibration``: token ids (n, T) from the training
    split); ``pattern`` "unstructured" (``sparsity`` of each row dropped) | "2:4" (sparsity 0.5,
    in_features a multiple of 4). ``skip`` names layers kept dense: by default the LM head, which
    the bundled models tie to the embedding (pruning it would prune the embedding too). The
    settings are recorded in ``model.pruning``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}: choose one of {METHODS}")
    if pattern not in PATTERNS:
        raise ValueError(f"unknown sparsity pattern {pattern!r}: choose one of {PATTERNS}")
    _check_sparsity(sparsity, pattern)
    if method == "wanda" and calibration is None:
        raise ValueError("method 'wanda' needs calibration data: token ids (n, T) from the training split")
    _check_prunable(model, "prune")
    skip = tuple(skip)
    targets = linear_layers(model, skip)
    if not targets:
        raise ValueError("the model has no linear layers to prune (all skipped?)")
    if pattern == "2:4":
        for name, linear in targets.items():
            if linear.in_features % 4:
                raise ValueError(f"2:4 sparsity needs in_features divisible by 4; {name} has {linear.in_features}")
    norms = _input_norms(model, calibration, targets) if method == "wanda" else {}
    with torch.no_grad():
        for name, linear in targets.items():
            score = _scores(linear.weight, norms.get(name))  # (N, K)
            keep = two_four_mask(score) if pattern == "2:4" else unstructured_mask(score, sparsity)
            linear.weight.masked_fill_(~keep.to(linear.weight.device), 0)
    sparsity = 0.5 if pattern == "2:4" else float(sparsity)
    model.pruning = {
        **getattr(model, "pruning", {}),
        "method": method,
        "pattern": pattern,
        "sparsity": sparsity,
        "skip": list(skip),
    }
    return model


def layer_sparsity(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> dict[str, float]:
    """Fraction of zero weights of each linear layer (not the skipped ones), by name."""
    return {name: (m.weight == 0).float().mean().item() for name, m in linear_layers(model, skip).items()}


def sparsity_of(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> float:
    """Fraction of zero weights over all the model's linear layers (not the skipped ones)."""
    layers = linear_layers(model, skip).values()
    zeros = sum(int((m.weight == 0).sum()) for m in layers)
    total = sum(m.weight.numel() for m in layers)
    return zeros / total if total else 0.0


def is_two_four(weight: Tensor) -> bool:
    """Whether every group of 4 consecutive inputs of every row holds at least 2 zeros."""
    n, k = weight.shape
    return k % 4 == 0 and bool(((weight.view(n, k // 4, 4) == 0).sum(-1) >= 2).all())


def semi_structured(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """Store every 2:4-sparse linear weight in PyTorch's semi-structured sparse format, so that
    ``F.linear`` runs the sparse tensor-core kernel (cuSPARSELt, or CUTLASS where that is
    missing); returns the model. Needs a CUDA GPU of compute capability 8.0 or more (Ampere and
    later) and an fp16 or bf16 model; run ``prune(model, pattern="2:4")`` first. The converted
    weights are for inference only (no gradients)."""
    device, dtype = model.device, model.dtype
    if device.type != "cuda":
        raise RuntimeError(
            f"semi-structured 2:4 sparsity needs a CUDA GPU; the model is on {device}, and PyTorch has no "
            "2:4 sparse matmul kernel for the CPU (the zeros stay, the matmul stays dense)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        raise RuntimeError(
            f"2:4 sparse tensor cores need compute capability 8.0 (Ampere) or more; "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"the 2:4 sparse kernels run fp16 or bf16; the model is {dtype}: model.half() first")
    targets = {name: m for name, m in linear_layers(model, skip).items() if is_two_four(m.weight)}
    if not targets:
        raise ValueError("no linear layer is 2:4 sparse: prune(model, pattern='2:4') first")
    converted = {name: _to_semi_structured(name, m.weight.detach().contiguous()) for name, m in targets.items()}
    for name, weight in converted.items():  # only once every layer converted
        targets[name].weight = nn.Parameter(weight, requires_grad=False)
    model.pruning = {**getattr(model, "pruning", {}), "semi_structured": sorted(converted)}
    return model


def _to_semi_structured(name: str, weight: Tensor) -> Tensor:
    """Convert one (N, K) weight, and check the sparse matmul against the dense one."""
    from torch.sparse import SparseSemiStructuredTensorCUTLASS, to_sparse_semi_structured

    try:
        if torch.backends.cusparselt.is_available():
            sparse = to_sparse_semi_structured(weight)
        else:
            sparse = SparseSemiStructuredTensorCUTLASS.from_dense(weight)
        gen = torch.Generator(device=weight.device).manual_seed(0)  # not the global RNG: sampling stays seeded
        x = torch.randn(32, weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
        got, want = torch.nn.functional.linear(x, sparse), torch.nn.functional.linear(x, weight)
    except (RuntimeError, NotImplementedError) as e:
        raise RuntimeError(f"{name} {tuple(weight.shape)} cannot use the 2:4 sparse kernel: {e}") from e
    tol = 1e-2 * want.abs().max().item() + 1e-3
    if (got.float() - want.float()).abs().max().item() > tol:
        raise RuntimeError(f"{name}: the 2:4 sparse matmul disagrees with the dense one; not converted")
    return sparse


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
    modules = {name: blocks[i][0].o_proj for name, i in names.items()}
    grams: dict[int, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        attn = blocks[names[name]][0]
        y = x.detach().float().reshape(-1, attn.n_heads, attn.head_dim)  # (tokens, H, hd)
        g = torch.einsum("nhk,nhl->hkl", y, y)
        i = names[name]
        grams[i] = grams[i] + g if i in grams else g

    _capture_inputs(model, calibration, modules, record)
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
