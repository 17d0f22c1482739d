"""Options of ``twobp bench`` and the model regimes it measures.

Each field of :class:`BenchConfig` carries its command-line help. A *regime*
is a model size and a micro-batch size: the LLaMA bench has two built in
(:data:`REGIMES`), one with large micro-batches (GEMMs of >= 256 rows, where
splitting the batch costs little) and one with small micro-batches (<= 32
rows, where each GEMM runs far below the machine's peak and one process is
much slower micro-batched than on the whole batch). :func:`resolve` turns the
options into a :class:`BenchPlan`. Two modes replace parts of the default
matrix (the lists the user gives stay): ``--quick``, a tiny matrix for tests,
and ``--overhead``, where a pipeline loses time against its bound with and
without 2BP. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from twobp.config import doc, parse_overrides
from twobp_bench.matrix import (
    AUTO,
    AUTO_MICROBATCHES,
    DEEPSPEED_SCHEDULES,
    REFERENCE_MICROBATCHED,
    REFERENCE_WHOLE_BATCH,
    REFERENCES,
    TORCH_SCHEDULES,
    Variant,
    build_variants,
)

MODEL_FAMILIES = ("llama", "bert", "mamba", "resnet", "deepspeech", "moe")

DEFAULT_SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "zb-v",
    "dualpipev",
    "chimera",
    "dualpipe",
    "auto",
]
DEFAULT_TORCH_SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
DEFAULT_DEEPSPEED_SCHEDULES = ["1F1B"]
DEFAULT_POLICIES = ["paper"]
LARGE_MICROBATCH_COUNT = 8
"""The third micro-batch count of the default matrix, next to ``p`` and ``2p``."""


@dataclass(frozen=True)
class Regime:
    """A model size and a micro-batch size to measure.

    Args:
        name: short name for tables (``"large"``, ``"small"``, ``"bert-small"``).
        description: one line for the report.
        overrides: config fields of the model preset to change.
        microbatch_size: samples (sequences, images) per micro-batch.
        references: the single-process references to measure (see
            :data:`twobp_bench.matrix.REFERENCES`).
        family: the model family (see :data:`MODEL_FAMILIES`).
    """

    name: str
    description: str
    overrides: Mapping[str, Any]
    microbatch_size: int
    references: tuple[str, ...] = REFERENCES
    family: str = "llama"


REGIMES: Mapping[str, Regime] = MappingProxyType(
    {
        "large": Regime(
            "large",
            "large micro-batches: dim 256, 4 sequences x 64 tokens = 256 rows per GEMM",
            MappingProxyType(
                {
                    "vocab_size": 256,
                    "dim": 256,
                    "n_layers": 4,
                    "n_heads": 8,
                    "ffn_dim": 688,
                    "seq_len": 64,
                }
            ),
            4,
            # The 2BP limit matters where W concatenation pays: the small regime.
            (REFERENCE_MICROBATCHED, REFERENCE_WHOLE_BATCH),
        ),
        "small": Regime(
            "small",
            "small micro-batches: dim 512, 2 sequences x 16 tokens = 32 rows per GEMM",
            MappingProxyType(
                {
                    "vocab_size": 256,
                    "dim": 512,
                    "n_layers": 4,
                    "n_heads": 8,
                    "ffn_dim": 1376,
                    "seq_len": 16,
                }
            ),
            2,
        ),
    }
)
"""The built-in regimes of the LLaMA bench (6 blocks: embedding, 4 decoders, head)."""

QUICK_REGIME = Regime(
    "quick",
    "a tiny model for tests: dim 32, 2 sequences x 8 tokens per micro-batch",
    MappingProxyType(
        {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "seq_len": 8}
    ),
    2,
)


@dataclass
class BenchConfig:
    """Everything ``twobp bench`` needs; the defaults are the full LLaMA bench on 2 CPU cores."""

    model: list[str] = doc(  # noqa: RUF009 (doc makes a default_factory for lists)
        "model families (llama, bert, mamba, resnet, deepspeech, moe); llama runs the built-in "
        "regimes, each other family its --size preset",
        ["llama"],
    )
    size: str = doc("model size preset the regimes start from (tiny, small)", "tiny")
    regimes: list[str] = doc(  # noqa: RUF009 (doc makes a default_factory for lists)
        "built-in regimes of the llama bench: large (>= 256 rows per GEMM), small (<= 32)",
        ["large", "small"],
    )
    overrides: str | None = doc(
        "model config fields to change in every regime, e.g. 'n_layers=6,dim=128'", None
    )
    microbatch_size: int | None = doc(
        "samples per micro-batch (default: the regime's; 2 for models without regimes)", None
    )
    ranks: int = doc("local ranks (pipeline ranks p)", 2)
    data_parallel: int = doc(
        "copies D of every twobp pipeline, on D x --ranks processes, each on a batch of its "
        "own; figures are those of copy 0 (the global throughput is D times); torch and "
        "reference variants need D = 1 and give way",
        1,
    )
    threads: int = doc("torch threads per rank, for every variant and reference", 1)
    microbatches: list[int] | None = doc(  # noqa: RUF009
        "micro-batch counts m (default: p, 2p and 8)", None
    )
    partition: list[int] | None = doc(  # noqa: RUF009
        "blocks per stage, for every variant whose model has that many stages (the others, "
        "and by default every variant: the body split evenly, the embedding with the first "
        "stage and the head with the last)",
        None,
    )
    schedules: list[str] = doc(  # noqa: RUF009
        "twobp schedules (see `twobp simulate --help`); 'auto': schedule='auto', which "
        "chooses the schedule, 2BP policy and partition itself",
        DEFAULT_SCHEDULES,
    )
    torch_schedules: list[str] = doc(  # noqa: RUF009
        "torch.distributed.pipelining schedules, without the 'Schedule' prefix",
        DEFAULT_TORCH_SCHEDULES,
    )
    deepspeed_schedules: list[str] | None = doc(  # noqa: RUF009
        "schedules of DeepSpeed's PipelineEngine (1F1B: its TrainSchedule, one stage per "
        "rank; a step is train_batch, with its SGD update at learning rate 0); skipped, with "
        "the reason, where deepspeed is not installed (pip install 'twobp[bench]'); "
        "default: 1F1B, none with --quick and --overhead",
        None,
    )
    policies: list[str] = doc(  # noqa: RUF009
        "2BP placement policies of W to run (paper, eager, fill)", DEFAULT_POLICIES
    )
    without_2bp: bool = doc("also run every fused twobp schedule without 2BP", True)
    recompute: list[str] = doc(  # noqa: RUF009
        "recompute modes of the twobp variants (off, activations, derivatives, all); each "
        "mode besides off runs every twobp variant again with it (the report's memory table)",
        ["off"],
    )
    weight_group_size: int | None = doc(
        "the most micro-batches one W of a twobp variant concatenates (and, with recompute "
        "derivatives, rebuilds) at once; default: no cap",
        None,
    )
    share_model: bool = doc(
        "run every twobp variant of this twobp on one copy of the model, each claiming it "
        "for its steps (Pipeline.claim_blocks), as a training run holds one model; torch "
        "variants, references and the baseline keep a copy each",
        False,
    )
    rounds: int = doc("timed rounds; each round runs every variant once, in turn", 5)
    warmup: int = doc("untimed rounds first (the last one also probes memory)", 1)
    references: bool = doc("measure the single-process references (efficiency)", True)
    simulate: bool = doc("profile the blocks and compare simulated with measured step time", True)
    dtype: str = doc("parameter dtype", "float32", choices=("float32", "float64", "bfloat16"))
    seed: int = doc("seed of the weights and the data", 0)
    out: str = doc("output folder: report.md, results.json, throughput.png", "runs/bench")
    timeout: float = doc("seconds a rank waits on a peer before failing", 300.0)
    quick: bool = doc(
        "a tiny matrix for tests: tiny model, m = 2, 2 rounds, and unless given, 1f1b and "
        "zb-v against torch's 1F1B and ZBVZeroBubble",
        False,
    )
    overhead: bool = doc(
        "where a pipeline loses time against its bound: unless given, 1f1b without 2BP and "
        "with the paper and eager policies, no torch schedules; no simulator check. The "
        "report's per-rank table shows each rank's bubble, CPU time and compute per kind",
        False,
    )
    baseline: str | None = doc(
        "git revision whose twobp also runs every twobp variant, next to it in each round "
        "(as 'baseline ...'); run from a checkout of the repository",
        None,
    )
    cprofile: str | None = doc(
        "label of a variant whose timed steps run under cProfile, e.g. 'twobp 1f1b+2bp'; "
        "each rank writes <out>/cprofile/<regime>-m<m>-rank<r>.prof",
        None,
    )


@dataclass(frozen=True)
class BenchPlan:
    """The resolved bench: what each launched job measures.

    Args:
        size: the preset the regimes start from.
        regimes: the regimes, each with its overrides merged with the user's.
        n_ranks: pipeline ranks.
        threads: torch threads per rank.
        data_parallel: copies of every twobp pipeline (on ``D x n_ranks`` processes).
        microbatch_counts: the micro-batch counts m.
        schedules: twobp schedule names.
        torch_schedules: torch schedule names (without ``Schedule``).
        deepspeed_schedules: DeepSpeed schedule names (see
            :data:`~twobp_bench.matrix.DEEPSPEED_SCHEDULES`).
        policies: 2BP policies.
        without_2bp: also run fused twobp schedules without 2BP.
        rounds: timed rounds.
        warmup: untimed rounds.
        references: measure the single-process references.
        simulate: run the simulator check.
        dtype: parameter dtype name.
        seed: weights and data seed.
        timeout: peer timeout in seconds.
        baseline: the git revision of the baseline variants (None: none).
        baseline_path: the folder holding that revision's twobp as
            ``twobp_baseline`` (set once it is exported).
        cprofile: the label of the variant to run under cProfile (None: none).
        cprofile_dir: where the ranks write the cProfile statistics.
        recomputes: the recompute modes of the twobp variants (None: none).
        weight_group_size: the cap on the micro-batches of one W (None: none).
        share_model: this twobp's variants run on one copy of the model.
        partition: blocks per stage for the variants with that many stages (None: the
            bench's own, :func:`twobp_bench.matrix.stage_partition`).
    """

    size: str
    regimes: tuple[Regime, ...]
    n_ranks: int
    threads: int
    microbatch_counts: tuple[int, ...]
    schedules: tuple[str, ...]
    torch_schedules: tuple[str, ...]
    policies: tuple[str, ...]
    without_2bp: bool
    rounds: int
    warmup: int
    references: bool
    simulate: bool
    dtype: str
    seed: int
    timeout: float
    baseline: str | None = None
    baseline_path: str | None = None
    cprofile: str | None = None
    cprofile_dir: str = "runs/bench/cprofile"
    data_parallel: int = 1
    recomputes: tuple[str | None, ...] = (None,)
    weight_group_size: int | None = None
    share_model: bool = False
    deepspeed_schedules: tuple[str, ...] = ()
    partition: tuple[int, ...] | None = None
    torch_by_default: bool = False
    """The torch schedules are the default list: a group leaves out those torch cannot run
    at its micro-batch count (DualPipeV below 2p), rather than report them skipped."""


def default_microbatch_counts(n_ranks: int) -> tuple[int, ...]:
    """``p`` and ``2p`` (the paper's 1F1B-1 and 1F1B-2) and 8, without repeats."""
    return tuple(sorted({n_ranks, 2 * n_ranks, LARGE_MICROBATCH_COUNT}))


def resolve(cfg: BenchConfig) -> BenchPlan:
    """The plan of a configuration, after the modes ``--overhead`` and ``--quick``.

    Raises:
        ValueError: naming the option to change.
    """
    torch_by_default = cfg.torch_schedules == DEFAULT_TORCH_SCHEDULES
    if cfg.overhead:
        cfg = dataclasses.replace(
            cfg,
            schedules=_unless_chosen(cfg.schedules, DEFAULT_SCHEDULES, ["1f1b"]),
            torch_schedules=_unless_chosen(cfg.torch_schedules, DEFAULT_TORCH_SCHEDULES, []),
            deepspeed_schedules=_chosen_or(cfg.deepspeed_schedules, []),
            policies=_unless_chosen(cfg.policies, DEFAULT_POLICIES, ["paper", "eager"]),
            simulate=False,
        )
    if cfg.quick:
        # The tiny matrix, except for the lists the user chose.
        cfg = dataclasses.replace(
            cfg,
            model=["llama"],
            regimes=["quick"],
            microbatches=cfg.microbatches or [2],
            schedules=_unless_chosen(cfg.schedules, DEFAULT_SCHEDULES, ["1f1b", "zb-v"]),
            torch_schedules=_unless_chosen(
                cfg.torch_schedules,
                DEFAULT_TORCH_SCHEDULES,
                # Not DualPipeV: torch runs it with m >= its 2p stages only.
                ["1F1B", "ZBVZeroBubble"],
            ),
            # DeepSpeed takes seconds to import and to build its engine: asked for only.
            deepspeed_schedules=_chosen_or(cfg.deepspeed_schedules, []),
            rounds=min(cfg.rounds, 2),
            warmup=min(cfg.warmup, 1),
        )
    _check(cfg)
    user = parse_overrides(cfg.overrides or "")
    regimes = [_regime(cfg, family, name, user) for family, name in _regime_names(cfg)]
    counts = tuple(cfg.microbatches or ()) or default_microbatch_counts(cfg.ranks)
    return BenchPlan(
        size=cfg.size,
        regimes=tuple(regimes),
        n_ranks=cfg.ranks,
        threads=cfg.threads,
        microbatch_counts=tuple(sorted(set(counts))),
        schedules=tuple(cfg.schedules),
        torch_schedules=tuple(cfg.torch_schedules),
        policies=tuple(cfg.policies),
        without_2bp=cfg.without_2bp,
        rounds=cfg.rounds,
        warmup=cfg.warmup,
        references=cfg.references,
        simulate=cfg.simulate,
        dtype=cfg.dtype,
        seed=cfg.seed,
        timeout=cfg.timeout,
        baseline=cfg.baseline or None,
        cprofile=cfg.cprofile or None,
        cprofile_dir=f"{cfg.out}/cprofile",
        data_parallel=cfg.data_parallel,
        recomputes=_recomputes(cfg),
        weight_group_size=cfg.weight_group_size,
        share_model=cfg.share_model,
        deepspeed_schedules=tuple(_chosen_or(cfg.deepspeed_schedules)),
        torch_by_default=torch_by_default,
        partition=tuple(cfg.partition) if cfg.partition else None,
    )


def _recomputes(cfg: BenchConfig) -> tuple[str | None, ...]:
    """``--recompute`` as modes, ``off`` as None, each once."""
    return tuple(dict.fromkeys(None if m == "off" else m for m in cfg.recompute))


def _unless_chosen(given: list[str], default: list[str], quick: list[str]) -> list[str]:
    return quick if given == default else given


def _chosen_or(given: list[str] | None, default: list[str] | None = None) -> list[str]:
    """The DeepSpeed schedules given, else ``default``, else the default schedules."""
    if given is not None:
        return given
    return list(DEFAULT_DEEPSPEED_SCHEDULES if default is None else default)


def _regime_names(cfg: BenchConfig) -> list[tuple[str, str]]:
    """``(family, regime)`` pairs: llama's built-in regimes, the others' preset."""
    out: list[tuple[str, str]] = []
    for family in dict.fromkeys(cfg.model):
        out += [(family, name) for name in cfg.regimes] if family == "llama" else [(family, "")]
    return out


def _regime(cfg: BenchConfig, family: str, name: str, user: Mapping[str, Any]) -> Regime:
    if family != "llama":
        size = cfg.microbatch_size or 2
        label = f"{family}-{cfg.size}"
        return Regime(label, f"{label} preset", dict(user), size, family=family)
    known = {"quick": QUICK_REGIME, **REGIMES}
    if name not in known:
        raise ValueError(f"--regimes: unknown regime {name!r}; choose from {', '.join(REGIMES)}")
    base = known[name]
    return Regime(
        base.name,
        base.description + (f"; overrides {dict(user)}" if user else ""),
        # A plain dict: the plan is pickled to every rank, and mapping proxies do not pickle.
        {**base.overrides, **user},
        cfg.microbatch_size or base.microbatch_size,
        base.references,
    )


def _check(cfg: BenchConfig) -> None:
    from twobp.schedule import SCHEDULES, TWO_BP_POLICIES

    unknown = [m for m in cfg.model if m not in MODEL_FAMILIES]
    if unknown or not cfg.model:
        raise ValueError(
            f"--model: unknown family {unknown[0]!r}; choose from {', '.join(MODEL_FAMILIES)}"
            if unknown
            else f"--model: give at least one family ({', '.join(MODEL_FAMILIES)})"
        )
    if cfg.ranks < 1 or cfg.threads < 1 or cfg.data_parallel < 1:
        raise ValueError(
            f"--ranks, --threads and --data-parallel must be >= 1, got {cfg.ranks}, "
            f"{cfg.threads}, {cfg.data_parallel}"
        )
    if cfg.rounds < 1 or cfg.warmup < 1:
        raise ValueError(
            f"--rounds and --warmup must be >= 1 (the last warm-up round probes memory), "
            f"got {cfg.rounds}, {cfg.warmup}"
        )
    if any(n < 1 for n in cfg.partition or ()):
        raise ValueError(f"--partition: every stage needs a block, got {cfg.partition}")
    if any(m < 1 for m in cfg.microbatches or ()):
        raise ValueError(f"--microbatches must be >= 1, got {cfg.microbatches}")
    if cfg.microbatch_size is not None and cfg.microbatch_size < 1:
        raise ValueError(f"--microbatch-size must be >= 1, got {cfg.microbatch_size}")
    for name in cfg.schedules:
        if name not in SCHEDULES and name not in (AUTO, AUTO_MICROBATCHES):
            raise ValueError(
                f"--schedules: unknown {name!r}; choose from "
                f"{', '.join([*SCHEDULES, AUTO, AUTO_MICROBATCHES])}"
            )
    for name in cfg.torch_schedules:
        if name not in TORCH_SCHEDULES:
            raise ValueError(
                f"--torch-schedules: unknown {name!r}; choose from {', '.join(TORCH_SCHEDULES)}"
            )
    for name in _chosen_or(cfg.deepspeed_schedules):
        if name not in DEEPSPEED_SCHEDULES:
            raise ValueError(
                f"--deepspeed-schedules: unknown {name!r}; choose from "
                f"{', '.join(DEEPSPEED_SCHEDULES)}"
            )
    for name in cfg.policies:
        if name not in TWO_BP_POLICIES:
            raise ValueError(
                f"--policies: unknown {name!r}; choose from {', '.join(TWO_BP_POLICIES)}"
            )
    from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_MODES

    for name in cfg.recompute:
        if name not in (NO_RECOMPUTE, *RECOMPUTE_MODES):
            raise ValueError(
                f"--recompute: unknown {name!r}; choose from "
                f"{', '.join((NO_RECOMPUTE, *RECOMPUTE_MODES))}"
            )
    if not cfg.recompute:
        raise ValueError("--recompute: give at least one mode (off: none)")
    if cfg.weight_group_size is not None and cfg.weight_group_size < 1:
        raise ValueError(f"--weight-group-size must be >= 1, got {cfg.weight_group_size}")
    if not (cfg.schedules or cfg.torch_schedules or _chosen_or(cfg.deepspeed_schedules)):
        raise ValueError(
            "nothing to measure: give --schedules, --torch-schedules or --deepspeed-schedules"
        )
    if cfg.cprofile:
        labels = [v.label for v in _every_variant(cfg)]
        if cfg.cprofile not in labels:
            raise ValueError(
                f"--cprofile: no variant {cfg.cprofile!r}; choose from {', '.join(labels)}"
            )


def _every_variant(cfg: BenchConfig) -> list[Variant]:
    """The variants of every group (a regime may measure fewer references)."""
    return build_variants(
        cfg.schedules,
        cfg.torch_schedules,
        cfg.policies,
        without_2bp=cfg.without_2bp,
        references=REFERENCES if cfg.references else (),
        baseline=bool(cfg.baseline),
        recomputes=_recomputes(cfg),
        deepspeed_schedules=_chosen_or(cfg.deepspeed_schedules),
    )
