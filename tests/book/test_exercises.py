"""The exercise machinery: exercises/ is generated from solutions/, every solution passes its
checks (the notebooks themselves run under nbval), and every exercise's check fails without its
solution. The checkers also reject plausible wrong answers."""

import ast
from pathlib import Path

import pytest
import torch

from minillm.book import checks, nbfiles
from minillm.book import exercises as ex
from minillm.core.sampling import SamplingParams, probabilities

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_there_are_exercises_for_every_chapter():
    chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    assert chapters and chapters == {p.name for p in SOLUTIONS}


def test_exercises_are_in_sync_with_solutions(tmp_path):
    written = ex.write_exercises(ROOT / "solutions", tmp_path)
    assert {p.name for p in written} == {p.name for p in (ROOT / "exercises").glob("*.ipynb")}
    for path in written:
        committed = (ROOT / "exercises" / path.name).read_text(encoding="utf-8")
        assert path.read_text(encoding="utf-8") == committed, f"run `make exercises`: {path.name} is stale"


def test_stubs_replace_regions_and_keep_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n\nprint(f)\n"
    stub = 'raise NotImplementedError("write the body of f()")'
    assert ex.stub_source(src) == f"def f(x):\n    {stub}\n\nprint(f)\n"
    two = src + src.replace("f(", "g(")
    assert ex.count_regions(two) == 2
    assert ex.stub_source(two, only=1).count("NotImplementedError") == 1 and "return y" in ex.stub_source(two, only=1)
    assert "write the body of g()" in ex.stub_source(two, only=1)


def test_a_stub_says_what_to_implement():
    """The hint after ``### BEGIN SOLUTION:`` becomes the stub's message; it runs and says it."""
    src = "def f(x):\n    ### BEGIN SOLUTION: add one to x\n    return x + 1\n    ### END SOLUTION\n"
    namespace: dict = {}
    exec(ex.stub_source(src), namespace)
    with pytest.raises(NotImplementedError, match="^add one to x$"):
        namespace["f"](1)
    assert ex.stub_source("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n") == (
        'raise NotImplementedError("write the code this exercise asks for")\n'
    )


def _stub_messages(source: str) -> list:
    """The argument of every ``raise NotImplementedError(...)`` in a cell (a magic line read as a pass)."""
    code = nbfiles.python_source({"source": source})
    raises = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
    return [n.exc.args for n in raises if getattr(n.exc.func, "id", "") == "NotImplementedError"]


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_stub_in_the_exercises_names_what_to_implement(path):
    code = [c for c in nbfiles.read_notebook(ROOT / "exercises" / path.name)["cells"] if c["cell_type"] == "code"]
    stubs = [args for cell in code for args in _stub_messages(nbfiles.cell_source(cell))]
    assert len(stubs) == _regions(nbfiles.read_notebook(path)), f"{path.name}: one stub per solution region"
    for args in stubs:
        assert len(args) == 1 and isinstance(args[0], ast.Constant), f"{path.name}: a stub raises with one message"
        message = args[0].value
        assert len(message) > 10, f"{path.name}: the stub's message is too short to say anything: {message!r}"
        assert "write the body of" not in message, f"{path.name}: give this region a hint (### BEGIN SOLUTION: ...)"


def test_a_long_hint_wraps_to_the_page_and_reads_back_whole():
    hint = "take the target argmax per row, count the proposals matching it, and return the next argmax " * 2
    source = f"def f():\n    ### BEGIN SOLUTION: {hint[:60]}\n    ### {hint[60:]}\n    return 1\n    ### END SOLUTION\n"
    stub = ex.stub_source(source)
    assert all(len(line) <= ex.PAGE_WIDTH for line in stub.splitlines()), stub
    (args,) = _stub_messages(stub)
    assert args[0].value == " ".join([hint[:60].strip(), hint[60:].strip()])


def _regions(nb) -> int:
    return sum(ex.count_regions(nbfiles.cell_source(c)) for c in nb["cells"] if c["cell_type"] == "code")


CASES = [(p, i) for p in SOLUTIONS for i in range(_regions(nbfiles.read_notebook(p)))]
_RUNS: dict[Path, ex.SolutionRun] = {}


def solution_run(path: Path) -> ex.SolutionRun:
    """The notebook's one in-process run, shared by its tests (one worker runs this file)."""
    if path not in _RUNS:
        _RUNS[path] = ex.run_solution(nbfiles.read_notebook(path), cwd=path.parent)
    return _RUNS[path]


def _code_cells(path: Path) -> int:
    return sum(1 for c in nbfiles.read_notebook(path)["cells"] if c["cell_type"] == "code")


CELLS = [(p, i) for p in SOLUTIONS for i in range(_code_cells(p))]


@pytest.mark.slow
@pytest.mark.parametrize("path, cell", CELLS, ids=[f"{p.stem}-cell{i}" for p, i in CELLS])
def test_every_solution_cell_runs_and_prints_its_committed_output(path, cell):
    """The solved notebook runs cell by cell (every check cell prints its pass line), and its
    checked cells print what the committed notebook shows: the solutions' one execution in this
    suite, in-process, reported per cell as nbval would."""
    run = solution_run(path)
    assert run.code_cells == _code_cells(path) and len(run.stubbed) == _regions(nbfiles.read_notebook(path))
    assert cell not in run.failures, f"{path.name}, code cell {cell}: {run.failures[cell]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, region",
    CASES,
    ids=[f"{p.stem}-{i}" for p, i in CASES],
)
def test_each_check_fails_without_its_solution(path, region):
    """Stub one exercise, keep the others solved: running the notebook on must fail, with the
    stub's NotImplementedError or the checker's CheckFailed."""
    error = solution_run(path).stubbed[region]
    assert error is not None, f"{path.name}: region {region} stubbed, the notebook still ran to the end"
    # Triton's interpreter wraps what a kernel raises: the stub's error is named in its message
    named = isinstance(error, (NotImplementedError, checks.CheckFailed)) or "NotImplementedError(" in str(error)
    assert named, f"{path.name}: {error!r}"


def test_a_stubbed_run_reports_each_region_and_a_check_that_cannot_fail(tmp_path):
    """The in-process runner on a crafted notebook: a region whose check catches the stub, one
    with no check at all (reported as None), and a checked cell whose output drifted."""
    import nbformat

    cells = [
        "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
        "assert double(2) == 4\nprint('double: ok')",
        "def unused():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
        "print(double(21))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.cells[3].metadata["tags"] = [ex.CHECK_TAG]
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="41\n")]
    run = ex.run_solution(nb, cwd=tmp_path)
    assert isinstance(run.stubbed[0], NotImplementedError) and run.stubbed[1] is None
    assert run.failures == {3: "printed '42\\n', committed '41\\n'"} and run.code_cells == 4
    nb.cells.append(nbformat.v4.new_code_cell("1 / 0"))  # a failing cell is reported, as nbval would
    run = ex.run_solution(nb, cwd=tmp_path)
    assert run.failures[4] == "raised ZeroDivisionError: division by zero" and run.code_cells == 5


def test_checkers_reject_plausible_wrong_answers():
    with pytest.raises(checks.CheckFailed, match="temperature"):
        checks.check_softmax_with_temperature(lambda logits, t: torch.softmax(logits, -1))  # ignores T
    with pytest.raises(checks.CheckFailed, match="overflow"):
        checks.check_softmax_with_temperature(lambda logits, t: torch.exp(logits / t) / torch.exp(logits / t).sum())

    def top_p_without_renormalizing(probs, p):
        keep = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=p)) > 0
        return probs * keep

    with pytest.raises(checks.CheckFailed, match="top-p"):
        checks.check_top_p(top_p_without_renormalizing)

    def top_p_right(probs, p):
        return probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=p))

    checks.check_top_p(top_p_right)  # the library's own filter passes


def test_greedy_checker_rejects_a_loop_that_reads_the_wrong_position():
    from tests.conftest import tiny_model

    model = tiny_model()

    @torch.inference_mode()
    def first_position_argmax(model, ids, n):
        out = list(ids)
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, 0].argmax()))
        return out[len(ids) :]

    with pytest.raises(checks.CheckFailed, match="last"):
        checks.check_greedy_generate(first_position_argmax, model, [1, 2, 3])


def test_a_cell_tagged_remove_stderr_is_saved_without_it():
    out = [
        {"output_type": "stream", "name": "stderr", "text": "debug"},
        {"output_type": "stream", "name": "stdout", "text": "ok"},
    ]
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {"tags": ["remove-stderr"]}, "outputs": list(out)},
            {"cell_type": "code", "metadata": {}, "outputs": list(out)},
        ]
    }
    ex.drop_tagged_stderr(nb)
    assert [o["name"] for o in nb["cells"][0]["outputs"]] == ["stdout"]
    assert len(nb["cells"][1]["outputs"]) == 2
