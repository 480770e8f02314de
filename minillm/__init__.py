"""minillm: LLM inference optimization from scratch, the library behind the book.

    model, tokenizer = minillm.load("minillm-target")
    ids = tokenizer.encode("def fibonacci(n):")
    result = minillm.generate(model, ids, max_new_tokens=64)
    print(tokenizer.decode(result.tokens[0]))

The folders are the architecture, in layers; a layer imports only those below it:

    core/         config, model, attention, cache protocol + KVCache, sampling, generate,
                  checkpoints, tokenizer, device. Imports no other part of minillm.
    training/     the bundled corpus, tokenizer and training loop (imports core).
    measure/      metrics, roofline arithmetic, the chapter-2 replay: no timing (imports core).
    kv/           compressed caches, GQA, paged blocks, memory formulas (core, training, measure).
    decoding/     speculative, prompt lookup, lookahead, Medusa (core, kv, training, measure).
    serving/      workload, scheduler, engine, async engine and HTTP server (core, kv, measure).
    compression/  quantization, pruning, distillation (chapter 12; core, kv, training, measure).
    parallel/     tensor, pipeline, context parallelism, replicas over torch.distributed
                  (chapter 15; core, kv, measure, serving).
    viz/          every plot; the only importer of matplotlib; consumes what the layers above
                  return and never imports bench.
    bench/        the one timing harness, provenance and results store, one module per
                  benchmark, and the bench command line; may import every layer and viz.
    book/         notebook setup, exercise generation and checkers; may import everything.

Only bench, book, ``__main__`` and the notebooks import bench or viz. ``kernels/`` (beside this
package) holds the Triton kernels and is a leaf: it imports torch and triton, never minillm;
``core.attention`` imports it lazily. tests/test_layering.py reads every import and holds these
lines.
"""

from .core.cache import CacheFullError, KVCache
from .core.checkpoints import CheckpointError, bundled_models, load, save_pretrained
from .core.config import PRESETS, ModelConfig, RopeScaling, preset
from .core.generate import GenerationResult, generate
from .core.model import Transformer, random_model
from .core.sampling import SamplingParams, sample
from .core.tokenizer import Tokenizer
from .kv.compressed import CrossLayerKVCache, QuantizedKVCache, SelectiveKVCache, SlidingWindowCache

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CacheFullError",
    "CheckpointError",
    "CrossLayerKVCache",
    "GenerationResult",
    "KVCache",
    "ModelConfig",
    "QuantizedKVCache",
    "RopeScaling",
    "SamplingParams",
    "SelectiveKVCache",
    "SlidingWindowCache",
    "Tokenizer",
    "Transformer",
    "bundled_models",
    "generate",
    "load",
    "preset",
    "random_model",
    "sample",
    "save_pretrained",
]
