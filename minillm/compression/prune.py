"""Weight sparsity, as a transformation of a loaded model: zeroing weights, the matrices keeping
their shapes.

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
- ``sparsegpt``: the same Hessian as GPTQ's, the score (w_ij / U_jj)^2, and the remaining
  weights of each row updated to make up for the ones dropped (``sparsegpt.py``; Frantar &
  Alistarh, 2023), Wanda's baseline: Wanda's score is its diagonal, without the update.

Two patterns: ``unstructured`` drops the ``sparsity`` fraction of lowest-scored weights in every
row; ``2:4`` keeps the 2 best of every 4 consecutive input weights (50%), the pattern NVIDIA's
sparse tensor cores run at up to twice the dense speed (Mishra et al., 2021, "Accelerating
Sparse Deep Neural Networks"). ``semi_structured`` converts such weights to PyTorch's sparse
format on a GPU that has those kernels; zeros alone save no time on a dense matmul.

Structured pruning, which removes whole heads and neurons, is in ``structured.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .calibration import capture_inputs
from .quant import linear_layers, quantized_layers
from .sparsegpt import sparsegpt_prune

METHODS = ("magnitude", "wanda", "sparsegpt")
CALIBRATED = ("wanda", "sparsegpt")
PATTERNS = ("unstructured", "2:4")


# ---------------------------------------------------------------------------------------------
# Calibration: statistics of the inputs of chosen layers


def _input_norms(model: nn.Module, calibration: Tensor, modules: dict[str, nn.Module]) -> dict[str, Tensor]:
    """``||X_j||_2`` of every input feature j of every named module over all calibration tokens:
    name -> (in_features,) fp32. One pass over the model as it is (Wanda's activation statistic)."""
    sums: dict[str, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        sq = x.detach().float().pow(2).flatten(0, -2).sum(0)  # (in_features,)
        sums[name] = sums[name] + sq if name in sums else sq

    capture_inputs(model, modules, calibration, record)
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
    """Keep-mask (N, K) bool: of every 4 consecutive inputs the 2 best scores stay."""
    n, k = score.shape
    groups = score.view(n, k // 4, 4)
    best = groups.topk(2, dim=-1).indices  # (N, K/4, 2)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, best, True)
    return keep.view(n, k)


def pruning_scores(weight: Tensor, input_norm: Tensor | None) -> Tensor:
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
    **options,
) -> nn.Module:
    """Zero the least important weights of every ``nn.Linear`` in place; returns the model.

    ``method`` "magnitude" | "wanda" | "sparsegpt" (the last two need ``calibration``: token
    ids (n, T) from the training split; SparseGPT also updates the weights it keeps and takes
    ``options``, the fields of ``gptq.GPTQOptions``); ``pattern`` "unstructured" (``sparsity``
    of each row dropped; SparseGPT's mask is chosen per block of columns over all its rows, so
    rows may differ) | "2:4" (sparsity 0.5, in_features a multiple of 4). ``skip`` names
    layers kept dense: by default the LM head, which the bundled models tie to the embedding
    (pruning it would prune the embedding too). The settings are recorded in ``model.pruning``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}: choose one of {METHODS}")
    if pattern not in PATTERNS:
        raise ValueError(f"unknown sparsity pattern {pattern!r}: choose one of {PATTERNS}")
    _check_sparsity(sparsity, pattern)
    if method in CALIBRATED and calibration is None:
        raise ValueError(f"method {method!r} needs calibration data: token ids (n, T) from the training split")
    if options and method != "sparsegpt":
        raise ValueError(f"options {sorted(options)} are SparseGPT's; method {method!r} takes none")
    _check_prunable(model, "prune")
    skip = tuple(skip)
    targets = linear_layers(model, skip)
    if not targets:
        raise ValueError("the model has no linear layers to prune (all skipped?)")
    if pattern == "2:4":
        for name, linear in targets.items():
            if linear.in_features % 4:
                raise ValueError(f"2:4 sparsity needs in_features divisible by 4; {name} has {linear.in_features}")
    sparsity = 0.5 if pattern == "2:4" else float(sparsity)
    if method == "sparsegpt":
        sparsegpt_prune(model, calibration, sparsity, pattern, targets, **options)
    else:
        _prune_by_score(model, targets, pattern, sparsity, calibration if method == "wanda" else None)
    model.pruning = {
        **getattr(model, "pruning", {}),
        "method": method,
        "pattern": pattern,
        "sparsity": sparsity,
        "skip": list(skip),
    }
    return model


def _prune_by_score(
    model: nn.Module, targets: dict[str, nn.Linear], pattern: str, sparsity: float, calibration: Tensor | None
) -> None:
    """Magnitude (no ``calibration``) or Wanda pruning of the targets, in place."""
    norms = _input_norms(model, calibration, targets) if calibration is not None else {}
    with torch.no_grad():
        for name, linear in targets.items():
            score = pruning_scores(linear.weight, norms.get(name))  # (N, K)
            keep = two_four_mask(score) if pattern == "2:4" else unstructured_mask(score, sparsity)
            linear.weight.masked_fill_(~keep.to(linear.weight.device), 0)


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
