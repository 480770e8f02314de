"""What counts as a prompt: token ids, checked before anything runs.

Every generator (``generate``, the speculative, lookahead and Medusa decoders, the engine's
``Request``) accepts exactly: a list of ints, a list of lists of ints, or a 1-D or 2-D integer
tensor or numpy array. Anything else (floats, strings, bools, empty rows, ids outside the
vocabulary) is a ``ValueError`` that says what was given and what is expected; nothing is
silently converted or truncated (a float id 2.7 is not "2").
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

EXPECTED = "token ids: a list of ints, a list of lists of ints, or a 1-D/2-D integer tensor or array"


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _is_int(x: object) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0:  # a 0-d tensor or array holds one value
        return x.dtype not in (torch.bool, np.bool_) and not (
            x.dtype.is_floating_point if isinstance(x, torch.Tensor) else x.dtype.kind not in "iu"
        )
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_sequence(x: object) -> bool:
    """A row of ids: a list or tuple, or a tensor or array of at least one dimension (not text)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim > 0
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes))


def _row(row: object, what: str) -> list[int]:
    if isinstance(row, (str, bytes)):
        raise ValueError(f"{what} is text ({_describe(row)}); encode it with the tokenizer first: {EXPECTED}")
    if isinstance(row, (np.ndarray, torch.Tensor)):
        if row.ndim != 1:
            raise ValueError(f"{what} must be one row of ids, got shape {tuple(row.shape)}; expected {EXPECTED}")
        return token_rows(row)[0]
    if not isinstance(row, Sequence):
        raise ValueError(f"{what} must be a sequence of ints, got {_describe(row)}; expected {EXPECTED}")
    bad = [x for x in row if not _is_int(x)]
    if bad:
        hint = "; encode text with the tokenizer first" if isinstance(bad[0], (str, bytes)) else ""
        raise ValueError(f"{what} holds {_describe(bad[0])}, not an int{hint}; expected {EXPECTED}")
    if len(row) == 0:
        raise ValueError(f"{what} is empty: every prompt needs at least one token")
    return [int(x) for x in row]


def token_rows(input_ids: object) -> list[list[int]]:
    """Prompts as lists of ints, one per row, or a ValueError naming what is wrong."""
    if type(input_ids) is list and input_ids and all(type(x) is int for x in input_ids):
        return [list(input_ids)]  # the common case, one prompt of plain ints, without the checks below
    if isinstance(input_ids, (str, bytes)):
        raise ValueError(f"the prompt is text ({_describe(input_ids)}); encode it with the tokenizer first: {EXPECTED}")
    if isinstance(input_ids, np.ndarray):
        if input_ids.dtype.kind not in "iub":  # floats, text, objects: no integer tensor to make
            kind = "text" if input_ids.dtype.kind in "USO" else f"dtype {input_ids.dtype}"
            raise ValueError(f"input_ids must be an integer array, got {kind}; expected {EXPECTED}")
        input_ids = torch.from_numpy(input_ids)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype in (torch.bool,) or input_ids.is_floating_point() or input_ids.is_complex():
            raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}; expected {EXPECTED}")
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be (seq_len,) or (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids of shape {shape} is empty: every prompt needs at least one token")
        rows = input_ids.tolist()
        return [rows] if input_ids.dim() == 1 else rows
    if not isinstance(input_ids, Sequence):
        raise ValueError(f"input_ids must be {EXPECTED}; got {_describe(input_ids)}")
    if len(input_ids) == 0:
        raise ValueError("input_ids is empty: every prompt needs at least one token")
    rows = [_is_sequence(x) for x in input_ids]
    if not any(rows):  # one prompt: a list of (what should be) ids
        return [_row(input_ids, "the prompt")]
    if not all(rows):
        raise ValueError(f"input_ids mixes ids and rows ({_describe(input_ids)}); expected {EXPECTED}")
    return [_row(row, f"prompt {i}") for i, row in enumerate(input_ids)]


def check_vocabulary(rows: list[list[int]], vocab_size: int) -> None:
    """Every id in [0, vocab_size), or a ValueError naming the first row and id outside it."""
    for i, row in enumerate(rows):
        low, high = min(row), max(row)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"token ids must be in the vocabulary [0, {vocab_size}): prompt {i} holds id {bad} "
                f"(its ids run from {low} to {high})"
            )


def token_id_tuple(ids: object, what: str) -> tuple[int, ...]:
    """Token ids such as stop or EOS ids as a tuple of ints: a collection of non-negative ints
    (a single int is refused, so that ``stop_ids=7`` is caught instead of failing later)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, set, frozenset)):
        raise ValueError(f"{what} must be a collection of token ids such as (7,), got {ids!r}")
    bad = [x for x in ids if not _is_int(x) or int(x) < 0]
    if bad:
        raise ValueError(f"{what} must hold non-negative token ids, got {bad[0]!r} in {ids!r}")
    return tuple(int(x) for x in ids)
