"""Chapter 9's checkers accept the right answers and reject plausible wrong ones."""

import pytest
import torch

from minillm.book.checks import CheckFailed
from minillm.book.checks.parallel_decoding import (
    check_candidate_tokens,
    check_jacobi_step,
    check_tree_mask,
    check_window_update,
)
from minillm.decoding.lookahead import jacobi_step, window_update
from minillm.decoding.medusa import MedusaTree


def stub(*args):
    raise NotImplementedError


@torch.inference_mode()
def off_by_one(model, prompt, guess):
    return model(torch.tensor([prompt + guess]))[0, len(prompt) :].argmax(-1).tolist()


@torch.inference_mode()
def autoregressive(model, prompt, guess):  # plain greedy decoding: right tokens, not one Jacobi step
    out = list(prompt)
    for _ in guess:
        out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(prompt) :]


def test_jacobi_step_checker():
    check_jacobi_step(jacobi_step)
    with pytest.raises(CheckFailed, match="off by one"):
        check_jacobi_step(off_by_one)
    with pytest.raises(CheckFailed, match="old"):
        check_jacobi_step(autoregressive)
    with pytest.raises(CheckFailed, match="as many tokens"):
        check_jacobi_step(lambda m, p, g: jacobi_step(m, p, g)[:-1])
    with pytest.raises(NotImplementedError):
        check_jacobi_step(stub)


def test_window_update_checker():
    check_window_update(window_update)
    with pytest.raises(CheckFailed, match="column"):
        check_window_update(
            lambda w, t: ([tuple(w[j].tolist()) + (int(t[j]),) for j in range(min(w.shape))], window_update(w, t)[1])
        )
    with pytest.raises(CheckFailed, match=r"top\[i\]"):
        check_window_update(lambda w, t: ([tuple(w[:, i].tolist()) for i in range(w.shape[1])], window_update(w, t)[1]))
    with pytest.raises(CheckFailed, match="oldest level"):
        check_window_update(lambda w, t: (window_update(w, t)[0], torch.cat([t[None], w[:-1]])))
    with pytest.raises(NotImplementedError):
        check_window_update(stub)


def ancestors_mask(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in range(1, len(parents)):
        mask[i] |= mask[parents[i]]
    return mask


def parent_only_mask(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in range(1, len(parents)):
        mask[i, parents[i]] = True
    return mask


def test_tree_mask_checker():
    check_tree_mask(ancestors_mask)
    with pytest.raises(CheckFailed, match="transposed"):
        check_tree_mask(lambda p: ancestors_mask(p).T)
    with pytest.raises(CheckFailed, match="only its parent"):
        check_tree_mask(parent_only_mask)
    with pytest.raises(CheckFailed, match="see itself"):
        check_tree_mask(lambda p: ancestors_mask(p) & ~torch.eye(len(p), dtype=torch.bool))
    with pytest.raises(CheckFailed, match="causal"):
        check_tree_mask(lambda p: torch.ones(len(p), len(p), dtype=torch.bool).tril())
    with pytest.raises(NotImplementedError):
        check_tree_mask(stub)


def test_candidate_tokens_checker():
    check_candidate_tokens(lambda paths, root, logits: MedusaTree(paths[1:]).tokens(root, logits))

    def always_head_one(paths, root, logits):
        return [root] + [int(logits[0].topk(p[-1] + 1).indices[-1]) for p in paths[1:]]

    def first_index(paths, root, logits):
        return [root] + [int(logits[len(p) - 1].topk(p[0] + 1).indices[-1]) for p in paths[1:]]

    with pytest.raises(CheckFailed, match="head d"):
        check_candidate_tokens(always_head_one)
    with pytest.raises(CheckFailed, match=r"p\[-1\]"):
        check_candidate_tokens(first_index)
    with pytest.raises(CheckFailed, match="root"):
        check_candidate_tokens(
            lambda paths, root, logits: [0] + MedusaTree(paths[1:]).tokens(root, logits)[1:].tolist()
        )
    with pytest.raises(NotImplementedError):
        check_candidate_tokens(stub)
