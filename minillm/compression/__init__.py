"""Model compression (chapter 12): weight-only quantization, pruning, distillation. Each one
transforms a loaded model and leaves the model class as it is."""

from .distill import DistillConfig, distill, distillation_loss, kl_to_teacher
from .quant import METHODS, SCHEMES, QuantizedLinear, QuantSpec, model_bytes, quantize

__all__ = [
    "METHODS",
    "SCHEMES",
    "DistillConfig",
    "QuantSpec",
    "QuantizedLinear",
    "distill",
    "distillation_loss",
    "kl_to_teacher",
    "model_bytes",
    "quantize",
]
