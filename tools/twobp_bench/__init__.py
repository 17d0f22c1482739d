"""``twobp bench``: 2BP against no 2BP, and twobp against torch.distributed.pipelining.

The benchmark application of twobp, a package of its own: the library does
not import it, and ``twobp bench`` registers it (:mod:`~twobp_bench.cli`)
where it is installed. One launched group per regime runs every variant on
the same model, partition, batch and threads, round after round; see
:func:`twobp_bench.run.run_bench`. The pure parts (:mod:`~twobp_bench.config`,
:mod:`~twobp_bench.matrix`, :mod:`~twobp_bench.stats`,
:mod:`~twobp_bench.targets`, :mod:`~twobp_bench.report`,
:mod:`~twobp_bench.simcheck`, :mod:`~twobp_bench.baseline`) import no torch.
"""

from twobp_bench.config import REGIMES, BenchConfig, BenchPlan, Regime, resolve
from twobp_bench.matrix import TORCH_SCHEDULES, Variant, build_variants

__all__ = [
    "REGIMES",
    "TORCH_SCHEDULES",
    "BenchConfig",
    "BenchPlan",
    "Regime",
    "Variant",
    "build_variants",
    "resolve",
]
