"""Calibration data for the methods that look at activations before they round (GPTQ, AWQ).

- ``calibration_batches``: random windows of a corpus split, token ids (n, seq_len).
- ``HessianAccumulator``: the statistics of one linear's inputs X (rows, K), streamed batch by
  batch: GPTQ's ``H = 2/n X^T X`` (fp32) and AWQ's mean |x| per input channel.
- ``layer_inputs`` and ``input_statistics``: what given linears of a model read, for a batch
  run through the whole model (every layer as it is now).
- ``LayerWalk``: the calibration hidden states carried through the model one block at a time,
  so that the statistics of block i are those of its inputs *after* blocks < i were quantized,
  the order of GPTQ (Frantar et al., 2023) and AWQ (Lin et al., 2024).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields

import torch
from torch import Tensor, nn

from ..core.model import Transformer, rope_cos_sin
from ..core.tokenizer import Tokenizer
from ..training.corpus import corpus_prompts, load_text
from ..training.train import encode_split

_ENCODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {split: ids}


def encoded_split(tokenizer: Tokenizer, split: str) -> Tensor:
    """``encode_split`` remembered per tokenizer (the training split takes seconds to encode)."""
    cache = _ENCODED.setdefault(tokenizer, {})
    if split not in cache:
        cache[split] = encode_split(tokenizer, split)
    return cache[split]


def calibration_batches(
    tokenizer: Tokenizer, n: int = 32, seq_len: int = 256, split: str = "train", seed: int = 0
) -> Tensor:
    """``n`` windows of ``seq_len`` consecutive token ids at random places of the bundled corpus
    ``split``: LongTensor (n, seq_len). Calibrate on "train"; measure on "valid".

    Only the windows' own text is encoded (the whole training split takes seconds)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (the number of calibration windows) must be a positive integer, got {n!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if 16 * seq_len >= len(load_text(split)):
        raise ValueError(f"seq_len={seq_len} is longer than random windows of the {split!r} split can be")
    windows = corpus_prompts(tokenizer, n, seq_len, split, placement="random", seed=seed)
    if any(len(w) < seq_len for w in windows):
        raise ValueError(f"seq_len={seq_len} is longer than windows of the {split!r} split can be")
    return torch.tensor(windows, dtype=torch.long)  # (n, seq_len)


def check_calibration(model: Transformer, calibration: Tensor) -> Tensor:
    """Token ids (n, T) that the model can read, moved to its device; ValueError otherwise."""
    if not isinstance(calibration, Tensor) or calibration.dim() != 2 or calibration.dtype.is_floating_point:
        got = tuple(calibration.shape) if isinstance(calibration, Tensor) else type(calibration).__name__
        raise ValueError(f"calibration must be integer token ids (n, seq_len), got {got}")
    n, t = calibration.shape
    if n < 1 or t < 1:
        raise ValueError(f"calibration needs at least one window of at least one token, got shape {(n, t)}")
    if t > model.config.max_seq_len:
        raise ValueError(f"calibration windows of {t} tokens exceed the model's max_seq_len={model.config.max_seq_len}")
    lo, hi = calibration.min().item(), calibration.max().item()
    if lo < 0 or hi >= model.config.vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {model.config.vocab_size}), got [{lo}, {hi}]")
    return calibration.to(model.device)


# ---------------------------------------------------------------------------------------------
# Statistics of a linear's inputs


class HessianAccumulator:
    """Streams a linear's inputs x (..., K): ``hessian`` = 2/n X^T X (K, K) and ``mean_abs`` =
    mean |x| per channel (K,), over the n rows seen so far, in fp32. GPTQ's layer-wise objective
    ||X W^T - X Q^T||^2 has Hessian 2 X^T X with respect to each row of W."""

    def __init__(self, in_features: int, device=None):
        self.rows = 0
        self._xtx = torch.zeros(in_features, in_features, device=device)  # sum of x^T x
        self._abs = torch.zeros(in_features, device=device)  # sum of |x|

    def add(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # (rows, K)
        self._xtx.addmm_(x.T, x)
        self._abs += x.abs().sum(dim=0)
        self.rows += x.shape[0]

    @property
    def hessian(self) -> Tensor:
        return self._xtx * (2 / max(self.rows, 1))

    @property
    def mean_abs(self) -> Tensor:
        return self._abs / max(self.rows, 1)


class _StopForward(Exception):
    """Raised by a hook once every watched linear has read its input: the rest of the forward
    would only compute what nobody looks at."""


def _watch(model: nn.Module, names: Iterable[str], record: Callable[[str, Tensor], None]) -> tuple[list, set]:
    """Forward pre-hooks on the named linears that hand each input to ``record`` and stop the
    forward once all of them have read theirs (each linear runs once per forward here)."""
    names = list(names)
    seen: set[str] = set()
    handles = []
    for name in names:

        def hook(module, args, name=name):
            record(name, args[0])
            seen.add(name)
            if len(seen) == len(names):
                raise _StopForward

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    return handles, seen


def _run_watched(model, names, record, batches: Iterable[Tensor], run: Callable[[Tensor], object]) -> None:
    handles, seen = _watch(model, names, record)
    try:
        with torch.no_grad():
            for batch in batches:
                seen.clear()
                with contextlib.suppress(_StopForward):
                    run(batch)
    finally:
        for h in handles:
            h.remove()


def _split(x: Tensor, batch_size: int) -> Iterator[Tensor]:
    for i in range(0, x.shape[0], batch_size):
        yield x[i : i + batch_size]


def capture_inputs(
    model: nn.Module, names: Iterable[str], batches: Tensor, record: Callable[[str, Tensor], None], batch_size: int = 8
) -> None:
    """Run ``batches`` (n, T) token ids through the whole model (in eval mode, ``batch_size`` windows
    per forward); ``record(name, x)`` sees the input x (..., in_features) of each named linear. A
    forward stops once every named linear has read its input."""
    batches = check_calibration(model, batches)
    was_training = model.training
    model.eval()
    try:
        _run_watched(model, list(names), record, _split(batches, batch_size), model)
    finally:
        model.train(was_training)


def layer_inputs(model: Transformer, names: Iterable[str], batches: Tensor, batch_size: int = 8) -> dict[str, Tensor]:
    """What each named linear reads when the model runs over ``batches`` (n, T) token ids:
    {name: Tensor (n * T, in_features)} in fp32."""
    names = list(names)
    seen: dict[str, list[Tensor]] = {name: [] for name in names}

    def record(name: str, x: Tensor) -> None:
        seen[name].append(x.detach().reshape(-1, x.shape[-1]).float())

    capture_inputs(model, names, batches, record, batch_size)
    return {name: torch.cat(xs) for name, xs in seen.items()}


def input_statistics(
    model: Transformer, names: Iterable[str], batches: Tensor, batch_size: int = 8
) -> dict[str, HessianAccumulator]:
    """``HessianAccumulator`` of each named linear's inputs over ``batches`` (n, T) run through the
    whole model, streamed (only the (K, K) sums are kept, not the activations)."""
    names = list(names)
    stats = {name: HessianAccumulator(model.get_submodule(name).in_features, model.device) for name in names}
    capture_inputs(model, names, batches, lambda n, x: stats[n].add(x), batch_size)
    return stats


# ---------------------------------------------------------------------------------------------
# Block by block


class LayerWalk:
    """The calibration batches' hidden states, carried through the model one block at a time.

    ``blocks(targets)`` yields, in the order the model runs them, each block's forward and the
    targets inside it, then the final norm + LM head (``"head"``). ``statistics(run, names)``
    streams the inputs of the named linears for ``run`` over the current hidden states. Between
    two blocks the hidden states are replaced by the block's outputs, computed with the linears
    the caller quantized meanwhile: the next block calibrates on what the quantized model computes.
    """

    def __init__(self, model: Transformer, calibration: Tensor, batch_size: int = 8):
        ids = check_calibration(model, calibration)  # (n, T)
        self.model, self.batch_size = model, batch_size
        with torch.no_grad():
            self.hidden = model.embed_tokens(ids)  # (n, T, D)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T)
        self._cos, self._sin = rope_cos_sin(positions, model.inv_freq, self.hidden.dtype)

    def blocks(self, targets: Iterable[str]) -> Iterator[tuple[str, Callable[[Tensor], Tensor], list[str]]]:
        """(label, run, names) for every block with targets in it, in order, then ("head", run,
        ["lm_head"]) when lm_head is a target. The walk advances past a block when the caller
        asks for the next one: quantize the block's linears in between."""
        targets = list(targets)
        n_layers = len(self.model.layers)
        in_block = [[t for t in targets if t.startswith(f"layers.{i}.")] for i in range(n_layers)]
        rest = [t for t in targets if not any(t in names for names in in_block)]
        unknown = [t for t in rest if t != "lm_head"]
        if unknown:
            raise ValueError(f"calibrated quantization handles the blocks' linears and lm_head, not {unknown}")
        for i, layer in enumerate(self.model.layers):
            run = self._block_forward(layer)
            if in_block[i]:
                yield f"layers.{i}", run, in_block[i]
            if rest or any(in_block[i + 1 :]):  # a later block or the head reads this block's output
                self.advance(run)
        if rest:
            yield "head", self._head_forward, rest

    def _block_forward(self, layer: nn.Module) -> Callable[[Tensor], Tensor]:
        def run(x: Tensor) -> Tensor:
            return layer(x, self._cos, self._sin, None, x.shape[1] > 1)

        return run

    def _head_forward(self, x: Tensor) -> Tensor:
        return self.model.lm_head(self.model.norm(x))

    def statistics(self, run: Callable[[Tensor], Tensor], names: Iterable[str]) -> dict[str, HessianAccumulator]:
        names = list(names)
        stats = {n: HessianAccumulator(self.model.get_submodule(n).in_features, self.hidden.device) for n in names}
        _run_watched(self.model, names, lambda n, x: stats[n].add(x), _split(self.hidden, self.batch_size), run)
        return stats

    def call_order(self, run: Callable[[Tensor], Tensor], names: Iterable[str]) -> list[str]:
        """The order in which ``run`` calls the named linears (on one short batch)."""
        order: list[str] = []
        probe = self.hidden[:1]
        _run_watched(self.model, names, lambda n, x: order.append(n) if n not in order else None, [probe], run)
        return order

    def advance(self, run: Callable[[Tensor], Tensor]) -> None:
        with torch.no_grad():
            self.hidden = torch.cat([run(x) for x in _split(self.hidden, self.batch_size)])


# ---------------------------------------------------------------------------------------------
# Options of the calibrated methods


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def options_from(cls, options: dict, method: str):
    """``cls(**options)`` for a method's options dataclass, naming any option it does not have."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {method} option(s) {unknown}: choose from {sorted(known)}")
    return cls(**options)
