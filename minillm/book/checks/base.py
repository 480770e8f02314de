"""What every checker uses: the failure type, the pass line, and a tolerant comparison."""

from __future__ import annotations

import torch

from ...measure.report import wrap_line


class CheckFailed(AssertionError):
    """An exercise's check did not pass; the message says what to look at."""


def passed(name: str, detail: str) -> None:
    print("\n".join(wrap_line(f"PASSED {name}: {detail}", indent="  ")))


def require(ok: bool, name: str, hint: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {hint}")


def close(a, b, atol: float = 1e-5) -> bool:
    """Same shape and values (float64 comparison)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=atol, rtol=1e-5))
