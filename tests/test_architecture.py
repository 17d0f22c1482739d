"""The layers of docs/architecture.md: which folder imports which, and which import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "twobp"

# What each folder may import of the others (docs/architecture.md); viz and timeline anywhere.
ALLOWED = {
    "schedule": set(),
    "sim": {"schedule", "partition"},
    "viz": {"schedule"},
    "partition": {"engine"},
    "engine": set(),
    "models": set(),
    # A Hugging Face export reads a pipeline's checkpoint (integrations/hf_export.py).
    "integrations": {"runtime"},
    "cut": set(),
    "runtime": {"engine", "partition", "models", "sim", "schedule"},
    "train": {
        "runtime",
        "engine",
        "partition",
        "models",
        "integrations",
        "sim",
        "schedule",
        "config",
    },
    "cli": {
        "train",
        "runtime",
        "engine",
        "partition",
        "models",
        "integrations",
        "sim",
        "schedule",
        "config",
    },
}
ANYWHERE = {"viz", "timeline"}
NO_TORCH = ("twobp.schedule", "twobp.sim", "twobp.viz", "twobp.timeline")

# The floors of runtime/, bottom first (docs/architecture.md): a folder or top-level module
# imports only from its own floor and those below it.
RUNTIME_FLOORS = (
    {"errors", "options"},
    {"base"},
    {"communication"},
    {"execution"},
    {"state"},
    {"setup"},
    {"pipeline", "launch", "__init__"},
)
RUNTIME = SRC / "runtime"


def _imported_layers(folder: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "twobp" and len(parts) > 1:
                    found.setdefault(parts[1], set()).add(str(path.relative_to(SRC)))
                if parts[0] == "twobp_bench":
                    found.setdefault("twobp_bench", set()).add(str(path.relative_to(SRC)))
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    imported = _imported_layers(SRC / layer)
    wrong = {
        other: files
        for other, files in imported.items()
        if other != layer and other not in ALLOWED[layer] | ANYWHERE
    }
    if layer == "cli":
        # `twobp bench` runs the application that lives outside the library, loaded lazily.
        assert wrong.pop("twobp_bench", set()) <= {"cli/bench.py"}
    assert not wrong, f"{layer}/ imports {wrong}"


def _runtime_part(path: Path) -> str:
    """The folder or top-level module of runtime/ that ``path`` belongs to."""
    first = path.relative_to(RUNTIME).parts[0]
    return first.removesuffix(".py")


def _runtime_imports(path: Path) -> set[str]:
    """The parts of runtime/ that the module at ``path`` imports, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "twobp.runtime":
                names = [f"twobp.runtime.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["twobp", "runtime"] and len(parts) > 2:
                found.add(parts[2])
    return found


def _floor(part: str) -> int:
    return next(i for i, floor in enumerate(RUNTIME_FLOORS) if part in floor)


def test_every_part_of_the_runtime_has_a_floor():
    parts = {_runtime_part(p) for p in RUNTIME.rglob("*.py")}
    placed = set().union(*RUNTIME_FLOORS)
    assert parts <= placed, f"runtime/ parts without a floor: {sorted(parts - placed)}"


@pytest.mark.parametrize(
    "path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME))
)
def test_the_runtime_imports_nothing_from_a_floor_above(path):
    part = _runtime_part(path)
    upward = sorted(o for o in _runtime_imports(path) if _floor(o) > _floor(part))
    assert not upward, f"runtime/{path.relative_to(RUNTIME)} ({part}) imports {upward} from above"


def test_the_options_take_nothing_from_the_runtime_but_its_errors():
    # The vocabulary every floor hands down: it must not reach up for a type or a marker.
    assert _runtime_imports(RUNTIME / "options.py") <= {"errors"}


def test_pipeline_is_not_built_inside_the_setup():
    # Planning and building a rank's parts never build a whole Pipeline of their own.
    users = sorted(
        str(p.relative_to(RUNTIME))
        for p in (RUNTIME / "setup").rglob("*.py")
        if "pipeline" in _runtime_imports(p)
    )
    assert not users, users


def _says_no_torch() -> list[str]:
    """Every module whose docstring says it imports no torch."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "imports no torch" in " ".join(doc.split()):
            parts = path.relative_to(SRC.parent).with_suffix("").parts
            found.append(".".join(p for p in parts if p != "__init__"))
    return found


@pytest.mark.parametrize("module", sorted({*NO_TORCH, *_says_no_torch()}))
def test_the_pure_layers_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", f"importing {module} pulls in torch"


@pytest.mark.parametrize(
    "path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME))
)
def test_no_function_of_the_runtime_runs_over_80_lines(path):
    # A function that reads in one screen; a longer one is several steps to name.
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, f"runtime/{path.relative_to(RUNTIME)}: {long}"


def test_the_facade_stays_thin():
    assert len((RUNTIME / "pipeline.py").read_text().splitlines()) < 600


def _importers(name: str) -> set[str]:
    """The modules of src/twobp that import ``name`` (a module, or ``module.attribute``)."""
    module, _, attribute = name.rpartition(".")
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            direct = isinstance(node, ast.Import) and any(a.name == name for a in node.names)
            from_module = isinstance(node, ast.ImportFrom) and node.module == name
            from_attribute = (
                isinstance(node, ast.ImportFrom)
                and node.module == module
                and any(a.name == attribute for a in node.names)
            )
            if direct or from_module or from_attribute:
                found.add(str(path.relative_to(SRC)))
    return found


def test_one_module_defines_the_search():
    # Every choice among simulated options (schedule="auto", twobp plan, the stages
    # two_bp=None splits, what recompute="auto" rebuilds) goes through twobp.sim.search:
    # only it simulates an option, and the simulator itself is imported only where one
    # given schedule is timed (a candidate, its rebuilds, its steady state, the CLI).
    points = {"twobp.sim.candidate.simulate_candidate", "twobp.sim.candidate.simulate_prepared"}
    for point in points:
        assert _importers(point) <= {"sim/search.py"}, point
    simulator = _importers("twobp.sim.simulate") | _importers("twobp.sim.simulate.simulate")
    assert simulator <= {
        "sim/__init__.py",
        "sim/candidate.py",
        "sim/rebuild.py",
        "sim/steady.py",
        "cli/simulate.py",
    }, simulator
    views = {"sim/planner.py", "sim/split_choice.py", "sim/rebuild_choice.py"}
    for view in views:
        assert view in _importers("twobp.sim.search"), view
