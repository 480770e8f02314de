"""Model configuration: one validated dataclass, plus shape presets of real models.

The presets copy the published shapes (layers, widths, heads, vocabulary, RoPE settings) of
real checkpoints. Built with random weights they have the true parameter count and memory
traffic, which is all that speed experiments depend on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "llama3")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is a positive int (not a bool)."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _got(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_field_types(obj: object, ints: tuple[str, ...], optional_ints=(), numbers=(), bools=()) -> None:
    """ValueError naming the first field of a config or options dataclass whose value has the wrong
    type or is not positive (numbers: not finite and positive); run first in ``__post_init__``,
    before any arithmetic on the fields."""
    kind = type(obj).__name__
    for name in ints + tuple(n for n in optional_ints if getattr(obj, n) is not None):
        value = getattr(obj, name)
        if not is_int(value) or value <= 0:
            raise ValueError(f"{kind}.{name} must be a positive integer, got {_got(value)}")
    for name in numbers:
        value = getattr(obj, name)
        if not is_number(value) or not 0 < value < math.inf:
            raise ValueError(f"{kind}.{name} must be a positive number, got {_got(value)}")
    for name in bools:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{kind}.{name} must be true or false, got {_got(getattr(obj, name))}")


@dataclass(frozen=True)
class RopeScaling:
    """Stretching RoPE to longer contexts. ``llama3`` follows Llama 3.1's frequency-band rule."""

    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # context extension factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low_freq_factor are scaled by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: the context the model was trained at

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        check_field_types(
            self,
            ints=("original_max_position_embeddings",),
            numbers=("factor", "low_freq_factor", "high_freq_factor"),
        )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, "
                f"got {self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2, ...)."""

    vocab_size: int = 4096
    dim: int = 256  # d_model, the residual stream width
    n_layers: int = 6
    n_heads: int = 8  # query heads
    n_kv_heads: int | None = None  # key/value heads: n_heads = MHA, 1 = MQA, between = GQA
    head_dim: int | None = None  # defaults to dim // n_heads
    ffn_dim: int = 688  # hidden width of the SwiGLU MLP
    max_seq_len: int = 2048  # the context length; generation never runs past it
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    o_bias: bool = False  # Llama's attention_bias also puts a bias on the output projection
    mlp_bias: bool = False
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    sliding_window: int | None = None  # each token attends to at most this many keys (Mistral v0.1)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError as e:  # an unknown key
                raise ValueError(f"ModelConfig.rope_scaling: {e}") from e
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or a dict, got {_got(self.rope_scaling)}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        check_field_types(
            self,
            ints=("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"),
            optional_ints=("n_kv_heads", "head_dim", "sliding_window"),
            numbers=("norm_eps", "rope_theta"),
            bools=("qkv_bias", "o_bias", "mlp_bias", "tie_embeddings"),
        )
        self._check_token_ids()
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a string, got {_got(self.name)}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): "
                "each key/value head serves a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def _check_token_ids(self) -> None:
        """EOS ids must be ids of this vocabulary (generation stops at them); BOS must be an id or
        None, in any range (minillm never feeds it, and some checkpoints name a stray one)."""
        bos = self.bos_token_id
        if bos is not None and (not is_int(bos) or bos < 0):
            raise ValueError(f"ModelConfig.bos_token_id must be None or a non-negative id, got {_got(bos)}")
        eos = self.eos_token_id
        ids = {f"eos_token_id[{i}]": x for i, x in enumerate(eos)} if isinstance(eos, tuple) else {"eos_token_id": eos}
        for name, value in ids.items():
            if value is not None and (not is_int(value) or not 0 <= value < self.vocab_size):
                raise ValueError(
                    f"ModelConfig.{name} must be None or an id in [0, {self.vocab_size}), got {_got(value)}"
                )

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def kv_bytes(self, tokens: int, bytes_per_element: float = 2) -> float:
        """K and V of ``tokens`` tokens across every layer: 2 x n_layers x n_kv_heads x
        head_dim x tokens x bytes per element. The one KV-bytes formula: the cache sizes
        of kv.memory, the handoffs of serving, the links of measure and the ranks of
        parallel all call it."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * tokens * bytes_per_element

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count from the shapes alone (no model needed)."""
        d, hd = self.dim, self.head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        if self.o_bias:
            attn += d
        mlp = 3 * d * self.ffn_dim + (2 * self.ffn_dim + d if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d  # two RMSNorm weights
        total = self.n_layers * per_layer + d  # final norm
        if include_embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total


_LLAMA3_ROPE = RopeScaling(
    "llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
_LLAMA2 = dict(vocab_size=32000, max_seq_len=4096, bos_token_id=1, eos_token_id=2)
_SMOL = dict(
    vocab_size=49152, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True, bos_token_id=1, eos_token_id=2
)
_QWEN25 = dict(
    vocab_size=151936,
    max_seq_len=32768,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    qkv_bias=True,
    tie_embeddings=True,
    eos_token_id=151643,
)

PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in [
        ModelConfig(
            name="Llama-3.2-1B",
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            max_seq_len=131072,
            rope_scaling=_LLAMA3_ROPE,
            tie_embeddings=True,
            **_LLAMA3,
        ),
        ModelConfig(
            name="Llama-3.2-3B",
            dim=3072,
            n_layers=28,
            n_heads=24,
            n_kv_heads=8,
            ffn_dim=8192,
            max_seq_len=131072,
            rope_scaling=_LLAMA3_ROPE,
            tie_embeddings=True,
            **_LLAMA3,
        ),
        ModelConfig(
            name="Llama-3-8B",
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            max_seq_len=8192,
            **_LLAMA3,
        ),
        ModelConfig(
            name="Llama-3-70B",
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            ffn_dim=28672,
            max_seq_len=8192,
            **_LLAMA3,
        ),
        ModelConfig(name="Llama-2-7B", dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, **_LLAMA2),
        ModelConfig(name="Llama-2-13B", dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, **_LLAMA2),
        ModelConfig(name="Llama-2-70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA2),
        ModelConfig(
            name="Mistral-7B-v0.3",
            vocab_size=32768,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            max_seq_len=32768,
            rope_theta=1000000.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        ModelConfig(
            name="TinyLlama-1.1B",
            vocab_size=32000,
            dim=2048,
            n_layers=22,
            n_heads=32,
            n_kv_heads=4,
            ffn_dim=5632,
            max_seq_len=2048,
            bos_token_id=1,
            eos_token_id=2,
        ),
        ModelConfig(name="SmolLM2-135M", dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, **_SMOL),
        ModelConfig(name="SmolLM2-360M", dim=960, n_layers=32, n_heads=15, n_kv_heads=5, ffn_dim=2560, **_SMOL),
        ModelConfig(
            name="SmolLM2-1.7B",
            dim=2048,
            n_layers=24,
            n_heads=32,
            n_kv_heads=32,
            ffn_dim=8192,
            **{**_SMOL, "rope_theta": 130000.0},
        ),
        ModelConfig(name="Qwen2.5-0.5B", dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, **_QWEN25),
        ModelConfig(name="Qwen2.5-1.5B", dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, **_QWEN25),
    ]
}


def preset(name: str, **overrides) -> ModelConfig:
    """The config of a real model by name (case-insensitive), optionally with fields changed."""
    by_lower = {k.lower(): v for k, v in PRESETS.items()}
    if name.lower() not in by_lower:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return by_lower[name.lower()].replace(**overrides)


def shape_config(shape: str | ModelConfig) -> ModelConfig:
    """An options field that takes a preset's name or a config: the config, or a ValueError naming
    the known presets."""
    if isinstance(shape, ModelConfig):
        return shape
    try:
        return preset(shape)
    except KeyError as e:
        raise ValueError(e.args[0]) from e


def ceil_div(n: int, d: int) -> int:
    """How many pieces of size ``d`` hold ``n`` items (the one spelling of ceiling division):
    blocks for tokens, cache groups for layers, grid rows for panels."""
    return -(-n // d)
