"""The baseline revision's twobp, exported from git and imported next to this one."""

import shutil
import sys

import pytest

from twobp_bench.baseline import PACKAGE, export_baseline


@pytest.fixture
def exported():
    folder = export_baseline("HEAD")
    yield folder
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    shutil.rmtree(folder)


def test_the_baseline_imports_itself_under_its_own_name(exported, monkeypatch):
    package = exported / PACKAGE
    assert (package / "runtime" / "pipeline.py").is_file()
    assert sorted(p.name for p in exported.iterdir()) == [PACKAGE]
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "from twobp." not in text and "import twobp\n" not in text, path
    monkeypatch.syspath_prepend(str(exported))
    schedule = __import__(f"{PACKAGE}.schedule", fromlist=["generate"])
    assert schedule.generate.__module__.startswith(PACKAGE + ".")
    assert schedule.generate("1f1b", 2, 2).n_ranks == 2


def test_a_revision_git_does_not_know_is_refused_with_the_option():
    with pytest.raises(ValueError, match="--baseline: git cannot export src/twobp at 'no-such"):
        export_baseline("no-such-revision")
