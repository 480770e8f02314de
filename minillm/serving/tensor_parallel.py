"""The engine over a tensor-parallel model (chapter 15 under chapter 13's engine): this process
schedules, N rank processes run every step, as vLLM's and nano-vllm's multi-process executors do.

    engine = Engine(TensorParallelModel.start("minillm-target", RuntimeOptions(tensor_parallel=2),
                                              num_blocks=256, block_size=16)[0], config)

Each rank (a child of ``parallel.launch``) loads only its shard of the checkpoint
(``parallel.tensor.load_tensor_parallel``: its query and K/V heads, its slice of the MLP) and
keeps a ``KVPool`` of its own heads with the same blocks; the engine's block tables index every
rank's pool at once. ``TensorParallelModel`` stands in for the model in the engine's process: a
forward sends (ids, positions, block tables) to every rank's inbox, each rank runs its shard over
its pool (two all-reduces a layer, gloo on a CPU), and rank 0 sends back the logits, which every
rank holds after the last all-reduce. A copy-on-write copy is sent to every rank too
(``RemotePool.copy_block``), in order with the forwards. Speculation composes unchanged (a draft
model runs in this process on its own pool); compiling and quantized shards are refused by the
runtime.

Failure: a rank that raises or dies fails the step it was in (those requests end with an error);
the ranks are then stopped and every later step fails with the reason. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import queue
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checkpoints import read_config, resolve
from ..core.tokenizer import Tokenizer
from ..kv.paged import KVPool, PagedKVBatch
from ..parallel.launch import Children, default_backend, rank_device
from ..parallel.tensor import check_tensor_parallel, local_config
from ..runtime import RuntimeOptions

STEP_TIMEOUT_S = 600.0  # a step (or the ranks' loading) longer than this fails
IDLE_POLL_S = 1.0  # an idle rank checks this often that its parent is still there


@dataclass(frozen=True)
class RankSpec:
    model_dir: str
    dtype: str
    device: str
    num_blocks: int
    block_size: int


def rank_main(rank: int, world_size: int, spec: RankSpec, inbox, reports) -> None:
    """A rank's life inside ``child_main``: load its shard and a pool of its heads, then run what
    the engine sends until told to stop (or its parent is gone)."""
    from ..parallel.comm import Comm
    from ..parallel.tensor import load_tensor_parallel

    parent = os.getppid()
    device = rank_device(spec.device, rank)
    model = load_tensor_parallel(spec.model_dir, Comm(), device=device, dtype=getattr(torch, spec.dtype))
    pool = KVPool.for_model(model, spec.num_blocks, spec.block_size)
    reports.put(("ready", rank))
    while True:
        try:
            message = inbox.get(timeout=IDLE_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: nobody will send a stop
                return
            continue
        kind = message[0]
        if kind == "stop":
            return
        if kind == "copy":
            pool.copy_block(*message[1:])
            continue
        _, ids, positions, tables, last_only = message
        cache = PagedKVBatch.from_tables(pool, tables) if tables is not None else None
        positions = positions.to(device) if positions is not None else None
        with torch.inference_mode():
            logits = model(ids.to(device), positions, cache, last_only)
        if rank == 0:
            reports.put(("logits", rank, logits.cpu()))


class RemotePool:
    """What the engine sees of the ranks' pools: their block geometry, their bytes, and
    copy-on-write (sent to every rank). It holds no K/V itself."""

    def __init__(self, model: TensorParallelModel, num_blocks: int, block_size: int):
        self.model, self.num_blocks, self.block_size = model, num_blocks, block_size
        self.k = self.v = torch.empty(0)  # no storage here: PagedKVBatch reads only the device

    @property
    def nbytes(self) -> int:
        c, tp = local_config(self.model.config, self.model.tensor_parallel), self.model.tensor_parallel
        per_rank = 2 * c.n_layers * self.num_blocks * self.block_size * c.n_kv_heads * c.head_dim
        return per_rank * tp * self.model.dtype.itemsize

    def copy_block(self, src: int, dst: int) -> None:
        self.model.send(("copy", src, dst))


class TensorParallelModel:
    """The engine's model when N ranks hold it (see the module's docstring); ``close`` ends them."""

    remote = True  # not in this process: no throwaway engine can run on it (``http.warm_up``)

    def __init__(self, config, tensor_parallel: int, dtype: torch.dtype, children: Children, inboxes, spec: RankSpec):
        self.config, self.tensor_parallel, self.dtype = config, tensor_parallel, dtype
        self.device = torch.device("cpu")  # where the engine builds inputs and gets logits
        self.children, self.inboxes, self.spec = children, inboxes, spec
        self.pool = RemotePool(self, spec.num_blocks, spec.block_size)
        self.failed: str | None = None

    @classmethod
    def start(
        cls, name: str, options: RuntimeOptions, num_blocks: int, block_size: int, timeout: float = STEP_TIMEOUT_S
    ) -> tuple[TensorParallelModel, Tokenizer | None]:
        """Spawn the ranks, wait until every one has loaded its shard -> (model, tokenizer)."""
        from ..parallel.cli_ranks import rank_threads

        tp = options.tensor_parallel
        directory = resolve(name)
        config, _ = read_config(directory)
        check_tensor_parallel(config, tp)
        device = str(options.device or "cpu")
        dtype = options.dtype or torch.float32
        spec = RankSpec(str(directory), str(dtype).removeprefix("torch."), device, num_blocks, block_size)
        children = Children(
            tp,
            backend=default_backend(device, tp),
            timeout=timeout,
            threads=rank_threads(None, tp),
            name=lambda r: f"tensor-parallel rank {r} of {tp}",
            farewell=("stop",),
        )
        try:
            inboxes = [children.queue() for _ in range(tp)]
            for rank in range(tp):
                children.start(rank_main, spec, inboxes[rank], children.reports)
            ready = set()
            while len(ready) < tp:
                message = children.receive(timeout, doing="loading the shards")
                if message is None:
                    raise TimeoutError(f"the tensor-parallel ranks did not load within {timeout} s")
                ready.add(message[1])
        except BaseException:
            children.close()
            raise
        tokenizer = Tokenizer.from_dir(directory) if (directory / "tokenizer.json").is_file() else None
        return cls(config, tp, dtype, children, inboxes, spec), tokenizer

    def kv_pool(self, num_blocks: int, block_size: int) -> RemotePool:
        """The engine's pool: the ranks' (it must fit what they allocated)."""
        if (num_blocks, block_size) != (self.spec.num_blocks, self.spec.block_size):
            raise ValueError(
                f"the ranks hold {self.spec.num_blocks} KV blocks of {self.spec.block_size} tokens, "
                f"not {num_blocks} of {block_size}"
            )
        return self.pool

    def send(self, message: tuple) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel ranks have stopped: {self.failed}")
        for inbox in self.inboxes:
            inbox.put(message)

    def __call__(self, input_ids: Tensor, positions: Tensor | None = None, cache=None, last_only: bool = False, **_):
        tables = cache.tables.cpu() if cache is not None else None
        self.send(("forward", input_ids.cpu(), None if positions is None else positions.cpu(), tables, last_only))
        try:
            message = self.children.receive(self.children.timeout, doing="an engine step")
            if message is None:
                raise TimeoutError(f"no logits from rank 0 within {self.children.timeout} s")
        except BaseException as e:
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            self.close()
            raise
        return message[2]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.children.close()
