"""``Pipeline(..., compile=True)``: each stage compiled so that 2BP keeps its split.

A stage that runs ``I`` and ``W`` is compiled whole, as one graph of all its blocks, by
:func:`twobp.engine.compiled.compile_for_two_stage`: the graph is cut at the calls that
read parameters, which the store defers as in eager mode, and the regions between are
compiled. Whole, the regions run across the blocks' edges: a block's last residual add
and the next block's normalisation are one region, and the stage enters one compiled
frame per micro-batch instead of one per block. A stage that runs the fused ``B`` has its
blocks compiled one by one, as they are (blocks of one class share their compiled code).
Either way in place (``module.compile(...)``), so that parameter names, checkpoints and
the ranks' model check do not change. Where the user compiled some of a stage's blocks,
those are left to the store, which makes them keep 2BP too, and the others are compiled
one by one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from twobp.engine.compiled import compile_for_two_stage, is_compiled
from twobp.engine.region_choice import REGION_MODES
from twobp.engine.unfolded_norms import NORM_MODES
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.setup.compile_trial import STAGE_MODES

_TWOBP_KEYWORDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "regions": (
        REGION_MODES,
        "measured",
        "how the regions between the calls that read parameters run: the faster way timed "
        "once, compiled, or eagerly",
    ),
    "norms": (
        NORM_MODES,
        "unfolded",
        "an RMS norm's normalisation compiled with the region before it, or the whole norm "
        "run eagerly by the capture",
    ),
    "stages": (
        STAGE_MODES,
        "measured",
        "each stage compiled or eager, the faster in the first training steps, or every "
        "stage compiled",
    ),
}
"""The keywords of ``compile={...}`` that are twobp's, not ``torch.compile``'s: their
values, default and what they choose."""


def compile_options(value: object) -> dict[str, Any] | None:
    """``torch.compile``'s keywords for ``compile=value`` (None: do not compile).

    Three keywords are twobp's. Two go to :class:`twobp.engine.compiled.SplittingBackend`:
    ``regions`` (``"measured"``, the default; ``"compiled"``; ``"eager"``) says how
    the regions between the calls that read parameters run; ``norms``
    (``"unfolded"``, the default; ``"routed"``) whether an RMS norm's normalisation
    is compiled with the region before it, only its weight product left to the
    capture. ``stages`` (``"measured"``, the default; ``"compiled"``) whether each
    stage keeps its compiled blocks only where the first training steps found them
    faster than eager (:mod:`twobp.runtime.setup.compile_trial`).

    Raises:
        PipelineConfigError: if ``value`` is neither a bool nor a dict of keywords,
            or its ``regions``, ``norms`` or ``stages`` is none of those.
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for key, (modes, default, what) in _TWOBP_KEYWORDS.items():
            mode = value.get(key, default)
            if mode not in modes:
                raise PipelineConfigError(
                    f"compile={{{key!r}: {mode!r}, ...}}: {key} is one of "
                    f"{', '.join(map(repr, modes))} ({what})"
                )
        return dict(value)
    raise PipelineConfigError(
        f"compile={value!r}: pass True (inductor), False, or a dict of torch.compile's "
        f"keyword arguments such as {{'backend': 'aot_eager'}} or {{'mode': 'max-autotune'}}"
    )


def compile_stage(stage: nn.Module, options: dict[str, Any], split: bool) -> None:
    """Compile ``stage`` in place: whole where it runs 2BP, else each block not compiled yet.

    Args:
        stage: the stage's blocks (its children).
        options: ``torch.compile``'s keywords.
        split: whether the stage runs 2BP (then its graph is cut for it).
    """
    options = {k: v for k, v in options.items() if k != "stages"}  # the pipeline's own
    if split and not any(is_compiled(block) for block in stage.children()):
        compile_for_two_stage(stage, **options)
        return
    for block in stage.children():
        if is_compiled(block):
            continue
        if split:
            compile_for_two_stage(block, **options)
        else:  # a fused B: the graph is compiled whole
            block.compile(**{k: v for k, v in options.items() if k not in _TWOBP_KEYWORDS})
