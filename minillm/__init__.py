"""minillm: LLM inference optimization from scratch, one concept per module.

model, tokenizer = minillm.load("minillm-target")
ids = tokenizer.encode("def fibonacci(n):")
result = minillm.generate(model, ids, max_new_tokens=64)
print(tokenizer.decode(result.tokens[0]))
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
