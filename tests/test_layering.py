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

# The layers, lowest first. A subpackage may import only subpackages of lower layers: the
# techniques of one layer (kv, compression, decoding, parallel) never import each other.
LAYERS = (
    ("kernels",),
    ("core",),
    ("measure", "training"),
    ("kv", "compression", "decoding", "parallel"),
    ("runtime",),
    ("serving", "export"),
    ("bench", "viz"),
    ("book", "cli"),
)
# Subpackage -> the minillm subpackages it imports (besides itself): exactly the graph the code
# has (a test fails on an edge missing here and on one listed here that no import makes).
ALLOWED = {
    "kernels": set(),
    "core": {"kernels"},
    "measure": {"core"},
    "training": {"core"},
    "kv": {"core", "training"},
    "compression": {"core", "kernels", "training"},
    "decoding": {"core", "training"},
    "parallel": {"core", "measure"},
    "runtime": {"core", "compression"},
    "serving": {"core", "decoding", "kernels", "kv", "measure", "parallel", "runtime"},
    "export": {"core", "compression", "runtime"},
    "bench": {
        "core",
        "kernels",
        "measure",
        "training",
        "kv",
        "compression",
        "decoding",
        "parallel",
        "runtime",
        "serving",
        "export",
    },
    "viz": {"core", "measure", "kv", "decoding", "parallel", "serving"},
    "book": {"core", "measure", "kv", "compression", "decoding", "viz"},
    "cli": {
        "core",
        "measure",
        "training",
        "kv",
        "compression",
        "decoding",
        "parallel",
        "runtime",
        "serving",
        "export",
        "bench",
    },
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
    return {module_name(p) for p in sources(PACKAGE)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (only names that are modules)."""
    known = known_modules()
    graph = {}
    for path in sources(PACKAGE):
        graph[module_name(path)] = {m for m, _ in imports(path) if m in known and m != module_name(path)}
    return graph


def violations(path: Path) -> list[str]:
    """What the rules forbid in one file, as readable lines."""
    me = module_name(path)
    layer = subpackage(me)
    found = []
    for target, line in imports(path):
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        if layer == "kernels" and target.split(".")[0] == "minillm" and subpackage(target) != "kernels":
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


def layer_of(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def order_violations(allowed: dict[str, set[str]]) -> list[str]:
    """Each permitted edge that does not point to a strictly lower layer."""
    return [
        f"{name} imports {other}: {other} is not in a layer below {name}'s"
        for name, targets in sorted(allowed.items())
        for other in sorted(targets)
        if layer_of(other) >= layer_of(name)
    ]


def subpackage_graph() -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its modules import, read from the source."""
    graph: dict[str, set[str]] = {name: set() for name in ALLOWED}
    for path in sources(PACKAGE):
        me = subpackage(module_name(path))
        if me is not None:
            graph.setdefault(me, set()).update(
                t for t in (subpackage(m) for m, _ in imports(path)) if t not in (None, me)
            )
    return graph


def test_every_subpackage_has_a_rule_and_a_layer():
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert on_disk == set(ALLOWED), f"layering rules for {sorted(on_disk ^ set(ALLOWED))}"
    assert sorted(n for layer in LAYERS for n in layer) == sorted(ALLOWED)
    assert order_violations(ALLOWED) == []


def test_the_allow_list_is_exactly_the_import_graph():
    """No permission that no import uses: the list describes the code, not a wish."""
    assert subpackage_graph() == ALLOWED


@pytest.mark.parametrize("path", sources(PACKAGE), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    assert violations(path) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_subpackages():
    assert cycles(subpackage_graph()) == []


def test_importing_minillm_loads_only_the_lower_layers():
    """``import minillm`` (the public API: load, generate, the model and the caches) imports core,
    kv and the runtime, and through them no technique the runtime imports only when asked
    (compression), so a user of the library never pays for compression, serving, benchmarks,
    plots or the book (checked in a fresh interpreter)."""
    top_level = ast.parse((PACKAGE / "__init__.py").read_text()).body
    modules = {f"minillm.{n.module}" for n in top_level if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert {subpackage(m) for m in modules} - {None} <= {"core", "kv", "runtime"}
    code = "import sys, minillm; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('minillm.')}))"
    code += "\nassert minillm.quantize.__module__.startswith('minillm.compression') and minillm.LLM.__name__ == 'LLM'"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    assert set(ast.literal_eval(loaded.stdout.strip())) <= {"core", "kv", "training", "measure", "runtime"}


def test_the_shared_cli_module_imports_only_core():
    """minillm/cli/common.py (errors, the parser, devices) is what every command shares: it imports
    core only, so that building the parser costs no technique."""
    targets = {subpackage(m) for m, _ in imports(PACKAGE / "cli" / "common.py")} - {None, "cli"}
    assert targets <= {"core"}


def test_the_command_line_imports_no_technique_until_a_handler_runs():
    """``python -m minillm models`` (the parser, every command's options, one handler) loads no
    compression, parallel, serving, runtime or bench module (checked in a fresh interpreter)."""
    code = (
        "import sys, contextlib, io\n"
        "from minillm.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['models'])\n"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('minillm.')}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    layers = set(ast.literal_eval(loaded.stdout.strip().splitlines()[-1]))
    # what ``import minillm`` loads (core, kv's caches, the runtime's entry) and the handler's table printer
    assert layers <= {"cli", "core", "kernels", "kv", "measure", "runtime", "training"}, layers


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The checks can fail: a kernel that imports minillm, core importing a higher layer, a plot
    outside viz, an upward or sideways edge in the allow-list, and a two-module circle are each
    reported."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "minillm")
    files = {
        "minillm/kernels/__init__.py": "",
        "minillm/kernels/k.py": "from minillm import load\nfrom .other import x\n",
        "minillm/core/__init__.py": "",
        "minillm/core/a.py": "from ..bench import timing\nimport matplotlib.pyplot as plt\n",
        "minillm/bench/__init__.py": "",
        "minillm/bench/timing.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    leaf = violations(tmp_path / "minillm/kernels/k.py")
    assert leaf and all("imports minillm:" in v or "imports minillm.load:" in v for v in leaf)  # not .other
    assert all("kernels/ is a leaf" in v for v in leaf)
    found = violations(tmp_path / "minillm/core/a.py")
    assert any("core may import only ['kernels']" in v for v in found)
    assert any("plotting belongs in minillm.viz" in v for v in found)
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    upward = order_violations({**ALLOWED, "core": {"serving"}, "kv": {"decoding"}})
    assert upward == [
        "core imports serving: serving is not in a layer below core's",
        "kv imports decoding: decoding is not in a layer below kv's",
    ]


def test_the_rule_is_stated_in_the_package_docstring():
    doc = minillm.__doc__ or ""
    for name in ALLOWED:
        assert f"{name}/" in doc, f"minillm/__init__.py's docstring does not describe {name}/"
