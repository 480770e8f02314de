"""Model compression (chapter 12): weight-only quantization, pruning, distillation. Each one
transforms a loaded model and leaves the model class as it is."""

from .calibration import calibration_batches
from .distill import DistillConfig, distill, distillation_loss, kl_to_teacher
from .prune import prune
from .quant import SCHEMES, QuantizedLinear, QuantSpec, model_bytes
from .structured import prune_structured
from .transform import METHODS, quantize

__all__ = [
    "METHODS",
    "SCHEMES",
    "DistillConfig",
    "QuantSpec",
    "QuantizedLinear",
    "calibration_batches",
    "distill",
    "distillation_loss",
    "kl_to_teacher",
    "model_bytes",
    "prune",
    "prune_structured",
    "quantize",
]
