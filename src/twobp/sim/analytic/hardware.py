"""Devices by name: peak dense FLOP/s, memory and bandwidths, and efficiencies.

Peaks are the vendors' dense (no sparsity) figures; bandwidths are per GPU
and per direction (NVLink / Infinity Fabric within a node, the network
between nodes). ``efficiency`` is the fraction of the peak each operation
family reaches (``matmul``: the weight matrices; ``attention``: scores and
values); the defaults are typical of large bf16 training and are guesses
until a measurement replaces them (a JSON given with ``--gpu FILE``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    """One device kind.

    Args:
        name: for the output.
        peak_bf16, peak_fp32: dense FLOP/s.
        memory: bytes of device memory.
        intra_bandwidth, inter_bandwidth: bytes/s per device within and between nodes.
        per_node: devices per node.
        efficiency: fraction of the peak per operation family (``matmul``, ``attention``).
        source: where the figures come from.
        contention: how many times slower a device computes while its neighbours
            compute too (``CostModel.contention``): CPU ranks sharing caches and
            memory bandwidth; 1 for devices of their own.
    """

    name: str
    peak_bf16: float
    peak_fp32: float
    memory: float
    intra_bandwidth: float
    inter_bandwidth: float
    per_node: int = 8
    efficiency: dict[str, float] = field(
        default_factory=lambda: {"matmul": 0.55, "attention": 0.35}
    )
    source: str = ""
    contention: float = 1.0

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``."""
        return self.peak_fp32 if dtype == "float32" else self.peak_bf16

    def seconds(self, flops: float, family: str, dtype: str) -> float:
        """Time of ``flops`` of one operation family."""
        return flops / (self.peak(dtype) * self.efficiency.get(family, 0.5))


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 67e12, 80e9, 450e9, 50e9, source="NVIDIA H100 SXM datasheet"),
    "h200": Hardware("h200", 989e12, 67e12, 141e9, 450e9, 50e9, source="NVIDIA H200 SXM datasheet"),
    "a100-80g": Hardware(
        "a100-80g", 312e12, 19.5e12, 80e9, 300e9, 25e9, source="NVIDIA A100 80GB SXM datasheet"
    ),
    "mi300x": Hardware(
        "mi300x", 1307e12, 163.4e12, 192e9, 448e9, 50e9, source="AMD Instinct MI300X datasheet"
    ),
    "cpu": Hardware(
        "cpu",
        50e9,
        50e9,
        23e9,
        1.7e9,
        1.7e9,
        per_node=2,
        efficiency={"matmul": 1.0, "attention": 1.0},
        source="one core of this machine, not yet calibrated; gloo moved 1.4-2.1 GB/s",
    ),
}


def load_hardware(name: str) -> Hardware:
    """A kind of :data:`HARDWARE`, or a JSON file of :class:`Hardware`'s fields.

    Raises:
        ValueError: an unknown name or a file that is not a device.
    """
    if name in HARDWARE:
        return HARDWARE[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--gpu {name}: not a known kind ({', '.join(HARDWARE)}) nor a JSON file")
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(Hardware)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
        device = Hardware(**{"name": path.stem, **data})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--gpu {name}: {exc}") from exc
    if not all(math.isfinite(x) and x > 0 for x in (device.peak_bf16, device.memory)):
        raise ValueError(f"--gpu {name}: peak_bf16 and memory must be positive")
    return device


def save_hardware(device: Hardware, path: str | Path) -> None:
    """Write ``device`` as the JSON :func:`load_hardware` (``--gpu FILE``) reads."""
    Path(path).write_text(json.dumps(asdict(device), indent=2) + "\n")
