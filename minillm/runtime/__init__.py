"""The runtime: the one place where techniques compose on a loaded model (gpt-fast's
``_load_model``): a checkpoint (Hugging Face layout, a bundled model, or one of minillm's own saved
quantized directories) is loaded in the compute dtype, quantized, and decoded eagerly or compiled.
``RuntimeOptions`` says which, and refuses, with its reason, every combination that does not work,
before anything is loaded. The command line, the server and the benchmarks all load through it.
"""

from .load import RuntimeOptions, compute_dtype, load, load_model

__all__ = ["RuntimeOptions", "compute_dtype", "load", "load_model"]
