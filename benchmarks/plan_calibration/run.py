"""The analytic plan's step against the bench's measured step, on this CPU.

For each regime of ``twobp bench`` (``large``: dim 256, 4 x 64 tokens per
micro-batch; ``small``: dim 512, 2 x 16), ``twobp profile --hardware-out``
fits the ``cpu`` device to the regime's decoder layers at its micro-batch
(and to a short 2-rank pipeline of them: the contention); then ``twobp bench
--share-model`` runs the twobp variants on 2 ranks x 1 thread, and the
analytic model (``twobp.sim.analytic``: the layers' FLOPs at the fitted
rates, two layers per stage, the simulator's schedule) predicts each
variant's step. Prints measured and predicted medians and their ratio.

    PYTHONPATH=src:tools .venv/bin/python benchmarks/plan_calibration/run.py --out runs/calibration
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from twobp.sim.analytic import load_hardware
from twobp.sim.analytic.layout import stage_costs
from twobp.sim.analytic.shapes import DecoderShape, block_costs, head_costs
from twobp.sim.candidate import simulate_candidate
from twobp_bench.config import REGIMES

RANKS = 2


def _twobp(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "twobp.cli.main", *args], check=True)


def calibrate(regime: str, out: Path) -> Path:
    """Fit the cpu device to the regime's layers; returns its JSON."""
    spec = REGIMES[regime]
    fields = ",".join(f"{k}={v}" for k, v in spec.overrides.items())
    device = out / f"cpu-{regime}.json"
    _twobp(
        "profile",
        "--model",
        "llama",
        "--size",
        "tiny",
        "--set",
        fields,
        "--microbatch-size",
        str(spec.microbatch_size),
        "--stages",
        str(RANKS),
        "--repeats",
        "9",
        "--out",
        str(out / f"profile-{regime}.json"),
        "--hardware-out",
        str(device),
    )
    return device


def predict(regime: str, device_file: Path, variant: dict[str, Any], m: int) -> float:
    """The analytic step of one bench variant (seconds)."""
    spec = REGIMES[regime]
    config = spec.overrides
    shape = DecoderShape(
        regime,
        int(config["n_layers"]),
        int(config["dim"]),
        int(config["n_heads"]),
        int(config["ffn_dim"]),
        int(config["vocab_size"]),
    )
    device = load_hardware(str(device_file))
    seq_len, microbatch = int(config["seq_len"]), spec.microbatch_size
    block = block_costs(shape, seq_len, microbatch, "float32")
    head = head_costs(shape, seq_len, microbatch, "float32")
    costs, _ = stage_costs(shape, device, block, RANKS, 1, "float32", head)
    policy = variant["policy"] if variant["two_bp"] else "off"
    candidate, _ = simulate_candidate(variant["schedule"], policy or "off", RANKS, m, costs)
    return candidate.makespan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", default="large,small")
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--schedules", default="1f1b,zb-h1,interleaved-1f1b")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="runs/calibration")
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="predict again the run already in --out (its device JSONs and bench results)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    regimes = args.regimes.split(",")
    if args.predict_only:
        devices = {r: out / f"cpu-{r}.json" for r in regimes}
    else:
        devices = {r: calibrate(r, out) for r in regimes}
        _bench(args, out)
    _compare(out, devices)
    return 0


def _bench(args: argparse.Namespace, out: Path) -> None:
    _twobp(
        "bench",
        "--regimes",
        args.regimes,
        "--microbatches",
        args.microbatches,
        "--schedules",
        args.schedules,
        "--policies",
        "paper",
        "--torch-schedules",
        "",
        "--deepspeed-schedules",
        "",
        "--no-references",
        "--no-simulate",
        # One copy of the model, as a training run holds: no variant's weights push
        # another's out of the caches.
        "--share-model",
        "--rounds",
        str(args.rounds),
        "--out",
        str(out / "bench"),
    )


def _compare(out: Path, devices: dict[str, Path]) -> None:
    results = json.loads((out / "bench" / "results.json").read_text())
    print()
    print("| regime | m | variant | measured ms | predicted ms | predicted / measured |")
    print("|---|---:|---|---:|---:|---:|")
    worst = 0.0
    for regime in results["regimes"]:
        for group in regime["groups"]:
            m = group["n_microbatches"]
            for v in group["variants"]:
                if v.get("framework") != "twobp" or "step_s" not in v:
                    continue
                measured = v["step_s"]["median"]
                predicted = predict(regime["name"], devices[regime["name"]], v, m)
                ratio = predicted / measured
                worst = max(worst, abs(ratio - 1))
                print(
                    f"| {regime['name']} | {m} | {v['label']} | {measured * 1e3:.1f} | "
                    f"{predicted * 1e3:.1f} | {ratio:.2f} |"
                )
    print(f"\nlargest error: {worst:.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
