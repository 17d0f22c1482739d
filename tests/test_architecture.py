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
    "integrations": set(),
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
    "cli": {"train", "runtime", "engine", "partition", "models", "sim", "schedule", "config"},
}
ANYWHERE = {"viz", "timeline"}
NO_TORCH = ("twobp.schedule", "twobp.sim", "twobp.viz", "twobp.timeline")


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
