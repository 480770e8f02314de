"""Tensor parallelism the library way: PyTorch's DTensor and ``parallelize_module``.

``minillm.parallel.tensor`` splits each layer by hand (Megatron-LM, Shoeybi et al. 2019). PyTorch
ships the same split as a library, the one TorchTitan (Liang et al. 2025) builds on: a ``DTensor``
is a tensor plus a *placement* on a ``DeviceMesh`` of ranks, and

- ``ColwiseParallel`` shards a Linear's weight by output rows, ``Shard(0)``: each rank computes
  y_r = x W_r^T, its slice of the output features, with no communication;
- ``RowwiseParallel`` shards it by input columns, ``Shard(1)``: each rank computes a partial sum
  x_r W_r^T of the full output, a ``Partial`` DTensor, which becomes ``Replicate`` by one
  all-reduce, y = sum_r x_r W_r^T.

Paired as qkv_proj/o_proj and gate_up_proj/down_proj, a layer costs two all-reduces of
(tokens, d_model), exactly like the hand-written version. The styles turn module inputs and
outputs into plain local tensors (``use_local_output``), so the model's own code runs unchanged on
each rank's local shapes.

The stacking problem. minillm stacks W_q, W_k, W_v into one matrix (rows [q | k | v]) and W_gate,
W_up into another ([gate | up]). ``Shard(0)`` cuts rows into tp contiguous chunks, so rank 0 would
get only query rows. Before sharding, ``qkv_rows_for_tp`` and ``gate_up_rows_for_tp`` permute the
rows so that chunk r is [q rows of rank r's query heads; k rows of its K/V heads; v rows of its
K/V heads] (and [gate rows r; up rows r]). With fewer K/V heads than ranks (GQA/MQA), each K/V head is *copied*
into the chunk of every rank that reads it, so the permuted qkv matrix has
tp * (H/tp + 2 max(Hkv/tp, 1)) * head_dim rows, more than the original (H + 2 Hkv) * head_dim.
Each attention module is then told its local head counts, and ``model.config`` becomes
``local_config`` so that ``KVCache.for_model`` allocates caches for the local K/V heads only.

The LM head is replicated (every rank scores the whole vocabulary), or with ``vocab_parallel``
sharded ``ColwiseParallel(output_layouts=Replicate())``: each rank scores V/tp words and one
all-gather assembles the logits. A tied head (the embedding matrix, ``tie_embeddings``) is left
tied when replicated; vocabulary-parallel, it is *untied*: the head gets its own copy of the
embedding matrix, which is then sharded, while the embedding itself stays whole and replicated.

Loading. The hand-written version reads only its slices of the checkpoint (``CheckpointSlices``);
this one loads the whole model on every rank and then distributes it, as DTensor's
from-a-full-module path (``distribute_tensor`` inside ``parallelize_module``) does.

What DTensor on CPU/gloo (torch 2.13) is like. It needs no change to ``generate``, caches or the
model's code, emits no warnings, and gives the single-process logits within 1e-5 (fp32; partial
sums are added in another order) and the same greedy tokens. But every sharded Linear pays
DTensor's Python dispatch, and ``generate`` runs under ``torch.inference_mode``, where composite
ops such as ``aten.linear`` reach DTensor undecomposed (autograd, which would split them into
``mm``/``addmm``, is skipped): the C++ fast path misses and DTensor propagates the op's sharding
through a fake-tensor decomposition on every call, uncached (PyTorch's own comment in
``torch/distributed/tensor/_dispatch.py`` says so). ``parallelize_dtensor`` therefore runs the
sharded Linears' forward under ``no_grad`` outside inference mode (``escape_inference_mode``),
which is about 3x faster. Measured once, roughly (2 ranks, one thread each, a shared 2-core
machine), one decode step of minillm-target: plain model 7.6 ms; DTensor in inference mode 164 ms;
escaped 60 ms (12 all-reduces a step; one small gloo all-reduce took ~1.7 ms here). Importing
``CommDebugMode`` also imports ``torch._inductor`` (~3 s per rank).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..core.cache import KVCache
from ..core.checkpoints import load, read_config, resolve
from ..core.config import ModelConfig
from ..core.generate import generate
from ..core.model import Attention, Transformer
from .launch import check_world_size, launch
from .tensor import check_tensor_parallel, kv_heads, local_config, query_heads


def _head_rows(heads: range, offset: int, head_dim: int) -> list[int]:
    """Row indices of ``heads`` in a stacked matrix whose block starts at row ``offset``."""
    return [offset + h * head_dim + i for h in heads for i in range(head_dim)]


def qkv_rows_for_tp(config: ModelConfig, tp: int) -> Tensor:
    """Row order of the stacked qkv matrix after which chunk r of tp is rank r's [q; k; v].

    Rows of K/V heads shared by several ranks (n_kv_heads < tp) appear once per rank, so the
    result can be longer than (n_heads + 2 n_kv_heads) * head_dim."""
    hd, q_end = config.head_dim, config.n_heads * config.head_dim
    k_start, v_start = q_end, q_end + config.n_kv_heads * hd
    rows: list[int] = []
    for rank in range(tp):
        kv = kv_heads(config, tp, rank)
        rows += _head_rows(query_heads(config, tp, rank), 0, hd)
        rows += _head_rows(kv, k_start, hd) + _head_rows(kv, v_start, hd)
    return torch.tensor(rows, dtype=torch.long)


def gate_up_rows_for_tp(config: ModelConfig, tp: int) -> Tensor:
    """Row order of the stacked gate/up matrix after which chunk r of tp is [gate rows r; up rows r]."""
    f, n = config.ffn_dim, config.ffn_dim // tp
    rows: list[int] = []
    for rank in range(tp):
        rows += list(range(rank * n, (rank + 1) * n)) + list(range(f + rank * n, f + (rank + 1) * n))
    return torch.tensor(rows, dtype=torch.long)


def _permute_rows(linear: nn.Linear, rows: Tensor) -> None:
    """Replace a Linear's weight (and bias) by the given rows, in that order (may repeat rows)."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)  # (len(rows), in)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _set_local_heads(attn: Attention, local: ModelConfig) -> None:
    attn.n_heads, attn.n_kv_heads = local.n_heads, local.n_kv_heads
    attn.q_size, attn.kv_size = local.n_heads * local.head_dim, local.n_kv_heads * local.head_dim


def _outside_inference_mode(forward):
    """``forward`` run under no_grad rather than inference_mode (see the module docstring)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return forward(*args, **kwargs)

    return run


def tp_plan(vocab_parallel: bool = False) -> dict:
    """The parallelize_module plan: which Linear is sharded how."""
    plan = {
        "layers.*.self_attn.qkv_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(),
        "layers.*.mlp.gate_up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(),
    }
    if vocab_parallel:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # V/tp words each, one all-gather
    return plan


def parallelize_dtensor(
    model: Transformer, mesh: DeviceMesh, vocab_parallel: bool = False, escape_inference_mode: bool = True
) -> Transformer:
    """Shard a full ``Transformer`` in place over a 1-D mesh of tp ranks; returns it.

    Afterwards the model is an ordinary ``Transformer`` to its callers (``generate``, caches)
    whose config counts one rank's heads and hidden units. ``escape_inference_mode`` runs each
    sharded Linear's matmul under no_grad even inside ``torch.inference_mode`` (about 3x faster
    decode steps, see the module docstring); the model is then for inference only."""
    if mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D device mesh, got {mesh.ndim} dimensions")
    config, tp = model.config, mesh.size()
    check_tensor_parallel(config, tp, vocab_parallel)
    local = local_config(config, tp)
    qkv_rows, gate_up_rows = qkv_rows_for_tp(config, tp), gate_up_rows_for_tp(config, tp)
    for layer in model.layers:
        _permute_rows(layer.self_attn.qkv_proj, qkv_rows)
        _permute_rows(layer.mlp.gate_up_proj, gate_up_rows)
        _set_local_heads(layer.self_attn, local)
    if vocab_parallel and model.lm_head.weight is model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
    plan = tp_plan(vocab_parallel)
    parallelize_module(model, mesh, plan)
    if escape_inference_mode:
        for name, module in model.named_modules():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan):
                module.forward = _outside_inference_mode(module.forward)
    model.config = local
    return model


@dataclass(frozen=True)
class DTensorCheck:
    """One model to shard and compare: ``model`` (a directory or bundled name), a prompt,
    how many greedy tokens to generate, whether the LM head is vocabulary-parallel, and whether
    the sharded matmuls escape inference mode (``parallelize_dtensor``)."""

    model: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 32
    vocab_parallel: bool = False
    escape_inference_mode: bool = True

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a directory or a bundled model's name, got {self.model!r}")
        if not self.prompt_ids or not all(isinstance(t, int) and t >= 0 for t in self.prompt_ids):
            raise ValueError(f"prompt_ids must be a non-empty tuple of token ids, got {self.prompt_ids!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        for name in ("vocab_parallel", "escape_inference_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def config(self) -> ModelConfig:
        return read_config(resolve(self.model))[0]


@dataclass(frozen=True)
class DTensorResult:
    """What one rank saw: the prompt's logits, greedy tokens, the collectives of one decode step
    (op name -> calls, from CommDebugMode), and generate's timings in seconds (rough, not for tests)."""

    prefill_logits: np.ndarray  # (T, vocab) fp32, the prompt's logits
    tokens: tuple[int, ...]
    decode_comm_counts: dict[str, int]
    decode_total_comms: int
    ttft_s: float  # generate's time to the first token (the prefill)
    tpot_s: float  # generate's mean time per decode step


def _op_name(op) -> str:
    """'all_reduce' for torch.ops._c10d_functional.all_reduce (and its spellings)."""
    return str(op).rsplit(".", 1)[-1]


def decode_step_comms(model: Transformer, prompt: Tensor) -> tuple[dict[str, int], int]:
    """Prefill ``prompt`` (1, T) into a fresh cache, then count the collectives of one decode
    step: (op name -> calls, total calls)."""
    cache = KVCache.for_model(model, 1, prompt.shape[1] + 1)
    with torch.inference_mode():
        token = model(prompt, cache=cache, last_only=True)[:, -1].argmax(-1)  # (1,)
        with CommDebugMode() as comm:
            model(token[:, None], cache=cache)
    counts = {_op_name(op): n for op, n in comm.get_comm_counts().items()}
    return counts, comm.get_total_counts()


def _check_one(mesh: DeviceMesh, spec: DTensorCheck) -> DTensorResult:
    model, _ = load(spec.model, device="cpu", dtype=torch.float32)
    parallelize_dtensor(model, mesh, spec.vocab_parallel, spec.escape_inference_mode)
    prompt = torch.tensor([spec.prompt_ids], dtype=torch.long)  # (1, T)
    with torch.inference_mode():
        logits = model(prompt)[0]  # (T, vocab)
    result = generate(model, prompt, spec.max_new_tokens, eos_token_id=None)
    counts, total = decode_step_comms(model, prompt)
    tpot = sum(result.token_times) / max(len(result.token_times), 1)
    return DTensorResult(logits.numpy().copy(), tuple(result.tokens[0].tolist()), counts, total, result.ttft, tpot)


def dtensor_check(rank: int, world_size: int, specs: tuple[DTensorCheck, ...]) -> list[DTensorResult]:
    """Rank function for ``launch``: for each spec, load the whole model, shard it with DTensor,
    and return its prefill logits, greedy tokens and one decode step's counted collectives.

    Each rank loads the full checkpoint and then keeps its shards (DTensor's from-a-full-module
    path); the hand-written ``minillm.parallel.tensor`` reads only its slices. Returned arrays are
    numpy (pickled by value), so nothing depends on this process staying alive."""
    mesh = init_device_mesh("cpu", (world_size,))
    return [_check_one(mesh, spec) for spec in specs]


def run_dtensor_checks(specs: tuple[DTensorCheck, ...], world_size: int, timeout: float = 60.0) -> list:
    """Check every spec's split first (ValueError before any process starts), then run them all
    in one launch of ``world_size`` ranks; per rank, a list of ``DTensorResult``."""
    check_world_size(world_size)
    for spec in specs:
        check_tensor_parallel(spec.config(), world_size, spec.vocab_parallel)
    return launch(dtensor_check, world_size, tuple(specs), timeout=timeout, threads=1)
