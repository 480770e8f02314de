"""Model compression (chapter 12): weight-only quantization, pruning, distillation. Each one
transforms a loaded model and leaves the model class as it is."""

from .awq import awq_quantize
from .calibration import calibration_batches
from .gptq import gptq_quantize
from .quant import CALIBRATED_METHODS, METHODS, SCHEMES, QuantizedLinear, QuantSpec, model_bytes, quantize

CALIBRATED_METHODS.update(gptq=gptq_quantize, awq=awq_quantize)

__all__ = ["METHODS", "SCHEMES", "QuantSpec", "QuantizedLinear", "calibration_batches", "model_bytes", "quantize"]
