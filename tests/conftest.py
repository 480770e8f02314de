import os

import pytest
import torch

from minillm import ModelConfig, Transformer

# pytest-xdist runs one worker per core: one thread each keeps them from fighting.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# a small model's CPU graph autotunes its matrix products (core.compiled.compiling): 3x the compile
# time, the same tokens; the suite compiles without it, and test_compiled checks it once
os.environ.setdefault("MINILLM_AUTOTUNE", "0")
# and with a Python caller of its kernels (a C++ one compiles a quarter longer, the same kernels);
# test_compiled checks the C++ caller's tokens
os.environ.setdefault("MINILLM_CPP_WRAPPER", "0")
if not torch.cuda.is_available():  # the Triton kernel tests run in its CPU interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=128,
        eos_token_id=None,
        name="tiny",
    )
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, std: float = 0.2, **overrides) -> Transformer:
    """A small random model with peaked logits (std 0.2), so greedy choices are not near ties."""
    return Transformer(tiny_config(**overrides)).init_weights(seed=seed, std=std).eval()


@pytest.fixture
def model() -> Transformer:
    return tiny_model()
