"""Self-checking exercises: solutions/ is the single source, exercises/ is generated from it.

In a solution notebook, the code a reader should write sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION``. ``make exercises`` (``python -m minillm.exercises``) writes the same
notebooks to exercises/ with each region replaced by ``raise NotImplementedError`` and every
output cleared. After each exercise a check cell calls one of the checkers below: it prints a
pass line, or raises ``CheckFailed`` with a hint.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = "raise NotImplementedError  # your code here"
REGION = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*$", re.M | re.S)


class CheckFailed(AssertionError):
    """An exercise's check did not pass; the message says what to look at."""


# ---------------------------------------------------------------------------------------------
# solutions/ -> exercises/


def count_regions(source: str) -> int:
    return len(REGION.findall(source))


def stub_source(source: str, only: int | None = None) -> str:
    """Replace solution regions by a stub that raises, keeping their indentation.

    ``only`` stubs just the region with that index (counted across the string), for tests that
    show each exercise's check fails without its solution."""
    counter = iter(range(10**9))

    def replace(match: re.Match) -> str:
        i = next(counter)
        return match.group(1) + STUB if only is None or i == only else match.group(0)

    return REGION.sub(replace, source)


def _cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def exercise_notebook(solution: dict, only: int | None = None) -> dict:
    """The exercise version of a solution notebook: regions stubbed, outputs cleared.

    With ``only``, just that region (numbered across the notebook) is stubbed and outputs are kept."""
    nb = copy.deepcopy(solution)
    seen = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = _cell_source(cell)
        n = count_regions(src)
        if only is None:
            cell["source"] = stub_source(src)
            cell["outputs"], cell["execution_count"] = [], None
        elif seen <= only < seen + n:
            cell["source"] = stub_source(src, only - seen)
        seen += n
    return nb


def read_notebook(path: Path) -> dict:
    import nbformat

    return nbformat.read(str(path), as_version=4)


def dump_notebook(nb: dict) -> str:
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def execute_notebook(nb: dict, cwd: Path, timeout: int = 600) -> dict:
    """Run every cell of ``nb`` in a fresh kernel (in ``cwd``); raise on the first error."""
    import nbformat
    from nbclient import NotebookClient

    node = nbformat.from_dict(copy.deepcopy(nb))
    NotebookClient(node, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return node


def write_exercises(solutions: Path = Path("solutions"), exercises: Path = Path("exercises")) -> list[Path]:
    """Regenerate every exercise notebook; return the paths written."""
    exercises.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(Path(solutions).glob("*.ipynb")):
        nb = read_notebook(src)
        if not any(count_regions(_cell_source(c)) for c in nb["cells"] if c["cell_type"] == "code"):
            raise ValueError(f"{src} has no {BEGIN} region: an exercise notebook needs at least one")
        dst = exercises / src.name
        dst.write_text(dump_notebook(exercise_notebook(nb)), encoding="utf-8")
        written.append(dst)
    return written


# ---------------------------------------------------------------------------------------------
# Checkers


def passed(name: str, detail: str) -> None:
    print(f"PASSED {name}: {detail}")


def require(ok: bool, name: str, hint: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {hint}")


def _close(a, b, atol: float = 1e-5) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=atol, rtol=1e-5))


def check_softmax_with_temperature(fn: Callable) -> None:
    """fn(logits (V,), temperature > 0) -> probabilities (V,)."""
    name = "softmax with temperature"
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    for t in (1.0, 0.5, 2.0, 0.05):
        got = fn(logits.clone(), t)
        require(_close(got.sum(), 1.0), name, f"at temperature {t} the probabilities sum to {float(got.sum()):.4f}, "
                "not 1: normalize by the sum of the exponentials")  # fmt: skip
        require(_close(got, torch.softmax(logits / t, -1)), name, f"wrong distribution at temperature {t}: "
                "divide the logits by the temperature *before* the softmax")  # fmt: skip
    big = torch.tensor([1000.0, 999.0, -1000.0])
    require(bool(torch.isfinite(fn(big, 1.0)).all()), name, "overflow on large logits: subtract the max first")
    passed(name, "matches softmax(logits / T) at T = 0.05, 0.5, 1, 2 and is stable on large logits")


def check_top_p(fn: Callable) -> None:
    """fn(probs (V,), p) -> the renormalized nucleus distribution (V,)."""
    name = "top-p filter"
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    cases = {0.5: [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], 0.4: [0, 1.0, 0, 0, 0], 0.01: [0, 1.0, 0, 0, 0],
             0.9: [0, 0.4 / 0.95, 0.1 / 0.95, 0.3 / 0.95, 0.15 / 0.95], 1.0: probs.tolist()}  # fmt: skip
    for p, want in cases.items():
        got = fn(probs.clone(), p)
        require(_close(got, want, atol=1e-6), name, f"with p={p} expected {[round(w, 3) for w in want]}, got "
                f"{[round(float(g), 3) for g in got]}: keep the most likely tokens until their mass reaches p "
                "(always at least one), zero the rest, renormalize")  # fmt: skip
    passed(name, "keeps the smallest set of tokens whose probability reaches p, for p in 0.01 ... 1")


def check_greedy_generate(fn: Callable, model, prompt: list[int], n: int = 12) -> None:
    """fn(model, prompt ids, n) -> the n greedy token ids, computed without a KV cache."""
    from .generate import generate

    name = "greedy generation loop"
    want = generate(model, prompt, n, eos_token_id=None).tokens[0].tolist()
    got = [int(t) for t in fn(model, list(prompt), n)]
    require(len(got) == n, name, f"expected {n} new tokens, got {len(got)}: return only the new ones")
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    require(first_bad is None, name, f"token {first_bad} differs from minillm.generate: at each step run the "
            "whole sequence so far, take the argmax of the *last* position's logits, append it")  # fmt: skip
    passed(name, f"{n} tokens identical to minillm.generate (greedy)")


def execute_in_place(paths: list[Path]) -> None:
    """``make execute``: re-run notebooks on this machine and save them with their outputs."""
    for path in paths:
        print(f"executing {path} ...", flush=True)
        nb = execute_notebook(read_notebook(path), cwd=path.parent)
        path.write_text(dump_notebook(nb), encoding="utf-8")


if __name__ == "__main__":  # python -m minillm.exercises [--execute NB ...] | [solutions exercises]
    args = sys.argv[1:]
    if args[:1] == ["--execute"]:
        execute_in_place([Path(a) for a in args[1:]])
    else:
        paths = write_exercises(*(Path(a) for a in args[:2]))
        print("\n".join(f"wrote {p}" for p in paths))
