"""SparseGPT (Frantar & Alistarh, 2023, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot"): prune the columns of a weight one at a time, and after each one move the
error of the weights it dropped onto the columns not yet visited, GPTQ's update with "round to
zero" in place of "round to the grid".

For one linear W (N, K) and the Hessian H = 2/n X^T X of its calibration inputs, removing
weight w_ij costs w_ij^2 / [H^-1]_jj of layer-output error once the row's remaining weights are
compensated (Optimal Brain Surgeon, Hassibi & Stork, 1993). With the upper Cholesky factor U of
(H + lambda I)^-1 (``gptq.inverse_hessian_factor``), [H^-1]_jj of the columns not yet visited is
U_jj^2, so the score of a weight is (w_ij / U_jj)^2, read when its block comes up:

- ``unstructured``: in each block of ``block_size`` columns, the ``sparsity`` fraction of the
  block's weights with the lowest scores is dropped, over all rows of the block together (the
  paper's adaptive mask selection: rows may differ, each block holds the fraction exactly);
- ``2:4``: in every 4 consecutive columns, each row drops its 2 lowest scores.

Then column by column the dropped weights become 0 and their error e_j = (w_j - q_j) / U_jj
updates the block's later columns by -e_j U_{j, j+1:}; the columns after the block get the
block's errors in one product, as in GPTQ. Wanda (``prune.py``) is SparseGPT's cheaper rival:
its score |W_ij| ||X_j||, squared, is this one with H replaced by its diagonal ([H^-1]_jj by
1 / H_jj, and H_jj = 2 ||X_j||^2 / n), and it updates no weight. With an identity
Hessian nothing is compensated and SparseGPT is magnitude pruning with the block's mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.model import Transformer
from .calibration import HessianAccumulator
from .gptq import GPTQOptions, gptq_walk, inverse_hessian_factor


def block_prune_mask(w1: Tensor, d: Tensor, sparsity: float) -> Tensor:
    """Drop-mask (N, B) bool of one block: the round(sparsity * N * B) lowest (w / d)^2 of the
    block w1 (N, B), d (B,) the diagonal of U there."""
    score = (w1 / d[None]).pow(2).flatten()
    n_drop = round(sparsity * score.numel())
    drop = torch.zeros_like(score, dtype=torch.bool)
    if n_drop:
        drop[score.topk(n_drop, largest=False).indices] = True
    return drop.view_as(w1)


def sparsegpt_prune_weight(
    weight: Tensor,
    hessian: Tensor,
    sparsity: float = 0.5,
    pattern: str = "unstructured",
    block_size: int = 128,
    damp: float = 0.01,
) -> Tensor:
    """SparseGPT for one weight (N, K) with the Hessian (K, K) of its inputs: the pruned and
    compensated weight (N, K), fp32, with exactly its pattern's zeros (plus any weight the
    update left at 0, and the columns of dead inputs)."""
    if pattern not in ("unstructured", "2:4"):
        raise ValueError(f"unknown sparsity pattern {pattern!r}: choose 'unstructured' or '2:4'")
    GPTQOptions(block_size=block_size, damp=damp)  # validates block_size and damp
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(
            f"the Hessian must be ({k}, {k}) for a weight of {k} input features, got {tuple(hessian.shape)}"
        )
    if pattern == "2:4" and k % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, got {k}")
    w = weight.detach().float().clone()  # (N, K)
    u, dead = inverse_hessian_factor(hessian, damp)
    u = u.to(w.dtype)  # (K, K)
    w[:, dead] = 0
    block = block_size if pattern == "unstructured" else max(block_size // 4, 1) * 4
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()  # (N, B)
        u1 = u[i1:i2, i1:i2]  # (B, B)
        d = u1.diagonal()
        if pattern == "unstructured":
            drop = block_prune_mask(w1, d, sparsity)  # (N, B)
        else:
            drop = torch.zeros_like(w1, dtype=torch.bool)  # filled a group of 4 at a time
        err = torch.zeros_like(w1)  # (N, B)
        for j in range(i2 - i1):
            if pattern == "2:4" and j % 4 == 0:  # this group of 4, scored on its current weights
                score = (w1[:, j : j + 4] / d[j : j + 4][None]).pow(2)  # (N, 4)
                drop[:, j : j + 4].scatter_(1, score.topk(2, dim=1, largest=False).indices, True)
            q = torch.where(drop[:, j], torch.zeros_like(w1[:, j]), w1[:, j])  # (N,)
            err[:, j] = (w1[:, j] - q) / u1[j, j]
            w1[:, j:] -= err[:, j, None] * u1[j, j:][None]
            w1[:, j] = q
        w[:, i1:i2] = w1
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return w


@torch.no_grad()
def sparsegpt_prune(
    model: Transformer, calibration: Tensor, sparsity: float, pattern: str, targets: dict, **options
) -> Transformer:
    """SparseGPT every target linear of ``model`` in place, block by block over ``calibration``
    (token ids (n, T)) as GPTQ walks (``gptq.gptq_walk``: each linear's Hessian from inputs that
    went through the layers already pruned). ``options``: the fields of ``gptq.GPTQOptions``."""
    opts = GPTQOptions.from_options(options)

    def process(name: str, stats: HessianAccumulator) -> None:
        linear = model.get_submodule(name)
        pruned = sparsegpt_prune_weight(linear.weight, stats.hessian, sparsity, pattern, opts.block_size, opts.damp)
        linear.weight.data.copy_(pruned.to(linear.weight.dtype))

    return gptq_walk(model, calibration, targets, opts, process)
