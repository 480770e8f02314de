"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), written by hand with ``torch.distributed``.

Each of N ranks holds 1/N of every layer's matrices and computes 1/N of every layer:

- q/k/v and gate/up are split by output rows (column-parallel): rank r computes its own query
  heads, its own key/value heads, its own slice of the MLP's hidden units. Nothing needs to be
  exchanged, because attention heads and SwiGLU hidden units are independent of each other.
- o_proj and down_proj are split by input columns (row-parallel): each rank multiplies its slice
  of the hidden vector by its slice of the matrix, which gives a partial sum of the full output;
  one all-reduce adds the N partial sums. So a layer costs two all-reduces of (tokens, d_model)
  and nothing else.
- With fewer key/value heads than ranks (GQA, MQA), each K/V head is replicated on the
  N / n_kv_heads ranks whose query heads read it (as vLLM does).
- Norms and the embedding are replicated (they are small); the LM head is either replicated or
  vocabulary-parallel (each rank scores 1/N of the vocabulary, one all-gather assembles the logits).

Sharded, the model is an ordinary ``Transformer`` whose config counts local heads and hidden
units (``local_config``), with its two row-parallel projections per layer wrapped so that they
all-reduce. ``generate`` and every cache run on it unchanged: each rank runs the same loop on the
same (all-reduced) logits and samples the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.cache import KVCache
from ..core.checkpoints import read_config, resolve, to_hf_state_dict
from ..core.config import ModelConfig, is_int
from ..core.generate import generate
from ..core.model import Transformer, rope_inv_freq
from .comm import Comm
from .launch import launch
from .shards import CheckpointSlices


def check_tensor_parallel(config: ModelConfig, tp: int, vocab_parallel: bool = False) -> None:
    """ValueError, before any process starts, for a split that cannot work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    H, Hkv = config.n_heads, config.n_kv_heads
    if H % tp:
        raise ValueError(f"{config.name}: {H} query heads cannot be split over {tp} ranks ({H} % {tp} != 0)")
    if Hkv >= tp and Hkv % tp:
        raise ValueError(f"{config.name}: {Hkv} key/value heads cannot be split over {tp} ranks ({Hkv} % {tp} != 0)")
    if Hkv < tp and tp % Hkv:
        raise ValueError(
            f"{config.name}: {Hkv} key/value heads cannot be replicated evenly over {tp} ranks ({tp} % {Hkv} != 0)"
        )
    if config.ffn_dim % tp:
        raise ValueError(f"{config.name}: ffn_dim {config.ffn_dim} cannot be split over {tp} ranks")
    if vocab_parallel and config.vocab_size % tp:
        raise ValueError(
            f"{config.name}: vocabulary of {config.vocab_size} cannot be split over {tp} ranks; "
            "use a replicated LM head"
        )


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank of ``tp`` holds: n_heads / tp query heads, max(n_kv_heads / tp, 1)
    key/value heads, ffn_dim / tp hidden units; everything else (dim, head_dim, vocabulary,
    context) unchanged."""
    check_tensor_parallel(config, tp)
    return config.replace(
        n_heads=config.n_heads // tp,
        n_kv_heads=max(config.n_kv_heads // tp, 1),
        head_dim=config.head_dim,
        ffn_dim=config.ffn_dim // tp,
    )


def query_heads(config: ModelConfig, tp: int, rank: int) -> range:
    """The global query heads rank ``rank`` computes."""
    n = config.n_heads // tp
    return range(rank * n, (rank + 1) * n)


def kv_heads(config: ModelConfig, tp: int, rank: int) -> range:
    """The global key/value heads rank ``rank`` holds: its own 1/tp, or (fewer K/V heads than
    ranks) the one head its query heads read, which it shares with tp / n_kv_heads ranks."""
    if config.n_kv_heads >= tp:
        n = config.n_kv_heads // tp
        return range(rank * n, (rank + 1) * n)
    head = query_heads(config, tp, rank).start // config.n_rep
    return range(head, head + 1)


# ---------------------------------------------------------------------------------------------
# The sharded layers


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: rank r holds the columns of W that read its
    slice x_r of the input, so its product is one of the N partial sums of the full
    output. The bias (whole, on every rank) is added once, after the sum."""

    def __init__(self, weight: Tensor, bias: Tensor | None, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in / N)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))  # (..., out): the sum of N partial products
        return y + self.bias if self.bias is not None else y


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary: rank r scores tokens [r V/N, (r+1) V/N); one all-gather
    puts the N slices of the logits side by side."""

    def __init__(self, weight: Tensor, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (V / N, dim)
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.all_gather(F.linear(x, self.weight), dim=-1)  # (..., V)


# ---------------------------------------------------------------------------------------------
# Loading one rank's shards


class _ModelSource:
    """The ``CheckpointSlices`` interface over a model in memory (its Hugging Face tensor names),
    for sharding a model that one process already holds (a notebook's)."""

    def __init__(self, model: Transformer):
        self.tensors = to_hf_state_dict(model.state_dict(), model.config)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, rows=None, cols=None, dtype=None, device=None) -> Tensor:
        t = self.tensors[name]
        if rows is not None:
            t = t[rows[0] : rows[1]]
        if cols is not None:
            t = t[:, cols[0] : cols[1]]
        return t.to(device=device, dtype=dtype).contiguous()


def _shard_tensors(source, config: ModelConfig, tp: int, rank: int, vocab_parallel: bool, **to) -> dict:
    """Rank ``rank``'s tensor of every parameter of the local model, read from ``source``."""
    hd, f = config.head_dim, config.ffn_dim // tp
    q, kv = query_heads(config, tp, rank), kv_heads(config, tp, rank)
    q_rows, kv_rows, f_rows = (q.start * hd, q.stop * hd), (kv.start * hd, kv.stop * hd), (rank * f, (rank + 1) * f)
    out = {name: source.get(name, **to) for name in ("embed_tokens.weight", "norm.weight")}
    for i in range(config.n_layers):
        hf = mine = f"layers.{i}."  # the same names, except for the stacked projections
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{mine}{norm}.weight"] = source.get(f"{hf}{norm}.weight", **to)
        for param in ("weight", "bias") if config.qkv_bias else ("weight",):
            parts = [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)]
            out[f"{mine}self_attn.qkv_proj.{param}"] = torch.cat(
                [source.get(f"{hf}self_attn.{name}.{param}", rows=rows, **to) for name, rows in parts]
            )
        for param in ("weight", "bias") if config.mlp_bias else ("weight",):
            out[f"{mine}mlp.gate_up_proj.{param}"] = torch.cat(
                [source.get(f"{hf}mlp.{name}.{param}", rows=f_rows, **to) for name in ("gate_proj", "up_proj")]
            )
        out[f"{mine}self_attn.o_proj.weight"] = source.get(f"{hf}self_attn.o_proj.weight", cols=q_rows, **to)
        out[f"{mine}mlp.down_proj.weight"] = source.get(f"{hf}mlp.down_proj.weight", cols=f_rows, **to)
        if config.o_bias:
            out[f"{mine}self_attn.o_proj.bias"] = source.get(f"{hf}self_attn.o_proj.bias", **to)
        if config.mlp_bias:
            out[f"{mine}mlp.down_proj.bias"] = source.get(f"{hf}mlp.down_proj.bias", **to)
    head = "embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    if vocab_parallel:
        v = config.vocab_size // tp
        out["lm_head.weight"] = source.get(head, rows=(rank * v, (rank + 1) * v), **to)
    elif not config.tie_embeddings:
        out["lm_head.weight"] = source.get(head, **to)
    return out


def shard_model(
    source,
    config: ModelConfig,
    comm: Comm,
    vocab_parallel: bool = False,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """This rank's part of the model: a ``Transformer`` of ``local_config`` shapes whose o_proj and
    down_proj all-reduce (and whose head all-gathers, if vocabulary-parallel). ``source`` is a
    ``CheckpointSlices`` (reads only this rank's blocks) or a model in memory (``_ModelSource``)."""
    tp, rank = comm.world_size, comm.rank
    check_tensor_parallel(config, tp, vocab_parallel)
    device = torch.device(device or "cpu")
    local = local_config(config, tp)
    with torch.device("meta"):
        model = Transformer(local)
    tensors = _shard_tensors(source, config, tp, rank, vocab_parallel, dtype=dtype, device=device)
    head = tensors.pop("lm_head.weight") if vocab_parallel else None
    model.load_state_dict(tensors, strict=False, assign=True)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.data, _data(attn.o_proj.bias), comm)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data, _data(mlp.down_proj.bias), comm)
    if vocab_parallel:
        model.lm_head = VocabParallelHead(head, comm)
    elif config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(local).to(device)
    model.tensor_parallel = tp  # what a timing line or a report names
    return model.eval()


def _data(p: nn.Parameter | None) -> Tensor | None:
    return p.data if p is not None else None


def load_tensor_parallel(
    directory, comm: Comm, vocab_parallel: bool = False, device=None, dtype: torch.dtype = torch.float32
) -> Transformer:
    """Load this rank's shards of a checkpoint (a directory or a bundled model's name), reading
    only its own rows and columns of each matrix."""
    path = resolve(directory)
    config, _ = read_config(path)
    with CheckpointSlices(path) as source:
        return shard_model(source, config, comm, vocab_parallel, device, dtype)


def shard_in_memory(model: Transformer, comm: Comm, vocab_parallel: bool = False) -> Transformer:
    """This rank's part of a model the process already holds (every rank built the same one)."""
    return shard_model(_ModelSource(model), model.config, comm, vocab_parallel, model.device, model.dtype)


# ---------------------------------------------------------------------------------------------
# Checking a sharded model against one process (tests and chapter 15)


@dataclass(frozen=True)
class TPCheck:
    """One check run on every rank: load the shards of ``model`` (a directory or a bundled name),
    run ``prompt_ids`` through them, then generate ``max_new_tokens`` greedy tokens."""

    model: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 32
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids or not all(is_int(t) and t >= 0 for t in self.prompt_ids):
            raise ValueError(f"TPCheck.prompt_ids must be non-negative token ids, got {self.prompt_ids!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"TPCheck.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")

    def config(self) -> ModelConfig:
        return read_config(resolve(self.model))[0]


@dataclass(frozen=True)
class TPResult:
    prefill_logits: Tensor  # (T, vocab): every prompt position's logits
    prefill_counts: dict  # Comm.counts() of the prefill
    tokens: list[int]  # the greedy tokens
    generate_counts: dict  # Comm.counts() of the whole generate call (its prefill and decode steps)
    decode_step_counts: dict  # Comm.counts() of one decode step
    local_params: int  # parameters this rank holds
    ttft_s: float
    tpot_s: float


def _check_one(comm: Comm, spec: TPCheck) -> TPResult:
    model = load_tensor_parallel(spec.model, comm, spec.vocab_parallel)
    prompt = torch.tensor([spec.prompt_ids])
    comm.reset()
    with torch.inference_mode():
        logits = model(prompt)[0]  # (T, vocab)
    prefill = comm.counts()
    comm.reset()
    result = generate(model, prompt, spec.max_new_tokens, eos_token_id=None)
    whole = comm.counts()
    cache = KVCache.for_model(model, 1, len(spec.prompt_ids) + 1)
    with torch.inference_mode():
        model(prompt, cache=cache)
        comm.reset()
        model(result.tokens[:, :1], cache=cache)
    return TPResult(
        logits,
        prefill,
        result.tokens[0].tolist(),
        whole,
        comm.counts(),
        sum(p.numel() for p in model.parameters()),
        result.ttft,
        result.tpot,
    )


def tp_check(rank: int, world_size: int, specs: tuple[TPCheck, ...]) -> list[TPResult]:
    """The rank function: every check, in order, on this rank (``launch(tp_check, N, specs)``)."""
    comm = Comm()
    return [_check_one(comm, spec) for spec in specs]


def run_tp_checks(specs: tuple[TPCheck, ...], world_size: int, timeout: float = 60.0) -> list[list[TPResult]]:
    """Check every split before any process starts, then one launch; per rank, the results in order."""
    for spec in specs:
        check_tensor_parallel(spec.config(), world_size, spec.vocab_parallel)
    return launch(tp_check, world_size, tuple(specs), timeout=timeout)
