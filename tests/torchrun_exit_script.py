"""A first ``torchrun`` script: one pipeline step in a process group the script made.

Run by ``test_runtime_exit`` under ``python -m torch.distributed.run``.
Arguments: ``--recompute MODE`` (``none``, ``activations``, ``derivatives``,
``all``) and ``--destroy`` (end with ``destroy_process_group``, which many
scripts never call).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import twobp

parser = argparse.ArgumentParser()
parser.add_argument("--recompute", default="none")
parser.add_argument("--destroy", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
recompute = None if args.recompute == "none" else args.recompute
pipe = twobp.Pipeline(
    [nn.Linear(32, 32) for _ in range(4)],
    F.mse_loss,
    schedule="1f1b",
    n_microbatches=4,
    recompute=recompute,
)
x = torch.randn(16, 32)
pipe.step(x, x)
if args.destroy:
    dist.destroy_process_group()
