"""Options of ``twobp train``; each field's help is also the command-line help.

The options that set a pipeline option of the same meaning take their help
from :class:`twobp.runtime.options.PipelineOptions` (``--policy`` is
``two_bp_policy``, ``--microbatches`` is ``n_microbatches``, ``--threads`` is
``num_threads``: the command line keeps its shorter names).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from twobp.config import doc
from twobp.integrations import MIXTURE_FAMILIES, SPEECH_FAMILIES, TRANSFORMERS_FAMILIES
from twobp.runtime.options import option_help
from twobp.schedule import TWO_BP_POLICIES
from twobp.sim.recompute import RECOMPUTE_AUTO, RECOMPUTE_MODES

MODEL_FAMILIES = ("llama", "bert", "mamba", "resnet", "deepspeech", "moe")


@dataclass
class TrainConfig:
    """Everything one training run needs, with defaults that run on a fresh 2-core CPU."""

    model: str = doc(
        "model family: llama, mamba and moe (next byte of real text), bert (masked bytes of real "
        "text), resnet (synthetic images), deepspeech (synthetic utterances, CTC); the text is "
        "Python's own sources or --data",
        "llama",
        choices=MODEL_FAMILIES,
    )
    hf_config: str | None = doc(
        "train a Hugging Face transformers model of this family instead of --model, built "
        "from the --size tiny|small configuration, its head tied as published (needs the "
        "transformers extra): llama, gpt2, mamba, mixtral (next byte; mixtral with its "
        "routers' auxiliary loss), bert (masked bytes), wav2vec2, hubert (CTC on synthetic "
        "audio)",
        None,
        choices=(*TRANSFORMERS_FAMILIES, *MIXTURE_FAMILIES, *SPEECH_FAMILIES),
    )
    size: str = doc("model size preset (tiny, small; full sizes need a GPU)", "tiny")
    schedule: str = doc(
        "pipeline schedule name (see `twobp simulate --help`), or 'auto': profile the blocks, "
        "simulate every schedule, 2BP policy and W group size, run the fastest",
        "1f1b",
    )
    memory_limit: str | None = doc(
        "with --schedule auto or --recompute auto, the most memory per rank (bytes, or e.g. "
        "2GiB): parameters, gradients, optimizer state, activations and stored W inputs as "
        "the simulator counts them",
        None,
    )
    auto_trials: int = doc(option_help("auto_trials"), 6)
    two_bp: bool | None = doc(
        "split each backward into I and W (2BP; placing W by --policy); --no-two-bp: fused B "
        "on every stage; default: on the stages where it pays, by a profile of the blocks on "
        "the first micro-batch and a simulation of each stage split or fused (the report says "
        "which and the predicted steps)",
        None,
    )
    policy: str = doc(option_help("two_bp_policy"), "paper", choices=tuple(TWO_BP_POLICIES))
    ranks: int = doc("local ranks to start (ignored under torchrun, which sets them)", 2)
    data_parallel: int = doc(
        "copies of the pipeline D: the ranks form D pipelines of ranks/D, each on its own "
        "part of --batch-size; each stage's gradients are all-reduced over its copies",
        1,
    )
    tensor_parallel: int | list[int] = doc(  # noqa: RUF009
        "ranks T each block is split over (the model's tensor-parallel plan: llama, or a "
        "Hugging Face model's base_model_tp_plan); the ranks form D x P x T, tensor parallel "
        "innermost; needs a schedule by name and --microbatches as a number; or sizes A,B,... "
        "with --schedule auto: the one whose simulated step is fastest, P = ranks / (D x T)",
        1,
        parse=lambda text: parse_tensor_parallel(text),
        metavar="T|A,B,...",
    )
    shard_optimizer: bool = doc(
        "shard AdamW's state over the data-parallel copies (pipe.shard_optimizer, ZeRO-1): "
        "gradients reduce-scattered, each copy steps its shard, parameters all-gathered",
        False,
    )
    shard_parameters: bool = doc(
        "shard each stage's parameters, gradients and AdamW's state over the ranks that hold "
        "it (ZeRO-3): weights gathered for F and I only, freed before W; needs "
        "--data-parallel 2 or more, or --schedule chimera or dualpipe",
        False,
    )
    scatter_each_w: bool = doc(
        "with --shard-parameters, reduce-scatter a stage's gradients after each of its W, in "
        "the background, instead of once at its R (Pipeline(scatter_each_w=True))",
        False,
    )
    stages_per_rank: int | None = doc(
        "stages per rank (interleaved-1f1b, zb-v); default: what the schedule needs", None
    )
    partition: str | None = doc(
        "blocks per stage as A,B,..., or 'uniform', or 'balanced' (profiled); default: "
        "uniform, balanced for a V-shaped schedule (zb-v, dualpipev)",
        None,
    )
    microbatches: int | str = doc(
        "micro-batches per step (of each data-parallel copy), or 'auto' (with --schedule auto: "
        "chosen with the schedule for the batch)",
        4,
    )
    batch_size: int = doc(
        "sequences (or images) per step, all copies together; must divide by "
        "--microbatches x --data-parallel",
        16,
    )
    recompute: str | None = doc(
        "trade compute for memory on every stage: activations (F again in I), derivatives "
        "(F and I again in W: the 2BP stash is rebuilt), all; auto (with --memory-limit): "
        "the run as without it where it is predicted to fit, else rebuild only the stashes "
        "that do not fit, chosen per stage and micro-batch; "
        "default: none",
        None,
        choices=(*RECOMPUTE_MODES, RECOMPUTE_AUTO),
    )
    weight_group_size: int | None = doc(option_help("weight_group_size"), None)
    seq_len: int = doc(
        "tokens per sequence (language models); LO:HI draws each step's length from LO to "
        "HI (the model is built for HI; sets --min-seq-len LO)",
        64,
        parse=lambda text: parse_seq_len(text),
        metavar="N|LO:HI",
    )
    min_seq_len: int | None = doc(
        "draw each training step's sequence length from this to --seq-len, the same on every "
        "rank (evaluation uses --seq-len); default: every step --seq-len",
        None,
    )
    steps: int = doc("optimizer steps", 300)
    lr: float = doc("peak learning rate of AdamW (linear warm-up, cosine decay)", 3e-3)
    weight_decay: float = doc("AdamW weight decay", 0.01)
    warmup: int = doc("warm-up steps of the learning rate", 20)
    grad_clip: float = doc("global gradient-norm clipping across all stages (0 = off)", 1.0)
    dtype: str = doc(
        "compute dtype: that of the parameters and activations, or with --autocast the "
        "lower precision the forward computes in (the parameters stay float32)",
        "float32",
        choices=("float32", "float64", "bfloat16", "float16"),
    )
    autocast: bool = doc(
        "mixed precision: float32 parameters, and every stage's forward and loss under "
        "torch.autocast with --dtype (bfloat16 or float16; 2BP's I and W run in the dtypes "
        "autocast uses); without it the whole model is cast to --dtype",
        False,
    )
    compile: bool = doc(
        "compile every block with torch.compile (inductor); with 2BP the graphs are cut at "
        "the calls that read parameters, so that the weight gradients stay deferred and "
        "concatenated",
        False,
    )
    loss_scale: str | None = doc(
        "loss scaling under --dtype float16 --autocast (twobp.GradScaler; every rank skips a "
        "step whose gradients overflow, together): dynamic (start at 2**16, halve on an "
        "overflow, double after 2000 steps without), a number (a static scale), or off; "
        "default: dynamic with --dtype float16 --autocast, off otherwise (bfloat16 needs none)",
        None,
    )
    seed: int = doc("random seed for weights and data", 0)
    data: str | None = doc("text file for the byte-level LM (default: Python's own sources)", None)
    out: str = doc(
        "output folder for the report, curves, timelines and checkpoints; left at runs/latest, "
        "a new run gets a folder of its own, runs/<date>-<time>, and runs/latest leads to it",
        "runs/latest",
    )
    threads: int | None = doc("torch threads per rank (default: cores / local ranks)", None)
    log_every: int = doc(
        "steps between records of OUT/metrics.jsonl and OUT/tensorboard (and the last "
        "step's, or the one a stop ends on), and between progress lines when stderr is not "
        "a terminal",
        10,
    )
    timeout: float = doc(option_help("timeout"), 300.0)
    nonfinite: str = doc(
        "when a step's loss is NaN or infinite: raise (stop the run with an error) or skip "
        "(drop the step's gradients on every rank and go on; the report lists skipped steps; "
        "10 in a row end the run)",
        "raise",
        choices=("raise", "skip"),
    )
    save: bool = doc("write checkpoints into OUT/checkpoints (the last step's, at least)", True)
    save_every: int = doc(
        "steps between checkpoints, so that a crash loses at most this many steps (0: only at "
        "the end of the run; Ctrl-C, SIGTERM or SIGHUP saves the step reached in any case)",
        100,
    )
    keep_checkpoints: int = doc(
        "checkpoints kept in OUT/checkpoints, the newest of this run (and of the run it "
        "continues with --resume)",
        1,
    )
    async_save: bool = doc(
        "write checkpoints in the background while the next steps run (the last one is "
        "complete before the run ends; a crash while one is written leaves the one before)",
        True,
    )
    resume: str | None = doc(
        "continue a run from a checkpoint: a checkpoint folder, a folder of checkpoints or a "
        "run's --out folder (its latest), or 'auto': this --out's latest if there is one, else "
        "start afresh (what a torchrun --max-restarts job needs)",
        None,
    )
    overwrite: bool = doc(
        "let this run replace the checkpoints in OUT/checkpoints that it does not continue "
        "(those of another run, or with --resume those after its checkpoint): they are deleted "
        "when it starts. Without it such a run is refused",
        False,
    )
    verbose: bool = doc(
        "when a rank fails, print every rank's full traceback here too (they always go to "
        "OUT/errors.log, and each rank's output to OUT/logs/)",
        False,
    )
    stop_after: int | None = doc(
        "end this run once this many steps are done in all, with a checkpoint; the learning "
        "rate schedule still spans --steps (for jobs with a time limit: continue with --resume)",
        None,
    )


def run_name(cfg: TrainConfig) -> str:
    """The model of a run as the report names it: ``llama-tiny``, ``hf-gpt2-tiny``."""
    model = cfg.model if cfg.hf_config is None else f"hf-{cfg.hf_config}"
    return f"{model}-{cfg.size}"


def parse_tensor_parallel(text: str) -> int | list[int]:
    """The ``--tensor-parallel`` option: a size ``T``, or sizes ``A,B,...`` to choose from.

    Raises:
        argparse.ArgumentTypeError: if it is neither.
    """
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a size T >= 1 or sizes A,B,... (e.g. 1,2,4) with --schedule auto"
        )
    return values[0] if len(values) == 1 else values


def tensor_sizes(cfg: TrainConfig) -> list[int]:
    """The ``--tensor-parallel`` sizes of a run: its one size, or the sizes it chooses from."""
    t = cfg.tensor_parallel
    return [t] if isinstance(t, int) else list(t)


def parse_seq_len(text: str) -> int | tuple[int, int]:
    """The ``--seq-len`` option: a length ``N``, or a range ``LO:HI`` to draw each step's from.

    Raises:
        argparse.ArgumentTypeError: if it is neither.
    """
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        return values[0]
    if len(values) == 2 and 1 <= values[0] <= values[1]:
        return values[0], values[1]
    raise argparse.ArgumentTypeError(
        f"{text!r}: give a length N or a range LO:HI with 1 <= LO <= HI (e.g. 64:256)"
    )


def step_seq_len(cfg: TrainConfig, step: int) -> int:
    """The sequence length of training step ``step``: ``--seq-len``, or with
    ``--min-seq-len`` one drawn from the range by ``(seed, step)`` alone, so that every
    rank, and a resumed run, draws the same."""
    if cfg.min_seq_len is None or cfg.min_seq_len >= cfg.seq_len:
        return cfg.seq_len
    gen = random.Random(cfg.seed * 1_000_003 + step)
    return gen.randint(cfg.min_seq_len, cfg.seq_len)


def mean_seq_len(cfg: TrainConfig) -> float:
    """The mean tokens per training sequence (for tokens per second)."""
    if cfg.min_seq_len is None or cfg.min_seq_len >= cfg.seq_len:
        return float(cfg.seq_len)
    return (cfg.min_seq_len + cfg.seq_len) / 2


def parse_partition(text: str | None) -> list[int] | str | None:
    """The ``--partition`` option as the ``partition`` of a pipeline: counts, a strategy
    name, or None (the pipeline's default).

    Raises:
        ValueError: if it is neither ``uniform``, ``balanced`` nor integers ``A,B,...``.
    """
    if text is None or text in ("uniform", "balanced"):
        return text
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--partition {text!r}: give blocks per stage as A,B,..., 'uniform' or 'balanced'"
        ) from None
