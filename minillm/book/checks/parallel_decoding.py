"""Checkers for chapter 9: one Jacobi iteration, the lookahead window's n-grams, the tree attention
mask from parent pointers, Medusa's candidate tokens from each head's top-k."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.config import ModelConfig
from ...core.model import Transformer
from ...decoding.lookahead import jacobi_step, window_update
from ...decoding.medusa import MedusaTree
from .base import passed, require

TREES = [(3, 2, 1), (2, 2), (1, 1, 1, 1), (4,)]
SPARSE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def _tolist(x) -> list | None:
    if x is None:
        return None
    return x.tolist() if hasattr(x, "tolist") else [int(t) for t in x]


def small_model(seed: int = 0) -> Transformer:
    """A random model small enough to check against in a second, with decisive argmaxes."""
    config = ModelConfig(
        vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, eos_token_id=None, name="check"
    )
    return Transformer(config).init_weights(seed=seed, std=0.3).eval()


def check_jacobi_step(fn: Callable, model: Transformer | None = None) -> None:
    """fn(model, prompt, guess) -> the new guess: token i is the argmax after prompt + guess[:i]."""
    name = "one Jacobi iteration"
    model = model or small_model()
    gen = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    for prompt_len, n in [(5, 4), (1, 3), (9, 6), (3, 1)]:
        prompt = torch.randint(0, V, (prompt_len,), generator=gen).tolist()
        guess = torch.randint(0, V, (n,), generator=gen).tolist()
        want, got = jacobi_step(model, prompt, guess), _tolist(fn(model, prompt, guess))
        where = f"prompt of {prompt_len}, guess of {n}"
        require(
            got is not None and len(got) == n,
            name,
            f"{where}: the new guess has as many tokens as the old one ({n}), got {got}",
        )
        hint = f"{where}: expected {want}, got {got}"
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + guess]))[0]
        if got == logits[prompt_len:].argmax(-1).tolist():
            hint += ": off by one; the logits at the prompt's last position predict the guess's first token"
        elif got[1:] == want[1:]:
            hint += ": the first token is the argmax after the prompt alone"
        require(got == want, name, hint + "; every position is updated from the *old* guess, in one forward")
    passed(name, "each new token is the argmax after the prompt and the old guess before it, all in one forward")


def check_window_update(fn: Callable) -> None:
    """fn(window (N-1, W), top (W,)) -> (the W n-grams, the new window (N-1, W))."""
    name = "lookahead window and n-grams"
    gen = torch.Generator().manual_seed(4)
    for levels, width in [(3, 5), (1, 2), (2, 1), (4, 3)]:
        window = torch.randint(0, 100, (levels, width), generator=gen)
        top = torch.randint(100, 200, (width,), generator=gen)
        want_ngrams, want_window = window_update(window, top)
        out = fn(window.clone(), top.clone())
        require(isinstance(out, tuple) and len(out) == 2, name, "return a pair (ngrams, new_window)")
        ngrams, new_window = out
        ngrams = [tuple(int(t) for t in g) for g in ngrams]
        where = f"window of {levels} levels x {width} columns"
        hint = f"{where}: expected n-grams {want_ngrams}, got {ngrams}"
        rows = [tuple(window[j].tolist()) + (int(top[j]),) for j in range(min(levels, width))]
        if ngrams[: len(rows)] == rows and levels > 1:
            hint += ": you read rows (levels); an n-gram runs down a column, oldest level first, then its new guess"
        elif ngrams == [tuple(window[:, i].tolist()) for i in range(width)]:
            hint += ": each n-gram ends with the column's new guess top[i]"
        require(ngrams == want_ngrams, name, hint)
        require(
            hasattr(new_window, "shape") and torch.equal(torch.as_tensor(new_window), want_window),
            name,
            f"{where}: the new window drops the oldest level (row 0) and appends top as the newest row: "
            f"expected {want_window.tolist()}, got {_tolist(new_window)}",
        )
    passed(name, "one n-gram per column (its levels, then the new guess); the window moves down one level")


def check_tree_mask(fn: Callable) -> None:
    """fn(parents: list[int], parents[0] == -1 for the root) -> bool (N, N): i sees j iff j is i or an ancestor."""
    name = "tree attention mask"
    for tree in [MedusaTree.product(t) for t in TREES] + [MedusaTree(SPARSE)]:
        want = tree.attention_mask()
        got = fn(list(tree.parents))
        got = torch.as_tensor(got).bool() if got is not None else None
        hint = f"tree with parents {tree.parents}: "
        shape = None if got is None else tuple(got.shape)
        require(shape == tuple(want.shape), name, hint + f"expected shape {tuple(want.shape)}, got {shape}")
        parent_only = torch.eye(len(tree), dtype=torch.bool)
        parent_only[torch.arange(1, len(tree)), tree.parents[1:]] = True
        parent_only[:, 0] = True
        if torch.equal(got, want.T):
            hint += "transposed: row i is what node i (the query) sees"
        elif not got.diagonal().all():
            hint += "every node must see itself"
        elif torch.equal(got, parent_only) or (got.sum() < want.sum() and (got <= want).all()):
            hint += "a node sees all its ancestors, not only its parent: take its parent's row and add itself"
        elif torch.equal(got, torch.ones_like(want).tril()):
            hint += "a causal (lower-triangular) mask lets a node see other branches too"
        else:
            hint += "node i sees node j exactly when j is i or one of i's ancestors"
        require(torch.equal(got, want), name, hint)
    passed(name, "each node sees itself and its ancestors only, for product and sparse trees")


def check_candidate_tokens(fn: Callable) -> None:
    """fn(paths (root () first), root, head_logits (K, V)) -> the candidate tokens, one per node."""
    name = "Medusa candidate tokens"
    gen = torch.Generator().manual_seed(5)
    for tree in [MedusaTree.product(t) for t in TREES[:3]] + [MedusaTree(SPARSE)]:
        head_logits = torch.randn(tree.depth, 50, generator=gen)
        want = tree.tokens(7, head_logits).tolist()
        got = _tolist(fn(list(tree.paths), 7, head_logits))
        hint = f"paths {tree.paths[:6]}...: expected {want}, got {got}"
        if got and got[0] != 7:
            hint += ": the root (node 0) is the last token itself"
        elif got and got[1:] == [int(head_logits[0].topk(p[-1] + 1).indices[-1]) for p in tree.paths[1:]]:
            hint += ": a node at depth d takes its token from head d, not always head 1"
        elif got and got[1:] == [int(head_logits[len(p) - 1].topk(p[0] + 1).indices[-1]) for p in tree.paths[1:]]:
            hint += ": the rank to use is the path's last index, p[-1] (its first picks the ancestor at depth 1)"
        else:
            hint += ": node (i_1, ..., i_d) takes the i_d-th best token of head d (0 = the best)"
        require(got == want, name, hint)
    passed(name, "node (i_1, ..., i_d) takes the i_d-th best token of head d; the root is the last token")
