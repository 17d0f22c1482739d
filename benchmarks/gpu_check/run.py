"""The CUDA path in one command: what a GPU checks that the CPU tests cannot.

Prepared for one GPU (an H200: a few minutes, most of it the paper's layer sizes); it runs on
a CPU too, with tiny sizes (``tests/test_benchmarks_gpu_check.py`` does):

    python benchmarks/gpu_check/run.py --out runs/gpu-check          # CUDA, the paper's sizes
    python benchmarks/gpu_check/run.py --device cpu --small          # a CPU, tiny sizes

1. **The engine and the runtime on the device, against plain autograd.** A pipeline of one
   process holds every stage (the 2BP engine, the dispatcher and the step on CUDA):

   - *gradients*: float64, 1F1B and ZB-V with 2BP against one plain backward (1e-10);
   - *autocast*: bf16 ``Pipeline(autocast=torch.bfloat16)`` against plain ``torch.autocast``
     (the loss and every gradient within bf16's rounding);
   - *memory*: ``pipe.memory_stats()["peak"]`` against ``torch.cuda.max_memory_allocated``
     read after the step, and against the parameters and the most activations or stash held;
   - *recompute with dropout*: every recompute mode against none from the same seed, so the
     random states a recomputed forward replays (the CUDA generator's on a GPU) are checked.
2. **The paper's layers** (LLaMA-7B: hidden 4096, MLP 11008, bf16): the per-operation gain of a
   concatenated W and one layer's profiled costs (``benchmarks/paper_layers/run.py``).
3. **A pipeline step on one GPU.** Two NCCL ranks cannot share one GPU (NCCL refuses a
   communicator with two ranks on one device), and gloo does not move CUDA tensors point to
   point (twobp then computes on the CPU). What runs is one process holding every stage: each
   schedule's order, the 2BP engine and its concatenated W on the device, without transfers;
   the step time of each, with and without 2BP, and its gradients against one plain backward.
4. **A 4-stage simulated step** of 1f1b, zb-h2, zb-v, dualpipev and chimera, without and with
   2BP, from the layer costs profiled on the device in part 2 (transfers free).

Prints markdown; ``--out DIR`` writes ``results.json`` (and part 2's own ``paper-layers/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import Pipeline

PAPER_LAYERS = Path(__file__).resolve().parents[1] / "paper_layers" / "run.py"
STEP_SCHEDULES = ("1f1b", "zb-h2", "zb-v", "interleaved-1f1b")
SIMULATED = ("1f1b", "zb-h2", "zb-v", "dualpipev", "chimera")
RECOMPUTE = ("activations", "derivatives", "all")
BF16_TOLERANCE = 3e-2


def paper_layers() -> ModuleType:
    """``benchmarks/paper_layers/run.py`` as a module."""
    spec = importlib.util.spec_from_file_location("paper_layers_run", PAPER_LAYERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_blocks(width: int, depth: int, dropout: float, seed: int = 0) -> list[nn.Module]:
    """``depth`` blocks of linear, GELU and dropout, and a linear head (the same for a seed)."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout)) for _ in range(depth)
    ]
    return [*blocks, nn.Linear(width, 4)]


def batch(width: int, rows: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, width, generator=gen, dtype=dtype)
    return x.to(device), torch.randn(rows, 4, generator=gen, dtype=dtype).to(device)


def _loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error in float32 (under autocast the output is bf16)."""
    return F.mse_loss(output.float(), target.float())


def relative(a: Tensor, b: Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``b``."""
    scale = float(b.abs().max()) or 1.0
    return float((a.float() - b.float()).abs().max()) / scale


def plain_step(
    blocks: Sequence[nn.Module], x: Tensor, y: Tensor, autocast: torch.dtype | None = None
) -> tuple[float, dict[str, Tensor]]:
    """One plain forward and backward of the whole batch: the loss and every gradient."""
    model = nn.Sequential(*blocks)
    with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        output = model(x)
        loss = _loss(output, y) if autocast is not None else F.mse_loss(output, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def pipeline_step(pipe: Pipeline, x: Tensor, y: Tensor) -> tuple[float, dict[str, Tensor]]:
    loss = pipe.step(x, y)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return float(loss), grads


def worst(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max(relative(got[n], want[n]) for n in want)


def engine_checks(device: torch.device, width: int, depth: int, rows: int) -> dict[str, Any]:
    """Part 1: gradients, autocast, memory and recompute on ``device``."""
    out: dict[str, Any] = {}
    x, y = batch(width, rows, device, torch.float64)
    want_loss, want = plain_step(
        [b.to(device, torch.float64) for b in make_blocks(width, depth, 0.0)], x, y
    )
    for schedule in ("1f1b", "zb-v"):
        blocks = [b.to(torch.float64) for b in make_blocks(width, depth, 0.0)]
        pipe = Pipeline(blocks, F.mse_loss, schedule, 4, two_bp=True, device=device)
        loss, got = pipeline_step(pipe, x, y)
        out[f"gradients {schedule}"] = {
            "loss": abs(loss - want_loss),
            "worst gradient": worst(got, want),
            "ok": abs(loss - want_loss) < 1e-10 and worst(got, want) < 1e-10,
        }
        pipe.close()

    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        x32, y32 = batch(width, rows, device, torch.float32)
        want_loss, want = plain_step(
            [b.to(device) for b in make_blocks(width, depth, 0.0)], x32, y32, torch.bfloat16
        )
        pipe = Pipeline(
            make_blocks(width, depth, 0.0), _loss, "1f1b", 4, device=device,
            autocast=torch.bfloat16,
        )  # fmt: skip
        loss, got = pipeline_step(pipe, x32, y32)
        error = worst(got, want)
        out["autocast bfloat16"] = {
            "loss": abs(loss - want_loss) / abs(want_loss),
            "worst gradient": error,
            "ok": abs(loss - want_loss) / abs(want_loss) < BF16_TOLERANCE
            and error < BF16_TOLERANCE,
        }
        pipe.close()

    pipe = Pipeline(make_blocks(width, depth, 0.0), F.mse_loss, "1f1b", 4, device=device)
    x32, y32 = batch(width, rows, device, torch.float32)
    pipe.step(x32, y32)
    stats = pipe.memory_stats()
    measured = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    floor = stats["parameters"] + max(stats["activations"], stats["stash"])
    out["memory"] = {
        **stats,
        "max_memory_allocated": measured,
        "ok": (measured is None or stats["peak"] == measured) and stats["peak"] >= floor,
    }
    pipe.close()

    reference = None
    for mode in (None, *RECOMPUTE):
        pipe = Pipeline(
            make_blocks(width, depth, 0.25), F.mse_loss, "1f1b", 4, device=device,
            recompute=mode,
        )  # fmt: skip
        torch.manual_seed(7)
        if device.type == "cuda":
            torch.cuda.manual_seed(7)
        _, got = pipeline_step(pipe, x32, y32)
        pipe.close()
        if reference is None:
            reference = got
            continue
        error = worst(got, reference)
        # Another dropout mask would differ by the order of the gradients themselves.
        out[f"recompute {mode} with dropout"] = {"worst gradient": error, "ok": error < 1e-5}
    return out


def step_on_one_device(
    device: torch.device, width: int, depth: int, rows: int, repeats: int
) -> list[dict[str, Any]]:
    """Part 3: each schedule in one process holding every stage, with and without 2BP."""
    x, y = batch(width, rows, device, torch.float32)
    _, want = plain_step([b.to(device) for b in make_blocks(width, depth, 0.0)], x, y)
    rows_out = []
    for schedule in STEP_SCHEDULES:
        for two_bp in (False, True):
            pipe = Pipeline(
                make_blocks(width, depth, 0.0), F.mse_loss, schedule, 8, two_bp=two_bp,
                device=device,
            )  # fmt: skip
            _, got = pipeline_step(pipe, x, y)  # the first step, untimed
            seconds = []
            for _ in range(repeats):
                pipe.zero_grad()
                seconds.append(_timed(lambda p=pipe: p.step(x, y), device))
            pipe.close()
            rows_out.append(
                {
                    "schedule": schedule,
                    "two_bp": two_bp,
                    "step_s": min(seconds),
                    "worst gradient": worst(got, want),
                    "ok": worst(got, want) < 1e-4,
                }
            )
    return rows_out


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def simulated_steps(layers: ModuleType, cost: Any, table: Any, n_layers: int) -> list[Any]:
    """Part 4: 4 ranks, m = 8, each schedule without 2BP and with the paper policy."""
    return [
        row
        for row in layers.simulate_pipeline(
            cost, table, n_layers, 4, 8, schedules=SIMULATED, policies=("off", "paper")
        )
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if math.isfinite(seconds) else "-"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU, the tests)")
    parser.add_argument("--out", help="a folder for results.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    width, depth, rows, repeats = (16, 3, 16, 1) if args.small else (1024, 8, 4096, 5)
    print(f"# CUDA path check: {hardware or 'cpu'}, torch {torch.__version__}")
    results: dict[str, Any] = {"hardware": hardware, "torch": torch.__version__}

    results["engine"] = engine_checks(device, width, depth, rows)
    print("\n| engine check | figures | ok |\n|---|---|---|")
    for name, figures in results["engine"].items():
        shown = ", ".join(
            f"{k} {v:.3g}" for k, v in figures.items() if isinstance(v, (int, float)) and k != "ok"
        )
        print(f"| {name} | {shown} | {figures['ok']} |")

    layers = paper_layers()
    sizes = ["--dim", "32", "--ffn-dim", "48", "--heads", "2", "--tokens", "8", "--layers", "8"]
    paper = ["--device", args.device]
    paper += [*sizes, "--dtype", "float32", "--repeats", "1"] if args.small else []
    if args.out:
        paper += ["--out", str(Path(args.out) / "paper-layers")]
    results["paper_layers"], cost, table = layers.measure(paper)

    results["one_device_steps"] = step_on_one_device(device, width, depth, rows, repeats)
    print("\n| schedule, one process | 2BP | step ms | worst gradient | ok |")
    print("|---|---|---:|---:|---|")
    for r in results["one_device_steps"]:
        print(
            f"| {r['schedule']} | {r['two_bp']} | {_ms(r['step_s'])} "
            f"| {r['worst gradient']:.2g} | {r['ok']} |"
        )

    n_layers = results["paper_layers"]["args"]["layers"]
    results["simulated"] = simulated_steps(layers, cost, table, n_layers)
    print(f"\nSimulated from the profiled layer: {n_layers} layers on 4 ranks, m = 8")
    print("\n| schedule | 2BP | step ms | bubble | peak memory GiB |\n|---|---|---:|---:|---:|")
    for r in results["simulated"]:
        print(
            f"| {r['schedule']} | {r['policy']} | {_ms(r['step_s'])} | {r['bubble']:.3f} "
            f"| {r['peak_bytes'] / 2**30:.2f} |"
        )
    checks = [f["ok"] for f in results["engine"].values()]
    checks += [r["ok"] for r in results["one_device_steps"]]
    results["ok"] = all(checks)
    print(f"\nall checks {'pass' if results['ok'] else 'FAIL'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
