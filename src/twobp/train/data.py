"""Data that every machine has: real text for language models, labelled synthetic data else.

Batches are a pure function of ``(seed, step)``: any rank can draw the batch of
any step without talking to the others, and a resumed run sees exactly the data
an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Cap on the bytes read from the standard library: plenty for a tiny model, and
# reading stays well under a second.
DEFAULT_CORPUS_BYTES = 4_000_000
# The least text a --data file must hold, however short the sequences.
MIN_FILE_BYTES = 1024


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[bytes, str]:
    """Concatenated source of the Python standard library's top-level modules.

    Returns:
        The bytes and a description of where they came from.

    Raises:
        FileNotFoundError: if the standard library's sources are not installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no Python sources under {root}; pass a text file with --data FILE"
        )
    chunks: list[bytes] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)[:max_bytes], f"Python standard library sources in {root}"


def file_corpus(path: str | Path, seq_len: int) -> tuple[bytes, str]:
    """The bytes of a user-given text file.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is too short for sequences of ``seq_len`` bytes.
    """
    p = check_text_file(path, seq_len)
    data = p.read_bytes()
    return data, f"{p} ({len(data):,} bytes)"


def check_text_file(path: str | Path, seq_len: int) -> Path:
    """Check, without reading it, that a ``--data`` file can feed sequences of ``seq_len`` bytes.

    Returns:
        The path.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is too short (see :meth:`ByteLMData.min_bytes`).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {p}: no such file; pass a text file or omit --data")
    size = p.stat().st_size
    need = max(MIN_FILE_BYTES, ByteLMData.min_bytes(seq_len))
    if size < need:
        raise ValueError(
            f"--data {p} has {size:,} bytes; sequences of {seq_len} bytes need at least "
            f"{need:,} (a twentieth is held out for evaluation): give a longer text or a "
            "smaller --seq-len"
        )
    return p


@dataclass(frozen=True)
class ByteLMData:
    """A byte-level language-modelling stream: sequences of bytes and their next bytes.

    The last ``eval_fraction`` of the corpus is held out for evaluation.
    """

    tokens: torch.Tensor
    """All bytes of the corpus as int64 token ids in [0, 256)."""
    seq_len: int
    """Tokens per training sequence."""
    source: str
    """Where the text came from, for the report."""
    eval_fraction: float = 0.05
    """Share of the corpus held out for evaluation."""

    @classmethod
    def min_bytes(cls, seq_len: int) -> int:
        """The shortest corpus whose held-out part still holds one sequence and its targets."""
        return math.ceil((seq_len + 2) / cls.eval_fraction) + 1

    @classmethod
    def from_bytes(cls, data: bytes, seq_len: int, source: str) -> ByteLMData:
        """Wrap raw bytes (at least :meth:`min_bytes` long).

        Raises:
            ValueError: if the corpus is too short.
        """
        if len(data) < cls.min_bytes(seq_len):
            raise ValueError(
                f"corpus of {len(data)} bytes is too short for sequences of {seq_len} tokens; "
                f"give at least {cls.min_bytes(seq_len)} bytes"
            )
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        return cls(tokens, seq_len, source)

    @property
    def _split(self) -> int:
        return int(len(self.tokens) * (1.0 - self.eval_fraction))

    def batch(
        self,
        step: int,
        batch_size: int,
        seed: int,
        *,
        split: str = "train",
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``(batch_size, seq_len)``, for ``step``
        (``seq_len``: at most :attr:`seq_len`; None: it)."""
        length = self.seq_len if seq_len is None else min(seq_len, self.seq_len)
        lo, hi = (0, self._split) if split == "train" else (self._split, len(self.tokens))
        gen = torch.Generator().manual_seed(_mix(seed, step, split))
        starts = torch.randint(lo, hi - self.seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(length + 1)
        window = self.tokens[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _mix(seed: int, step: int, split: str) -> int:
    # A cheap, stable mix so that neighbouring steps get unrelated streams.
    salt = 0 if split == "train" else 0x5BD1E995
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**63 - 1)


@dataclass(frozen=True)
class SyntheticData:
    """Labelled synthetic data for the families that have no offline corpus.

    Batches are drawn from a fixed random "teacher" so there is something to
    learn: each image class is a fixed smooth random pattern under noise; token
    streams follow a fixed random bigram table.
    """

    kind: str
    """``"images"`` or ``"tokens"``."""
    shape: Sequence[int]
    """Shape of one sample (``(C, H, W)`` for images, ``(seq_len,)`` for tokens)."""
    n_classes: int
    """Classes for images, vocabulary size for tokens."""
    source: str = "synthetic"
    """Label for the report."""

    def batch(
        self, step: int, batch_size: int, seed: int, *, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for ``step``."""
        teacher = torch.Generator().manual_seed(seed)
        gen = torch.Generator().manual_seed(_mix(seed, step, split))
        if self.kind == "images":
            # Each class has a smooth random template (a 4x4 pattern scaled up);
            # an image is its class's template under as much noise again.
            channels, height, width = self.shape
            coarse = torch.randn(self.n_classes, channels, 4, 4, generator=teacher)
            templates = torch.nn.functional.interpolate(
                coarse, size=(height, width), mode="bilinear", align_corners=False
            )
            labels = torch.randint(0, self.n_classes, (batch_size,), generator=gen)
            noise = torch.randn(batch_size, channels, height, width, generator=gen)
            return templates[labels] + noise, labels
        # Tokens: a sparse random bigram chain (each token has 4 likely successors).
        (seq_len,) = self.shape
        successors = torch.randint(0, self.n_classes, (self.n_classes, 4), generator=teacher)
        ids = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, self.n_classes, (batch_size,), generator=gen)
        choice = torch.randint(0, 4, (batch_size, seq_len), generator=gen)
        for t in range(seq_len):
            ids[:, t + 1] = successors[ids[:, t], choice[:, t]]
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
