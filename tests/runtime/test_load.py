"""The runtime composes loading, the compute dtype and quantization in one place, and refuses
what does not compose with its reason, before anything is loaded."""

import pytest
import torch

import minillm
from minillm.compression import quantize
from minillm.compression.quant import SCHEMES, quantized_layers
from minillm.compression.saving import save_quantized
from minillm.runtime import RuntimeOptions, compute_dtype, load_model

REFUSED = {
    "unknown scheme": (dict(quantize="int3"), "quantize must be one of int8, int4, fp8"),
    "group without int4": (dict(quantize="int8", group_size=32), "applies to int4 quantization only"),
    "zero group": (dict(quantize="int4", group_size=0), "group_size must be a positive integer"),
    "integer dtype": (dict(dtype=torch.int8), "floating-point torch.dtype"),
    "zero ranks": (dict(tensor_parallel=0), "tensor_parallel must be a positive integer"),
    "tp and quantize": (dict(tensor_parallel=2, quantize="int4"), "tensor parallelism with quantized weights"),
    "tp and compile": (dict(tensor_parallel=2, compile=True), "tensor parallelism with compile"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_does_not_compose_is_refused_with_its_reason(case):
    kwargs, reason = REFUSED[case]
    with pytest.raises(ValueError, match=reason):
        RuntimeOptions(**kwargs)


def test_every_scheme_the_library_quantizes_to_is_accepted():
    for scheme in SCHEMES:
        assert RuntimeOptions(quantize=scheme).quantize == scheme


def test_the_compute_dtype_is_decided_once():
    assert compute_dtype(RuntimeOptions(device="cpu")) is None  # the loader's own: fp32 on a CPU
    assert compute_dtype(RuntimeOptions(device="cpu", quantize="int4")) == torch.bfloat16
    assert compute_dtype(RuntimeOptions(device="cpu", quantize="int8", dtype=torch.float32)) == torch.float32
    assert compute_dtype(RuntimeOptions(device="cpu", dtype=torch.float16)) == torch.float16


def test_load_with_quantize_is_load_then_quantize():
    model, tokenizer = minillm.load("minillm-draft", device="cpu", quantize="int8")
    reference, _ = minillm.load("minillm-draft", device="cpu", dtype=torch.bfloat16)
    quantize(reference, "int8")
    ids = torch.tensor([tokenizer.encode("def read_config(path):")])
    assert model.dtype == torch.bfloat16 and len(quantized_layers(model)) == len(quantized_layers(reference)) > 0
    assert torch.equal(model(ids), reference(ids))


def test_a_saved_quantized_directory_loads_through_the_runtime(tmp_path):
    model, tokenizer = load_model("minillm-draft", RuntimeOptions(device="cpu", quantize="int4", group_size=32))
    save_quantized(model, tmp_path, tokenizer)
    again, tok = minillm.load(tmp_path, device="cpu")
    ids = torch.tensor([tokenizer.encode("class Stack:")])
    assert tok is not None and torch.equal(again(ids), model(ids))
    with pytest.raises(ValueError, match="already quantized"):
        load_model(tmp_path, RuntimeOptions(device="cpu", quantize="int4"))


@pytest.mark.slow
def test_quantized_and_compiled_decoding_gives_the_quantized_tokens():
    """Compile composes with quantization: the compiled step over the static cache makes the
    eager quantized model's greedy tokens."""
    model, tokenizer = minillm.load("minillm-draft", device="cpu", quantize="int8")
    ids = tokenizer.encode("def fibonacci(n):")
    eager = minillm.generate(model, ids, 12, eos_token_id=None)
    compiled = minillm.generate(model, ids, 12, eos_token_id=None, compile=True)
    assert compiled.tokens.tolist() == eager.tokens.tolist()


def test_a_quantized_model_asks_for_no_gradient(tmp_path):
    """What lets torch.compile trace it (the packed matmuls have no derivative), saved or not."""
    model, tokenizer = load_model("minillm-draft", RuntimeOptions(device="cpu", quantize="int8"))
    assert not any(p.requires_grad for p in model.parameters())
    save_quantized(model, tmp_path, tokenizer)
    assert not any(p.requires_grad for p in minillm.load(tmp_path, device="cpu")[0].parameters())
    assert any(p.requires_grad for p in minillm.load("minillm-draft", device="cpu")[0].parameters())  # dense: as loaded
    direct = quantize(minillm.load("minillm-draft", device="cpu")[0], "int4", 32)  # the transform itself
    assert not any(p.requires_grad for p in direct.parameters())
