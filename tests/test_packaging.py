"""`pip install twobp` from its wheel, in a fresh virtual environment with only the CPU torch.

The wheel is built from a copy of the sources (no build folder of an earlier
build can slip in). The fresh environment sees twobp's dependencies, and
theirs, as this environment installed them (torch 2.13.0, as the Makefile
pins it), through links in a folder of their own: no index is needed and
nothing as large as torch is copied. pip installs the wheel there, finding
every dependency satisfied; ``twobp --version`` and the imports must work
there, and ``twobp bench`` must find its application. The test extra installs
what the tests need (setuptools, a pip with ``--python``); where they are
missing, the tests fail saying so instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import twobp

ROOT = Path(__file__).resolve().parents[1]


def _pip(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("setuptools is not installed: pip install -e '.[test]' installs it")
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("src", "tools"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    # The setuptools at hand, not one fetched into an isolated build environment.
    done = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source))
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("twobp-*.whl")
    return built


def test_the_wheel_holds_the_library_and_the_bench_application(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name == f"twobp-{twobp.__version__}-py3-none-any.whl"
    assert "twobp/py.typed" in names and "twobp/cli/main.py" in names
    assert "twobp_bench/cli.py" in names
    # Every module, those of sub-packages too (the build config finds the packages).
    sources = {
        path.relative_to(ROOT / top).as_posix()
        for top in ("src", "tools")
        for path in (ROOT / top).rglob("*.py")
    }
    missing = sorted(sources - set(names))
    assert not missing, f"the wheel lacks {len(missing)} modules: {missing[:5]}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    for extra in ("tensorboard", "test", "dev"):
        assert f"Provides-Extra: {extra}" in text
    assert 'Requires-Dist: tomli>=1.1; python_version < "3.11"' in text


def _wheel_requirements(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of the wheel's metadata."""
    import email
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    return email.message_from_string(text).get_all("Requires-Dist") or []


def _link_dependencies(requirements: list[str], folder: Path) -> set[str]:
    """Links in ``folder`` to the installed distributions ``requirements`` name (those
    this Python needs, without extras), and to theirs; the names of those linked."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    folder.mkdir()
    done: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name in done or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            found = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{requirement} is not installed here: pip install -e '.[test]'")
        assert requirement.specifier.contains(found.version, prereleases=True), requirement
        done.add(name)
        for top in {
            f.parts[0] for f in found.files or () if f.parts[0] not in ("..", "__pycache__")
        }:
            if not (folder / top).exists():
                (folder / top).symlink_to(Path(str(found.locate_file(top))))
        todo += found.requires or []
    return done


def test_pip_install_in_a_fresh_venv_gives_a_working_twobp(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    linked = _link_dependencies(_wheel_requirements(wheel), tmp_path / "dependencies")
    assert {"torch", "numpy", "matplotlib", "tqdm"} <= linked
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / "lib" / version / "site-packages"
    (site / "dependencies.pth").write_text(f"{tmp_path / 'dependencies'}\n")
    # This interpreter's pip installs into the fresh environment (pip --python); no
    # byte-compiling keeps the test short.
    target = ["--python", str(python), "install", "--no-compile", "--no-index"]
    done = _pip(*target, str(wheel))
    if done.returncode != 0 and "no such option: --python" in done.stderr:
        pytest.fail("this pip is older than 22.3 (no --python): pip install -e '.[test]'")
    assert done.returncode == 0, done.stderr[-3000:]
    # Only what the wheel installed: no PYTHONPATH of the process running the tests.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    version = subprocess.run(
        [venv / "bin" / "twobp", "--version"], capture_output=True, text=True, check=True, env=env
    )
    assert version.stdout.strip() == f"twobp {twobp.__version__}"
    code = (
        "import importlib.util, twobp, twobp.schedule, torch;"
        "print(twobp.__file__, torch.__version__, importlib.util.find_spec('twobp_bench.cli'))"
    )
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True, env=env
    )
    where, torch_version, bench = done.stdout.split(maxsplit=2)
    assert Path(where).is_relative_to(venv) and torch_version.startswith("2.13.0")
    assert bench != "None"
