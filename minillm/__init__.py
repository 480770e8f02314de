"""minillm: LLM inference optimization from scratch, the library behind the book.

    model, tokenizer = minillm.load("minillm-target")
    ids = tokenizer.encode("def fibonacci(n):")
    result = minillm.generate(model, ids, max_new_tokens=64)
    print(tokenizer.decode(result.tokens[0]))

The folders are the architecture, in layers; a layer imports only layers below it, and the
techniques of one layer never import each other:

    kernels/      Triton kernels, a leaf: torch and triton only (``core.attention`` and
                  ``compression`` import them lazily).
    core/         config, model, attention, cache protocol + KVCache and the static cache,
                  sampling, generate, checkpoints, tokenizer, device.
    measure/      metrics, roofline arithmetic, quality, the chapter-2 replay (imports core).
    training/     the bundled corpus, tokenizer and training loop (imports core).
    kv/           compressed caches, GQA, paged blocks, memory formulas (chapters 4-6).
    compression/  quantization, pruning, distillation (chapter 12).
    decoding/     speculative, prompt lookup, lookahead, Medusa (chapters 7-9).
    parallel/     tensor, pipeline, context parallelism over torch.distributed (chapter 15).
    runtime/      the one place techniques compose: load (HF, bundled or saved quantized) in
                  the compute dtype, quantize, compile; every combination works or is refused.
    serving/      workload, scheduler, engine (speculating with decoding's rule), async engine,
                  HTTP server, disaggregation and replicas (chapters 13-15; imports core, kv,
                  decoding, measure, parallel, runtime).
    export/       writing a model for another runtime: GGUF for llama.cpp (imports core, the
                  runtime, and compression to dequantize).
    bench/        the timing harness, provenance and results store, one module per benchmark,
                  and the bench command line.
    viz/          every plot; the only importer of matplotlib; never imports bench.
    book/         notebook setup, exercise generation and checkers.
    cli/          the command line (``python -m minillm``); its handlers import what they run.

Only bench, book, cli and the notebooks import bench or viz. tests/test_layering.py reads
every import and holds these lines; its allow-list is exactly the graph the code has.
"""

from .core.cache import CacheFullError, KVCache
from .core.checkpoints import CheckpointError, bundled_models, save_pretrained
from .core.config import PRESETS, ModelConfig, RopeScaling, preset
from .core.generate import GenerationResult, generate
from .core.model import Transformer, random_model
from .core.sampling import SamplingParams, sample
from .core.tokenizer import Tokenizer
from .kv.compressed import CrossLayerKVCache, QuantizedKVCache, SelectiveKVCache, SlidingWindowCache
from .runtime import RuntimeOptions, load, load_model

__version__ = "0.1.0"

# Reachable from the top, imported on first use (PEP 562), so ``import minillm`` stays light.
_LAZY = {"quantize": "compression", "prune": "compression", "distill": "compression", "LLM": "serving"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "CacheFullError",
    "CheckpointError",
    "CrossLayerKVCache",
    "GenerationResult",
    "LLM",
    "KVCache",
    "ModelConfig",
    "QuantizedKVCache",
    "RopeScaling",
    "RuntimeOptions",
    "SamplingParams",
    "SelectiveKVCache",
    "SlidingWindowCache",
    "Tokenizer",
    "Transformer",
    "bundled_models",
    "distill",
    "generate",
    "load",
    "load_model",
    "preset",
    "prune",
    "quantize",
    "random_model",
    "sample",
    "save_pretrained",
]
