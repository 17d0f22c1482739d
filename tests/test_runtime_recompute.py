"""Pipeline(recompute=...) on real process groups (gloo, CPU, float64).

One two-rank launch trains reference models with every recompute mode on
several schedules and compares them with the single-process reference, runs
an MLP with dropout with and without recomputation from the same random
states (the gradients must agree: the masks replay), reads the memory figures
of both, and checks that a forward that is not repeatable is named. Bad
options are checked in one process.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from recompute_workers import (
    MODES,
    RecomputeCase,
    dropout_batch,
    dropout_blocks,
    kept_when_it_fits,
    session,
)
from runtime_models import build_blocks, loss_fn, needs_no_process_group, train_reference
from twobp.runtime import NonRepeatableForwardError, Pipeline, PipelineConfigError, launch

TOL = 1e-10
EXACT = 1e-12
N_MB = 4
BATCH = 2 * N_MB
DROPOUT_MB = 8

TRAINED = [
    *(RecomputeCase("mlp", s, m) for s in ("1f1b", "gpipe", "zb-h1") for m in MODES),
    *(RecomputeCase("transformer", "1f1b", m) for m in MODES),
    RecomputeCase("transformer", "interleaved-1f1b", "all"),
    RecomputeCase("mlp", "1f1b", "activations", two_bp=False),
    # Without 2BP no stage keeps a stash: "all" recomputes the activations only.
    RecomputeCase("mlp", "1f1b", "all", two_bp=False),
    RecomputeCase("mlp", "1f1b", "derivatives", weight_group_size=1),
    RecomputeCase("mlp", "1f1b", ["all", "derivatives"]),
    # recompute="auto" on unit costs: the stashes over the limit rebuilt, the rest kept.
    *(RecomputeCase("mlp", "1f1b", "auto", memory_limit=limit) for limit in (3.5, 3.0)),
    RecomputeCase("transformer", "1f1b", "auto", memory_limit=3.0),
    # Planned at the first step on the profiled blocks, under a limit that holds every stash.
    RecomputeCase("mlp", "1f1b", "auto", profiled=True),
]
DROPOUT = [
    *(
        RecomputeCase("dropout", s, m, weight_group_size=g)
        for s, g in (("1f1b", None), ("1f1b", 1), ("zb-h1", None), ("interleaved-1f1b", 2))
        for m in (None, *MODES)
    ),
    RecomputeCase("dropout", "1f1b", "auto", memory_limit=6.5),
]
# Which stashes recompute="auto" rebuilds, by hand: 1F1B on 2 ranks holds every stash of
# the step (1 each) and two activations at its peak; a rebuilt one keeps 0.5 instead.
REBUILT = {
    "mlp 1f1b two_bp=True recompute=auto limit=3.5": {0: (1,), 1: (0,)},
    "mlp 1f1b two_bp=True recompute=auto limit=3.0": {0: (0, 1), 1: (0, 1)},
    "dropout 1f1b two_bp=True recompute=auto limit=6.5": {0: (1, 2, 3), 1: (0, 1, 2)},
}

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(session, 2, TRAINED, DROPOUT, N_MB, DROPOUT_MB, timeout=300)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {m: train_reference(m, N_MB, BATCH) for m in ("mlp", "transformer")}


@pytest.mark.parametrize("case", TRAINED, ids=str)
def test_recompute_matches_single_process(case, results, references):
    reference = references[case.model]
    grads: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for rank, per_rank in enumerate(results):
        r = per_rank["trained"][str(case)]
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (rank, got, want)
        grads.update(r["grads"])
        state.update(r["state"])
    assert set(grads) == set(reference["grads"])
    for name, want in reference["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=0, atol=TOL, msg=f"grad of {name}")
    for name, want in reference["state"].items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=TOL, msg=name)
    if case.recompute == "auto":
        rebuilt = results[0]["trained"][str(case)]["rebuilt"]
        assert rebuilt == REBUILT.get(str(case), rebuilt) and (rebuilt or case.profiled), rebuilt


def test_auto_rebuilds_what_the_plan_chose(results):
    for key, want in REBUILT.items():
        part = "dropout" if key.startswith("dropout") else "trained"
        for per_rank in results:
            assert per_rank[part][key]["rebuilt"] == want, key
    schedule = results[0]["trained"]["mlp 1f1b two_bp=True recompute=auto limit=3.0"]["schedule"]
    # Shown in the schedule: rank 1 drops the stashes of 0 and 1 and rebuilds them last.
    assert "1F0 1IR0 1F1 1IR1 1F2 1I2 1F3 1I3 1W2-3 1WR0 1WR1" in schedule


def test_auto_under_a_limit_the_default_fits_runs_the_default(references):
    # two_bp unset with an example input: the default splits where a profile says 2BP
    # pays, on a uniform partition; with room for it, recompute="auto" changes nothing.
    results = launch(kept_when_it_fits, 2, N_MB, BATCH, timeout=120)
    reference = references["mlp"]
    grads: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["auto_plan"] is None  # nothing like schedule='auto' planned it
        assert r["two_bp_choice"] == results[0]["two_bp_choice"] is not None
        for name in ("schedule", "recompute", "stage_blocks"):
            got, want = r[name]
            assert got == want, (name, str(got), str(want))
        rebuilt = r["rebuild_choice"]
        assert rebuilt is not None and rebuilt.rebuilds == 0 and rebuilt.peak <= 2**30
        assert rebuilt.schedule == r["schedule"][1]
        assert "nothing rebuilt" in rebuilt.summary()
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (got, want)
        grads.update(r["grads"])
        state.update(r["state"])
    assert set(grads) == set(reference["grads"])
    for name, want in reference["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=0, atol=TOL, msg=f"grad of {name}")
    for name, want in reference["state"].items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("case", [c for c in DROPOUT if c.recompute is not None], ids=str)
def test_dropout_replays_exactly(case, results):
    plain = RecomputeCase(case.model, case.schedule, None, weight_group_size=case.weight_group_size)
    for per_rank in results:
        got, want = per_rank["dropout"][str(case)], per_rank["dropout"][str(plain)]
        assert got["losses"] == pytest.approx(want["losses"], rel=0, abs=EXACT)
        assert set(got["grads"]) == set(want["grads"])
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=EXACT, msg=name)
        # The generators went on as if nothing had been recomputed.
        assert got["after"] == want["after"]


def _memory(
    results: list[dict[str, Any]], mode: Any, group: int | None = None
) -> list[dict[str, int]]:
    case = RecomputeCase("dropout", "1f1b", mode, weight_group_size=group)
    return [r["dropout"][str(case)]["memory"] for r in results]


def test_memory_figures_of_each_mode(results):
    plain = _memory(results, None)
    for figures in plain:
        assert set(figures) == {"activations", "stash", "parameters", "optimizer", "peak"}
        assert figures["activations"] > 0 and figures["parameters"] > 0
        assert figures["optimizer"] == 0  # SGD without momentum keeps no state
        assert figures["peak"] >= figures["parameters"] + figures["activations"]
    assert plain[0]["stash"] > 0 and plain[1]["stash"] > 0
    activations, derivatives, both = (_memory(results, m) for m in MODES)
    for rank in range(2):
        assert activations[rank]["activations"] <= 0.34 * plain[rank]["activations"]
        assert activations[rank]["stash"] == plain[rank]["stash"]
        assert derivatives[rank]["activations"] == plain[rank]["activations"]
        assert both[rank]["activations"] == activations[rank]["activations"]
        assert derivatives[rank]["stash"] <= 0.34 * plain[rank]["stash"]
        assert both[rank]["stash"] == derivatives[rank]["stash"]
    # W rebuilds one group at a time: with a cap, the peak falls too.
    plain, derivatives = _memory(results, None, 1), _memory(results, "derivatives", 1)
    for rank in range(2):
        assert derivatives[rank]["peak"] < plain[rank]["peak"]


def test_auto_holds_less_stash_than_keeping_every_one(results):
    case = RecomputeCase("dropout", "1f1b", "auto", memory_limit=6.5)
    plain = _memory(results, None)
    auto = [r["dropout"][str(case)]["memory"] for r in results]
    derivatives = _memory(results, "derivatives")
    for rank in range(2):
        # 3 of 8 stashes rebuilt: between keeping all and rebuilding all.
        assert derivatives[rank]["stash"] < auto[rank]["stash"] < plain[rank]["stash"]
        assert auto[rank]["activations"] == plain[rank]["activations"]


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_changes_buffers_is_named(mode, results):
    errors = [r["non-repeatable"][mode] for r in results]
    named = [message for kind, message in errors if kind == "NonRepeatableForwardError"]
    assert named, errors
    assert f"recompute={mode!r}" in named[0]
    # Blocks of their own (no model names): the first by its block's path, the others counted.
    assert re.search(
        r"block \d+\.1 \(BatchNorm2d\) changed its running_mean, running_var, "
        r"num_batches_tracked, and \d+ other modules theirs: ",
        named[0],
    ), named[0]
    assert all(kind in ("NonRepeatableForwardError", "PeerStepFailedError") for kind, _ in errors)


def _mlp_pipeline(**options: Any) -> Pipeline:
    return Pipeline(
        build_blocks("mlp"), loss_fn("mlp"), "1f1b", N_MB, device="cpu", timeout=30.0, **options
    )


@needs_no_process_group
def test_an_unknown_mode_names_the_option_and_the_choices():
    with pytest.raises(
        PipelineConfigError,
        match=r"recompute='activation': unknown mode; "
        r"choose one of None, 'activations', 'derivatives', 'all'",
    ):
        _mlp_pipeline(recompute="activation")
    with pytest.raises(PipelineConfigError, match=r"recompute=.* \(stage 1\): unknown mode"):
        _mlp_pipeline(recompute=[None, "everything"])


@needs_no_process_group
def test_a_list_needs_one_mode_per_stage():
    with pytest.raises(PipelineConfigError, match=r"2 entries for 1 stages"):
        _mlp_pipeline(recompute=["all", None])
    pipe = _mlp_pipeline(recompute=["derivatives"])
    assert pipe.recompute == ("derivatives",)
    pipe.close()


@needs_no_process_group
def test_memory_stats_counts_the_optimizer_it_is_given():
    pipe = _mlp_pipeline(recompute="all")
    from runtime_models import make_batch

    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.step(*make_batch("mlp", 0, BATCH))
    optimizer.step()
    with_state = pipe.memory_stats(optimizer)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    assert with_state["parameters"] == 2 * params  # the parameters and their gradients
    assert with_state["optimizer"] >= 2 * params  # AdamW's two moments (and its steps)
    assert pipe.memory_stats()["optimizer"] == 0
    pipe.close()


def test_the_error_type_is_a_config_error():
    assert issubclass(NonRepeatableForwardError, PipelineConfigError)


@needs_no_process_group
@pytest.mark.parametrize("two_bp", [True, False])
def test_dropout_in_a_world_of_one_matches_plain_autograd(two_bp):
    # One rank runs the forwards in micro-batch order, as autograd micro-batch by
    # micro-batch does: the same masks from the same generator, with and without
    # recomputation, and the generator left where autograd leaves it.
    inputs, targets = dropout_batch(2 * DROPOUT_MB)
    reference = torch.nn.Sequential(*dropout_blocks())
    torch.manual_seed(1000)
    want_loss = 0.0
    for x, y in zip(inputs.chunk(DROPOUT_MB), targets.chunk(DROPOUT_MB), strict=True):
        loss = torch.nn.functional.mse_loss(reference(x), y) / DROPOUT_MB
        loss.backward()
        want_loss += float(loss.detach())
    want_after = float(torch.rand(()))
    for mode in (None, *MODES):
        case = RecomputeCase("dropout", "1f1b", mode, two_bp=two_bp)
        with _dropout_pipeline(case) as pipe:
            torch.manual_seed(1000)
            got_loss = pipe.step(inputs, targets)
            after = float(torch.rand(()))
            grads = dict(pipe.named_parameters())
        assert got_loss == pytest.approx(want_loss, rel=0, abs=EXACT), mode
        assert after == want_after, mode
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=EXACT, msg=name)


def _dropout_pipeline(case: RecomputeCase) -> Pipeline:
    return Pipeline(
        dropout_blocks(),
        torch.nn.functional.mse_loss,
        case.schedule,
        DROPOUT_MB,
        two_bp=case.two_bp,
        recompute=case.recompute,
        device="cpu",
    )


@needs_no_process_group
def test_auto_needs_a_memory_limit_and_a_schedule_it_builds():
    with pytest.raises(PipelineConfigError, match=r"recompute='auto' .* pass memory_limit="):
        _mlp_pipeline(recompute="auto")
    from twobp.schedule import prepare

    given = prepare("1f1b", n_ranks=1, n_microbatches=N_MB)
    with pytest.raises(PipelineConfigError, match=r"schedule=.* is given whole: use a name"):
        Pipeline(
            build_blocks("mlp"),
            loss_fn("mlp"),
            given,
            recompute="auto",
            memory_limit=1e9,
            device="cpu",
        )


class _TorchvisionLikeResNet(torch.nn.Module):
    """twobp's ResNet blocks as torchvision lays them out: stem, layers, head."""

    def __init__(self) -> None:
        super().__init__()
        from twobp.models.resnet import ResNetConfig, resnet_blocks

        blocks = resnet_blocks(ResNetConfig(layers=(2, 2), width=4, image_size=16, num_classes=3))
        self.stem, self.head = blocks[0], blocks[-1]
        self.layer1 = torch.nn.Sequential(*blocks[1:3])
        self.layer2 = torch.nn.Sequential(*blocks[3:5])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(self.stem(x))))


@needs_no_process_group
def test_batchnorm_under_recompute_is_refused_in_one_line_by_the_model_s_names():
    """Each Bottleneck holds three BatchNorms: the error names the first by the name the
    model gives it (not the wrapper block's, ``2.layer2.0.bn1``) and counts the others."""
    import twobp

    blocks = twobp.split(_TorchvisionLikeResNet(), at=["layer2"])
    pipe = Pipeline(
        blocks,
        torch.nn.functional.cross_entropy,
        "1f1b",
        2,
        recompute="activations",
        device="cpu",
        timeout=30.0,
    )
    try:
        with pytest.raises(NonRepeatableForwardError) as caught:
            pipe.step(torch.randn(4, 3, 16, 16), torch.randint(0, 3, (4,)))
    finally:
        pipe.close()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600, message
    assert "recompute='activations' ran the forward again and stem.bn (BatchNorm2d) " in message
    assert "changed its running_mean, running_var, num_batches_tracked, " in message
    # One rank runs both blocks; each layer's bottlenecks hold three BatchNorms, and the
    # first bottleneck's shortcut one more: 2 * 7 others.
    assert "and 14 other modules theirs: the forward is not repeatable" in message
