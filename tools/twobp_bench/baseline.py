"""The twobp of another git revision, importable next to this one as ``twobp_baseline``.

``twobp bench --baseline REV`` runs every twobp variant on both, in the same
rounds: a before/after comparison that the machine's load cannot skew, as
both sides of each ratio ran next to each other.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "twobp_baseline"
"""The name the baseline revision's twobp is imported under."""

_NAME = re.compile(r"\btwobp\b")
"""The word ``twobp`` (imports, module paths in strings; not ``twobp_bench``)."""


def export_baseline(revision: str) -> Path:
    """Copy ``src/twobp`` of git ``revision`` into a new temporary folder as :data:`PACKAGE`.

    Args:
        revision: anything ``git archive`` takes (a commit, a tag, ``HEAD~3``).

    Returns:
        The folder to put on ``sys.path`` (the caller removes it).

    Raises:
        ValueError: if this package is not in a git checkout, or git cannot
            export ``src/twobp`` at ``revision``.
    """
    here = Path(__file__).resolve().parent
    root = _git(here, "rev-parse", "--show-toplevel").decode().strip()
    archive = _git(Path(root), "archive", revision, "src/twobp", revision=revision)
    folder = Path(tempfile.mkdtemp(prefix="twobp-baseline-"))
    try:
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        package = folder / PACKAGE
        shutil.move(str(folder / "src" / "twobp"), package)
        shutil.rmtree(folder / "src")
        for path in package.rglob("*.py"):
            path.write_text(_NAME.sub(PACKAGE, path.read_text()))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _git(where: Path, *args: str, revision: str | None = None) -> bytes:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (
            exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        )
        what = f"src/twobp at {revision!r}" if revision else "the repository of the bench"
        raise ValueError(
            f"--baseline: git cannot export {what} ({detail}); run the bench from a "
            "checkout of the repository and give a revision git knows"
        ) from exc
    return done.stdout
