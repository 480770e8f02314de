"""A model bound to its KV cache, eager or compiled: what every decoding loop calls per forward.

``CachedForward`` is the eager kind: the model and a contiguous ``KVCache``, ``fwd(ids)`` runs
the new tokens and appends their keys and values. ``CompiledForward`` does the same through
``torch.compile`` over a ``StaticCache``: buffers of a fixed number of slots that every step
reads whole, masked by position, so that a forward of T new tokens has the same shapes at every
step and compiles once (gpt-fast's recipe). ``StaticCache`` is the one fixed-shape cache of the
package: a hand-written step (chapter 11, the GPU check) passes its ``view`` to the model. On
CUDA it is compiled with ``mode="reduce-overhead"``: the step is captured as a CUDA graph and
replayed, one launch per step instead of one per kernel. On the CPU the weights are frozen into
the graph (Inductor's ``freezing``), which lets it prepack them for oneDNN's matrix kernels.

Only the widths named in ``widths`` are compiled; any other forward (the prompt, a short tail)
runs eagerly over the same static cache. ``warmup`` compiles them before a timer starts and
returns what that cost, so that compile time is always reported apart.

Both kinds answer the same calls: ``fwd(ids, positions=None, tree_mask=None, last_only=False,
return_hidden=False)``, ``fwd.length``, ``fwd.truncate(n)`` (roll back a rejected draft) and
``fwd.keep_slots(start, slots)`` (keep one accepted branch of a tree).
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Iterable

import torch
from torch import Tensor

from .cache import CacheFullError, KVCache, check_sizes, kept_slots
from .config import ModelConfig
from .device import synchronize
from .model import Transformer

RECOMPILE_LIMIT = 64  # graphs per compiled function: widths x caches x models of one session


class StaticSlots:
    """What the model sees of a ``StaticCache`` during one forward (the ``Cache`` protocol).

    ``slots`` (T,) says which slots the new tokens go to (the same in every row); their positions
    may differ by row (left padding). ``CompiledForward`` sets it before each forward; left None
    (a hand-written step), each token goes to the slot of its position in the first row.
    ``length`` is always 0, so that the compiled graph never depends on how full the cache is:
    every read is of the whole buffer, masked by position.
    """

    in_order = False  # the model builds the mask from the positions of the slots
    window: int | None = None
    wants_attention = False
    length = 0

    def __init__(self, cache: StaticCache):
        self.cache = cache
        self.slots: Tensor | None = None
        self.writing: Tensor | None = None  # the slots of this forward's tokens

    @property
    def batch_size(self) -> int:
        return self.cache.positions.shape[0]

    def reserve(self, positions: Tensor) -> Tensor:
        self.writing = positions[0] if self.slots is None else self.slots
        self.cache.positions.index_copy_(1, self.writing, positions)
        return self.cache.positions  # (B, max_len)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.k[layer].index_copy_(2, self.writing, k)
        self.cache.v[layer].index_copy_(2, self.writing, v)
        return self.cache.k[layer], self.cache.v[layer]

    def place_new(self, tree_mask: Tensor) -> Tensor:
        """A (T, T) or (B, T, T) mask among the new tokens -> (B or 1, 1, T, max_len) over every slot:
        the tree's rule at the new slots, True elsewhere (the positions' rule decides there)."""
        T, S = tree_mask.shape[-1], self.cache.positions.shape[1]
        tree = tree_mask.to(self.cache.positions.device).view(-1, T, T)
        full = torch.ones(tree.shape[0], T, S, dtype=torch.bool, device=tree.device)
        return full.index_copy(2, self.writing, tree)[:, None]

    def truncate(self, length: int) -> None:
        raise RuntimeError("roll a StaticCache back through the StaticCache, not its slots")

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """Attention probabilities are not wanted (``wants_attention`` is False)."""


class StaticCache:
    """Per-layer K and V buffers (B, n_kv_heads, max_len, head_dim) and each slot's position
    (B, max_len), -1 for an empty slot. One tensor per layer, not one for all: writing into a
    slice of a larger graph input makes the compiler copy the whole buffer every step. ``length``
    (slots written, host-side) moves with a ``CompiledForward``'s forwards and ``truncate``; a
    hand-written step through ``view`` leaves it at 0 (its positions say what is filled)."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"):
        check_sizes(batch_size=batch_size, max_len=max_len)
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.positions = torch.full((batch_size, max_len), -1, dtype=torch.long, device=device)
        for t in (*self.k, *self.v, self.positions):
            torch._dynamo.mark_static_address(t)  # written in place, and replayed in a CUDA graph
        self.max_len, self.length = max_len, 0
        self.view = StaticSlots(self)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.positions[:, length : self.length] = -1  # masked from now on; the values stay
        self.length = length

    def keep_slots(self, start: int, slots) -> None:
        """Keep the tokens of ``slots`` (increasing, all >= start) at start, start+1, ...; drop the rest."""
        slots = kept_slots(slots, start, self.length, self.positions.device)
        end = start + len(slots)
        for buf in (*self.k, *self.v):
            buf[:, :, start:end] = buf[:, :, slots]
        self.positions[:, start:end] = self.positions[:, slots]
        self.truncate(end)


class CachedForward:
    """The eager kind: ``model`` and a contiguous ``KVCache`` of ``max_len`` slots."""

    def __init__(self, model: Transformer, batch_size: int, max_len: int):
        self.model = model
        self.cache = KVCache.for_model(model, batch_size, max_len)
        self.forward_seconds = 0.0  # time inside the forwards (GPU work waited for)

    @property
    def length(self) -> int:
        return self.cache.length

    def __call__(self, ids: Tensor, positions=None, tree_mask=None, last_only=False, return_hidden=False):
        t0 = time.perf_counter()
        out = self.model(ids, positions, self.cache, last_only, tree_mask=tree_mask, return_hidden=return_hidden)
        synchronize(ids.device)
        self.forward_seconds += time.perf_counter() - t0
        return out

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def keep_slots(self, start: int, slots) -> None:
        self.cache.keep_slots(start, slots)

    def warmup(self, width: int, tree_mask: Tensor | None = None) -> float:
        """Nothing to compile: 0 seconds."""
        return 0.0


def compile_options(device: torch.device) -> dict:
    """CUDA: CUDA graphs (``reduce-overhead``); elsewhere Inductor's default mode."""
    return {"mode": "reduce-overhead"} if device.type == "cuda" else {}


AUTOTUNE_BYTES = 64e6  # weights at most this large: a CPU graph autotunes its matrix products, and its caller is C++


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def compiling(device: torch.device, weights: int | None = None):
    """The settings a graph is compiled under. On the CPU the weights are frozen into it (constants
    Inductor may prepack for oneDNN's matrix kernels); and a small model (``weights`` bytes at most
    ``AUTOTUNE_BYTES``) autotunes each matrix product between Inductor's own C++ GEMM template
    and ATen's (MKL's). Such weights stay in the last-level cache, where the kernel, not memory,
    sets the speed: on an AMD EPYC, one thread, minillm-target (24 MB) decodes 1.8x faster so
    (3.1 ms a step against 5.5), for 42 s of compiling instead of 13; a SmolLM2-360M (1.4 GB),
    which streams its weights from memory with either kernel, gains nothing and compiles twice as
    long. ``MINILLM_AUTOTUNE=0`` turns it off (the test suite does, for its compile time). A fused
    kernel rounds to bf16 (or fp16) wherever eager code would (``emulate_precision_casts``), not
    only at its end: a compiled low-precision step gives eager's tokens, not a near tie's other
    side. A small model's graph also has a caller in C++ (``cpp_wrapper``), not Python: the Python
    wrapper spends a few microseconds on each of a step's ~100 kernel calls, buffers and checks; on
    an Intel Xeon, one thread, minillm-target's step went from 1.84 to 1.60 ms so (fp32). The
    C++ caller is compiled too: an int4 SmolLM2-360M compiled in 55 s with it against 39 s
    without, for a step of 27-29 ms either way, so a large model keeps Python's
    (``MINILLM_CPP_WRAPPER=0`` keeps it for every model; the suite does). Inductor reads these
    flags while it compiles, so they are set around the calls that compile."""
    if device.type == "cuda":
        return torch._inductor.config.patch(freezing=False)
    small = weights is not None and weights <= AUTOTUNE_BYTES
    flags = {"freezing": True, "emulate_precision_casts": True}
    if small and device.type == "cpu" and os.environ.get("MINILLM_CPP_WRAPPER", "1") != "0":
        flags["cpp_wrapper"] = True
    if small and os.environ.get("MINILLM_AUTOTUNE", "1") != "0":
        flags.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return torch._inductor.config.patch(**flags)


def own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` with a code object of its own. torch.compile keeps its graphs per code
    object; with the guards skipped after compiling, two forwards (a target and its draft) sharing
    one could be handed each other's graph of the same shapes."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledForward:
    """``torch.compile`` over a ``StaticCache``: one graph per width in ``widths``, compiled by
    ``warmup`` (or on first use); other widths run eagerly over the same cache."""

    def __init__(self, model: Transformer, batch_size: int, max_len: int, widths: Iterable[int] = (1,)):
        if max_len > model.config.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the context length max_seq_len={model.config.max_seq_len}")
        self.model, self.widths = model, set(widths)
        self.weight_bytes = weight_bytes(model)
        self.cache = StaticCache(model.config, batch_size, max_len, model.dtype, model.device)
        self.slot_ids = torch.arange(max_len, device=model.device)
        self.graphed = model.device.type == "cuda"
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        run = own_code(CompiledForward._run).__get__(self)
        self.compiled = torch.compile(run, fullgraph=True, dynamic=False, **compile_options(model.device))
        self.skip_guards = True
        self.variants: set[tuple[int, bool]] = set()  # (width, with a tree mask): compiled and settled
        self.calls: dict[tuple[int, bool], int] = {}
        self.forward_seconds = 0.0  # time inside the forwards (GPU work waited for)

    def _run(self, ids: Tensor, positions: Tensor, slots: Tensor, tree_mask: Tensor | None):
        self.cache.view.slots = slots
        return self.model(ids, positions, self.cache.view, tree_mask=tree_mask, return_hidden=True)

    @property
    def length(self) -> int:
        return self.cache.length

    def __call__(self, ids: Tensor, positions=None, tree_mask=None, last_only=False, return_hidden=False):
        t0 = time.perf_counter()
        B, T = ids.shape
        start = self.cache.length
        if start + T > self.cache.max_len:
            raise CacheFullError(
                f"KV cache full: {start} of {self.cache.max_len} slots used, cannot write {T} more tokens"
            )
        slots = self.slot_ids[start : start + T]
        # The graph is specialized on its inputs' layouts too: contiguous, always.
        positions = slots.expand(B, T).contiguous() if positions is None else positions.contiguous()
        if T in self.widths:
            if self.graphed:
                torch.compiler.cudagraph_mark_step_begin()
            variant = (T, tree_mask is not None)
            if variant in self.variants:  # compiled: the guards only tell its graphs apart
                with torch.compiler.set_stance(skip_guard_eval_unsafe=self.skip_guards):
                    logits, hidden = self.compiled(ids, positions, slots, tree_mask)
            else:
                with compiling(self.model.device, self.weight_bytes):
                    logits, hidden = self.compiled(ids, positions, slots, tree_mask)
                self.calls[variant] = self.calls.get(variant, 0) + 1
                if self.calls[variant] >= 2:  # a second call may recompile once; then it is settled
                    self.variants.add(variant)
            if self.graphed:  # the graph's outputs are overwritten by its next replay
                logits, hidden = logits.clone(), hidden.clone()
        else:
            logits, hidden = self._run(ids, positions, slots, tree_mask)
        self.cache.length += T
        synchronize(ids.device)
        self.forward_seconds += time.perf_counter() - t0
        if last_only:
            logits, hidden = logits[:, -1:], hidden[:, -1:]
        return (logits, hidden) if return_hidden else logits

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def keep_slots(self, start: int, slots) -> None:
        self.cache.keep_slots(start, slots)

    def warmup(self, width: int, tree_mask: Tensor | None = None) -> float:
        """Compile the graph of ``width`` new tokens (twice through it: a second call can
        recompile once for what the first one changed) -> the seconds it took, 0 when it was
        compiled already; the cache is left as it was."""
        if (width, tree_mask is not None) in self.variants:
            return 0.0
        self.widths.add(width)
        ids = torch.zeros(self.cache.batch_size, width, dtype=torch.long, device=self.model.device)
        saved = self.cache.length
        synchronize(self.model.device)
        t0 = time.perf_counter()
        for _ in range(2):
            self(ids, tree_mask=tree_mask)
            self.truncate(saved)
        synchronize(self.model.device)
        return time.perf_counter() - t0


def cached_forward(
    model: Transformer,
    batch_size: int,
    max_len: int,
    compile: bool = False,
    widths: Iterable[int] = (1,),
    role: str = "",
) -> CachedForward | CompiledForward:
    """The model bound to an empty cache of at least ``max_len`` slots: eager (a fresh one), or
    compiled for ``widths`` (kept on the model and reused: ``compiled_forward_for``)."""
    if compile:
        return compiled_forward_for(model, batch_size, max_len, widths, role)
    return CachedForward(model, batch_size, max_len)


def static_length(needed: int, max_seq_len: int, smallest: int = 256) -> int:
    """Slots for a compiled cache: the next power of two >= ``needed`` (at least ``smallest``,
    at most the context), so that calls of similar lengths share one compiled graph."""
    n = smallest
    while n < needed:
        n *= 2
    return max(needed, min(n, max_seq_len))


def compiled_forward_for(
    model: Transformer, batch_size: int, needed: int, widths=(1,), role: str = ""
) -> CompiledForward:
    """A compiled forward kept on the model for reuse (a graph per cache; compiling costs seconds):
    one per batch size, slot bucket and ``role`` (a model drafting for itself needs a second
    cache), emptied before it is handed out. The weights are frozen
    into the graph on the CPU: a model whose weights change later needs ``forget_compiled``."""
    key = (batch_size, static_length(needed, model.config.max_seq_len), role)
    kept = model.__dict__.setdefault("_compiled_forwards", {})
    if key not in kept:
        kept[key] = CompiledForward(model, batch_size, key[1], widths)
    fwd = kept[key]
    fwd.widths.update(widths)
    fwd.truncate(0)
    return fwd


def forget_compiled(model: Transformer) -> None:
    """Drop the compiled forwards kept on ``model`` (after changing its weights)."""
    model.__dict__.pop("_compiled_forwards", None)
