"""The package's layers, read from the source (every import statement, also those inside
functions): lower layers never import higher ones, ``kernels`` is a leaf, only the benchmark and
book layers reach the benchmarks and plots, matplotlib lives in ``viz`` alone, and no two
modules or subpackages import each other round a circle. ``minillm/__init__.py`` states the rule
in prose; this test holds the line."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import minillm

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minillm"
KERNELS = ROOT / "kernels"

# Subpackage -> the minillm subpackages it may import (besides itself). The order of the layers,
# lowest first: core; training, measure; kv; decoding, serving, compression, parallel; viz, bench; book.
ALLOWED = {
    "core": set(),
    "training": {"core"},
    "measure": {"core"},
    "kv": {"core", "training", "measure"},
    "decoding": {"core", "kv", "training", "measure"},
    "serving": {"core", "kv", "measure"},
    "compression": {"core", "kv", "training", "measure"},
    "parallel": {"core", "kv", "measure", "serving"},
    "viz": {"core", "kv", "measure", "decoding", "serving", "compression", "parallel"},
    "bench": {"core", "kv", "training", "measure", "decoding", "serving", "compression", "parallel", "viz"},
    "book": {"core", "kv", "training", "measure", "decoding", "serving", "compression", "parallel", "viz", "bench"},
}
PLOTTING = ("matplotlib", "ipywidgets")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every module an import statement in ``path`` names (relative ones resolved), with its line.
    ``from pkg import name`` yields ``pkg.name`` too, since the name may be a submodule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield source, node.lineno
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def sources(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def subpackage(module: str) -> str | None:
    """``minillm.kv.paged`` -> ``kv``; the package's top-level modules (__init__, __main__) -> None."""
    parts = module.split(".")
    if parts[0] != "minillm" or len(parts) < 2:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else None


def known_modules() -> set[str]:
    return {module_name(p) for p in sources(PACKAGE)} | {module_name(p) for p in sources(KERNELS)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (only names that are modules)."""
    known = known_modules()
    graph = {}
    for path in sources(PACKAGE) + sources(KERNELS):
        graph[module_name(path)] = {m for m, _ in imports(path) if m in known and m != module_name(path)}
    return graph


def violations(path: Path) -> list[str]:
    """What the rules forbid in one file, as readable lines."""
    me = module_name(path)
    layer = subpackage(me)
    found = []
    for target, line in imports(path):
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        if me.startswith("kernels") and target.split(".")[0] == "minillm":
            found.append(f"{where}: kernels/ is a leaf (torch and triton only)")
        if target.split(".")[0] in PLOTTING and layer != "viz":
            found.append(f"{where}: plotting belongs in minillm.viz")
        other = subpackage(target)
        if layer is None or other is None or other == layer:
            continue
        if other not in ALLOWED[layer]:
            found.append(f"{where}: {layer} may import only {sorted(ALLOWED[layer]) or 'nothing of minillm'}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_subpackage_has_a_rule():
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert on_disk <= set(ALLOWED), f"add a layering rule for {sorted(on_disk - set(ALLOWED))}"
    for name, allowed in ALLOWED.items():
        assert name not in allowed and allowed <= set(ALLOWED)


@pytest.mark.parametrize("path", sources(PACKAGE) + sources(KERNELS), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    assert violations(path) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        me = subpackage(module)
        if me is not None:
            graph.setdefault(me, set()).update(t for t in map(subpackage, targets) if t not in (None, me))
    assert cycles(graph) == []


def test_importing_minillm_loads_only_the_lower_layers():
    """``import minillm`` (the public API: load, generate, the model and the caches) imports core
    and kv, and through them nothing above kv, so a user of the library never pays for
    benchmarks, plots or the book (checked in a fresh interpreter)."""
    targets = {subpackage(m) for m, _ in imports(PACKAGE / "__init__.py")} - {None}
    assert targets <= {"core", "kv"}
    code = "import sys, minillm; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('minillm.')}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    assert set(ast.literal_eval(loaded.stdout.strip())) <= {"core", "kv", "training", "measure"}


def test_the_shared_cli_module_imports_only_core():
    """minillm/cli.py (errors, the parser, devices) sits under both command lines: it may import
    core only, so that a layer below bench can never reach bench through it."""
    targets = {subpackage(m) for m, _ in imports(PACKAGE / "cli.py")} - {None}
    assert targets <= {"core"}


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The checks can fail: a kernel that imports minillm, core importing a higher layer, a plot
    outside viz, and a two-module circle are each reported."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "minillm")
    files = {
        "kernels/k.py": "from minillm import load\n",
        "minillm/core/__init__.py": "",
        "minillm/core/a.py": "from ..bench import timing\nimport matplotlib.pyplot as plt\n",
        "minillm/bench/__init__.py": "",
        "minillm/bench/timing.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert any("kernels/ is a leaf" in v for v in violations(tmp_path / "kernels/k.py"))
    found = violations(tmp_path / "minillm/core/a.py")
    assert any("core may import only nothing of minillm" in v for v in found)
    assert any("plotting belongs in minillm.viz" in v for v in found)
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_rule_is_stated_in_the_package_docstring():
    doc = minillm.__doc__ or ""
    for name in ALLOWED:
        assert f"{name}/" in doc, f"minillm/__init__.py's docstring does not describe {name}/"
