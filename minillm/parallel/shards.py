"""Reading only part of a checkpoint: the rows or columns of a tensor that one rank holds.

safetensors files are memory-mapped and their ``get_slice`` reads just the requested block, so a
rank of a tensor-parallel group reads 1/N of each sharded matrix and a pipeline stage reads only
its layers: no rank ever materializes the whole model (the point of splitting a model that does
not fit on one device). Names are Hugging Face's without the ``model.`` prefix
(``layers.0.self_attn.q_proj.weight``), as in ``minillm.core.checkpoints``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..core.checkpoints import CheckpointError, weight_files


class CheckpointSlices:
    """Open every safetensors file of a checkpoint; ``get(name, rows=, cols=)`` reads one block."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, object] = {}  # HF name without "model." -> its open file
        try:
            for file in weight_files(self.directory):
                f = self._stack.enter_context(safe_open(str(file), framework="pt"))
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._where[key.removeprefix("model.")] = (f, key)
        except (SafetensorError, OSError) as e:
            self._stack.close()
            raise CheckpointError(f"{self.directory} has an unreadable safetensors file: {e}") from e

    def __enter__(self) -> CheckpointSlices:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        f, key = self._lookup(name)
        return list(f.get_slice(key).get_shape())

    def _lookup(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"checkpoint in {self.directory} has no tensor {name!r}")
        return self._where[name]

    def get(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of tensor ``name`` (all of a dimension when None)."""
        f, key = self._lookup(name)
        part = f.get_slice(key)
        shape = part.get_shape()
        for what, span, size in (("rows", rows, shape[0]), ("cols", cols, shape[-1])):
            if span is not None and not 0 <= span[0] < span[1] <= size:
                raise CheckpointError(f"{what} {span} out of range for {name!r} of shape {tuple(shape)}")
        r = slice(*rows) if rows is not None else slice(None)
        t = part[r] if cols is None else part[r, slice(*cols)]
        return t.to(device=device, dtype=dtype).contiguous()
