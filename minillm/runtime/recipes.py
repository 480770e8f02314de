"""Recipes: how a model is stored and how it generates, as one named value (chapter 16's ladder).

A ``Rung`` is one recipe: whether generation keeps a KV cache, whether it decodes through the
compiled step over a static cache, and which weight-only quantization the model carries.
``LADDER`` stacks them from the plain baseline to every technique at once. Here is what each
recipe makes of a loaded model (``rung_models``), how it generates (``generate_as``), and what it
holds and reads per decode step (``kv_bytes``, ``streamed_bytes``); ``bench.capstone`` times them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..compression import quantize
from ..core.cache import KVCache
from ..core.compiled import compiled_forward_for
from ..core.config import ModelConfig
from ..core.generate import generate
from ..core.model import Transformer


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: how the model is stored and how it generates."""

    name: str
    cache: bool  # keep a KV cache (False: recompute the whole sequence every step)
    compiled: bool  # decode through torch.compile over a static cache
    scheme: str | None = None  # weight-only quantization: "int8", "int4"; None: 16/32-bit weights
    group: int | None = None  # int4 group size
    half: bool = False  # weights and activations in 16 bits (bf16) rather than the baseline's fp32
    lossless: bool = True  # the step makes the previous rung's greedy tokens

    @property
    def weights(self) -> tuple[str | None, int | None, bool]:
        """How the model is stored (a quantized model computes in 16 bits anyway)."""
        return self.scheme, self.group, self.half or self.scheme is not None


# Compilation comes last: on a CPU each rung compiled would be a graph of its own to build (a
# minute and a half for a 30-layer model, the first time), and compiled decoding of the int4
# model is what a reader would keep. gpt-fast compiled first, then quantized; on a GPU the
# check's sections measure that order (``bench.capstone_tables.gpu_ladder_rows``).
# The bf16 rung comes before int8 so that each rung changes one thing: the int8 model computes
# in bf16 too, and its gain over the row above is then the 8-bit weights' alone.
LADDER = (
    Rung("recompute (baseline)", cache=False, compiled=False),
    Rung("+ KV cache", cache=True, compiled=False),
    Rung("+ bf16 weights", cache=True, compiled=False, half=True, lossless=False),
    Rung("+ int8 weights", cache=True, compiled=False, scheme="int8", half=True, lossless=False),
    Rung("+ int4 weights (g128)", cache=True, compiled=False, scheme="int4", group=128, half=True, lossless=False),
    Rung("+ compiled decode", cache=True, compiled=True, scheme="int4", group=128, half=True),
)

# Each rung's technique applied to the KV-cache rung by itself, for the ladder's "alone" column.
# The bf16, int8 and int4 rungs already are (their weights replace the KV-cache rung's; int8 and
# int4 compute in bf16, so they include it); compiling alone is the fp32 model compiled.
ALONE = {"+ compiled decode": Rung("compiled decode alone", cache=True, compiled=True)}


def alone_rung(rung: Rung) -> Rung | None:
    """The rung that measures ``rung``'s technique on the KV-cache rung alone (None for the
    baseline and the KV-cache rung, which the column is measured against)."""
    if rung.name in (LADDER[0].name, LADDER[1].name):
        return None
    return ALONE.get(rung.name, rung)


def recipe_of(rung: Rung) -> str:
    """What a rung's model and generation carry, e.g. 'KV cache, int4 g128, compiled'."""
    parts = ["KV cache"] if rung.cache else ["recompute"]
    if rung.scheme:
        parts.append(rung.scheme + (f" g{rung.group}" if rung.group else ""))
    elif rung.half:
        parts.append("bf16")
    return ", ".join(parts + (["compiled"] if rung.compiled else []))


def rung_models(base: Transformer, rungs: tuple[Rung, ...], dtype: torch.dtype) -> dict[str, Transformer]:
    """The model of each rung: ``base`` itself for the baseline's weights, else one
    copy per storage format computing in ``dtype`` (the 16-bit type): cast for 16-bit
    weights, quantized for int8/int4, shared by the rungs that store them alike."""
    stored: dict[tuple, Transformer] = {(None, None, False): base}
    for rung in rungs:
        if rung.weights not in stored:
            half = copy.deepcopy(base).to(dtype)
            stored[rung.weights] = quantize(half, rung.scheme, rung.group) if rung.scheme else half
    return {rung.name: stored[rung.weights] for rung in rungs}


def generate_as(model: Transformer, rung: Rung, ids, new_tokens: int):
    """Greedy generation as ``rung`` generates (recomputing, cached, or compiled)."""
    return generate(model, ids, new_tokens, eos_token_id=None, use_cache=rung.cache, compile=rung.compiled)


def kv_bytes(model: Transformer, rung: Rung, length: int) -> int:
    """The KV memory a batch-1 generation of ``length`` tokens holds: none when recomputing, a
    cache of exactly ``length`` slots, or the static cache's bucket when compiled."""
    if not rung.cache:
        return 0
    if rung.compiled:
        return compiled_forward_for(model, 1, length).cache.nbytes
    return KVCache.for_model(model, 1, length).nbytes


def streamed_bytes(rung: Rung, weights_bytes: int, config: ModelConfig) -> int:
    """The weight bytes a decode step reads: all of them, except that a quantized model whose
    head was tied to its embedding keeps a 16-bit embedding table beside the quantized head, and
    a step only looks up one row of that table."""
    if rung.scheme is None or not config.tie_embeddings:
        return weights_bytes
    return weights_bytes - config.vocab_size * config.dim * 2
