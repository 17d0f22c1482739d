"""The metrics of a run, step by step: a JSONL file and TensorBoard event files.

Every ``--log-every`` steps (and at the last), rank 0 writes one record:

- ``OUT/metrics.jsonl``: one JSON object per line (see :class:`StepMetrics`);
  a number that is not finite (a skipped step's loss) is ``null``;
- ``OUT/tensorboard/``: the same figures as TensorBoard scalars, if the
  ``tensorboard`` package is installed (``pip install 'twobp[tensorboard]'``).

A resumed run continues both where its checkpoint stopped: records of later
steps (written by a run that went further before it was rolled back) are
dropped, from the JSONL file at once and from TensorBoard by its ``purge_step``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JSONL_FILE = "metrics.jsonl"
TENSORBOARD_FOLDER = "tensorboard"
_MIB = 1024 * 1024


@dataclass(frozen=True)
class StepMetrics:
    """The figures of one step; lists hold one entry per rank."""

    step: int
    """Steps done (1-based: the first step is 1)."""
    loss: float
    """The step's mean loss (NaN if it was not finite and the step was skipped)."""
    lr: float
    """The learning rate the step used."""
    grad_norm: float | None
    """The global gradient norm before clipping (None for a skipped step)."""
    samples_per_s: float
    """Samples per second over the steps since the previous record."""
    tokens_per_s: float | None
    """Tokens per second, likewise (None for images, which have no tokens)."""
    bubble: float
    """The step's measured bubble ratio, averaged over the ranks."""
    step_seconds: float
    """The step's wall time on rank 0, optimizer included."""
    peak_rss_bytes: list[int]
    """Each rank's peak resident memory so far."""
    peak_stash_bytes: list[int]
    """Each rank's peak bytes held for deferred weight gradients (2BP) so far."""
    peak_device_bytes: list[int] | None
    """Each rank's peak GPU memory allocated by torch so far (None on the CPU)."""


class MetricsLog:
    """Writes :class:`StepMetrics` records to ``out/metrics.jsonl`` and TensorBoard.

    Args:
        out: the run's output folder.
        resumed_from: steps done when this run started (0 for a fresh run);
            earlier records are kept, later ones dropped.
        tensorboard: write TensorBoard event files too, if tensorboard is installed.
    """

    def __init__(self, out: Path, resumed_from: int = 0, tensorboard: bool = True) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / JSONL_FILE
        _keep_records_until(self.path, resumed_from)
        self._file = self.path.open("a")
        self.tensorboard_missing = False
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.tensorboard_missing = True
            else:
                self._writer = SummaryWriter(
                    str(out / TENSORBOARD_FOLDER), purge_step=resumed_from + 1
                )

    def write(self, record: StepMetrics) -> None:
        """Append one record (flushed at once, so that ``tail -f`` shows it)."""
        values = {k: _finite_or_none(v) for k, v in dataclasses.asdict(record).items()}
        self._file.write(json.dumps(values, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for tag, value in _scalars(record):
                self._writer.add_scalar(tag, value, record.step)
            self._writer.flush()

    def close(self) -> None:
        """Close the files."""
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (empty if there is none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _keep_records_until(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (all of them for a fresh run)."""
    kept = [r for r in read_records(path) if r.get("step", math.inf) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def _scalars(record: StepMetrics) -> list[tuple[str, float]]:
    """The TensorBoard tags and values of a record (non-finite values left out)."""
    pairs: list[tuple[str, float | None]] = [
        ("loss/train", record.loss),
        ("optimizer/lr", record.lr),
        ("optimizer/grad_norm", record.grad_norm),
        ("throughput/samples_per_s", record.samples_per_s),
        ("throughput/tokens_per_s", record.tokens_per_s),
        ("pipeline/bubble", record.bubble),
        ("time/step_seconds", record.step_seconds),
    ]
    for name, per_rank in (
        ("peak_rss_mib", record.peak_rss_bytes),
        ("peak_stash_mib", record.peak_stash_bytes),
        ("peak_device_mib", record.peak_device_bytes or []),
    ):
        pairs += [(f"memory/{name}/rank{r}", b / _MIB) for r, b in enumerate(per_rank)]
    return [(tag, float(v)) for tag, v in pairs if v is not None and math.isfinite(v)]


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
