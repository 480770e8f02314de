"""Model compression (chapter 12): weight-only quantization, pruning, distillation. Each one
transforms a loaded model and leaves the model class as it is."""

from .quant import METHODS, SCHEMES, QuantizedLinear, QuantSpec, model_bytes, quantize

__all__ = ["METHODS", "SCHEMES", "QuantSpec", "QuantizedLinear", "model_bytes", "quantize"]
