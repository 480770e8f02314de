"""Model compression (chapter 12): weight-only quantization, pruning, distillation. Each one
transforms a loaded model and leaves the model class as it is."""

from .calibration import calibration_batches
from .quant import SCHEMES, QuantizedLinear, QuantSpec, model_bytes
from .transform import METHODS, quantize

__all__ = ["METHODS", "SCHEMES", "QuantSpec", "QuantizedLinear", "calibration_batches", "model_bytes", "quantize"]
