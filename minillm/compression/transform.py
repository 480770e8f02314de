"""``quantize``: a loaded model in, the same model with its linear layers quantized out.

Round to nearest needs only the weights (``quant.py``); GPTQ and AWQ also read calibration
activations (``gptq.py``, ``awq.py``). All three store the same ``QuantizedLinear``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from .awq import awq_quantize
from .gptq import gptq_quantize
from .quant import QuantizedLinear, QuantSpec, linear_layers, prepare_kernels, quantized_layers, replace_module

METHODS = ("rtn", "gptq", "awq")
CALIBRATED = {"gptq": gptq_quantize, "awq": awq_quantize}


def check_not_quantized(model: nn.Module) -> None:
    done = quantized_layers(model)
    if done:
        spec = next(iter(done.values())).spec
        raise ValueError(
            f"the model is already quantized ({spec.label}, {len(done)} layers): quantize the original "
            "model, not a quantized one (rounding twice compounds the error)"
        )


def quantize(
    model: nn.Module,
    scheme: str,
    group_size: int | None = None,
    method: str = "rtn",
    calibration: Tensor | None = None,
    skip: Iterable[str] = (),
    **method_options,
) -> nn.Module:
    """Replace the model's linear layers by ``QuantizedLinear`` in place; returns the model.

    ``scheme`` "int8" | "int4" | "fp8"; ``group_size`` for int4 (default 128); ``method`` "rtn"
    (round to nearest), "gptq" or "awq" (both need ``calibration``: token ids (n, T) from the
    training split, e.g. ``calibration_batches``). ``skip`` names layers kept as they are. A tied
    LM head is quantized too; the embedding it shared stays in full precision for the lookup.
    The scheme is recorded on the model (``model.quantization``) for saving. A quantized model
    is for inference: it asks for no gradient (its packed weights have none, and with no
    parameter asking for one torch.compile traces no backward through PyTorch's packed int8/int4
    matmuls, which have no derivative).
    """
    spec = QuantSpec.make(scheme, group_size)
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}: choose one of {METHODS}")
    check_not_quantized(model)
    if method != "rtn":
        if calibration is None:
            raise ValueError(f"method {method!r} needs calibration data: token ids (n, T), e.g. calibration_batches()")
        if spec.scheme != "int4":
            raise ValueError(f"method {method!r} is implemented for int4, got scheme {spec.scheme!r}")
    targets = linear_layers(model, skip)
    if not targets:
        raise ValueError("the model has no linear layers to quantize (all skipped?)")
    if method == "rtn":
        for name in list(targets):  # one at a time, the original dropped once replaced: an 8B model fits
            replace_module(model, name, QuantizedLinear.from_linear(targets.pop(name), spec))
    else:
        CALIBRATED[method](model, spec, calibration, targets, **method_options)
    prepare_kernels(model)
    model.requires_grad_(False)
    model.quantization = {"scheme": spec.scheme, "group_size": spec.group_size, "method": method, "skip": list(skip)}
    return model
