"""The pipeline in a single process world: no launcher, all stages on rank 0."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from repo_scripts import load_script
from runtime_models import (
    build_blocks,
    costs_in_proportion,
    loss_fn,
    make_batch,
    needs_no_process_group,
    train_reference,
)
from runtime_workers import Case, train_case
from twobp.runtime import Pipeline, PipelineConfigError
from twobp.runtime.setup.pipeline_plan import default_partition
from twobp.runtime.setup.replicas import shared_parameters
from twobp.schedule import SCHEDULES, generate
from twobp.sim.split_choice import SPLIT_MARGIN

N_MB = 4
TOL = 1e-10

pytestmark = [needs_no_process_group, pytest.mark.usefixtures("torch_one_thread")]


@pytest.fixture(scope="module")
def references():
    return {m: train_reference(m, N_MB, 2 * N_MB) for m in ("mlp", "conv")}


@pytest.mark.parametrize("two_bp", [False, True])
# Chimera and DualPipe need an even number of ranks (tested on 2 and 4).
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("chimera", "dualpipe")])
@pytest.mark.parametrize("model", ["mlp", "conv"])
def test_single_process_world_matches_reference(model, schedule, two_bp, references):
    result = train_case(Case(model, schedule, two_bp), N_MB, 2 * N_MB, timeout=5.0)
    ref = references[model]
    assert result["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=0)
    for name, want in ref["grads"].items():
        torch.testing.assert_close(result["grads"][name], want, rtol=0, atol=TOL)
    for name, want in ref["state"].items():
        torch.testing.assert_close(result["state"][name], want, rtol=0, atol=TOL)


def _pipe(**options) -> Pipeline:
    options.setdefault("n_microbatches", N_MB)
    return Pipeline(build_blocks("mlp"), loss_fn("mlp"), device="cpu", **options)


def test_world_of_one_owns_every_stage_and_parameter():
    pipe = _pipe(schedule="interleaved-1f1b")
    assert pipe.topology.is_single and pipe.rank == 0 and pipe.pp_rank == 0
    assert sorted(pipe.stages) == [0, 1]
    names = [n for n, _ in nn.Sequential(*build_blocks("mlp")).named_parameters()]
    assert [n for n, _ in pipe.named_parameters()] == names


def test_eval_step_returns_outputs_and_loss():
    pipe = _pipe(schedule="gpipe")
    inputs, targets = make_batch("mlp", 0, 2 * N_MB)
    with torch.no_grad():
        want = nn.Sequential(*build_blocks("mlp"))(inputs)
    torch.testing.assert_close(pipe.eval_step(inputs), want, rtol=0, atol=TOL)
    loss = pipe.eval_step(inputs, targets)
    assert math.isclose(loss, float(loss_fn("mlp")(want, targets)), abs_tol=TOL)
    assert all(p.grad is None for p in pipe.parameters())


def test_peak_stashed_bytes_only_with_two_bp():
    inputs, targets = make_batch("mlp", 0, 2 * N_MB)
    split = _pipe(schedule="1f1b", two_bp=True)
    split.step(inputs, targets)
    assert split.peak_stashed_bytes() > 0
    fused = _pipe(schedule="1f1b", two_bp=False)
    fused.step(inputs, targets)
    assert fused.peak_stashed_bytes() == 0


def test_local_timeline_has_every_compute_action():
    pipe = _pipe(schedule="1f1b", two_bp=True)
    pipe.step(*make_batch("mlp", 0, 2 * N_MB))
    spans = pipe.timeline()
    assert [str(s.action) for s in spans] == [str(a) for a in pipe.schedule.actions[0]]
    assert all(b.start >= a.end for a, b in itertools.pairwise(spans))


def test_configuration_errors_say_what_to_change():
    inputs, targets = make_batch("mlp", 0, 2 * N_MB)
    with pytest.raises(PipelineConfigError, match=r"batch size 3, fewer rows than the 4"):
        _pipe().step(inputs[:3], targets[:3])
    with pytest.raises(PipelineConfigError, match="holds stage 0 and needs the inputs"):
        _pipe().step(None, targets)
    with pytest.raises(PipelineConfigError, match=r"partition \[10\] has 1 stages"):
        _pipe(schedule="interleaved-1f1b", partition=[10])
    with pytest.raises(PipelineConfigError, match="needs example_input"):
        _pipe(partition="balanced")


def _heavy_tailed_blocks() -> list[nn.Module]:
    """The test MLP whose last block is some 15 times as costly as any other."""
    blocks = build_blocks("mlp")
    torch.manual_seed(5)
    layers: list[nn.Module] = []
    for _ in range(30):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    blocks[-1] = nn.Sequential(*layers, nn.Linear(8, 4)).double()
    return blocks


def _profiled_as_heavy_tailed(profiled: list, real_profile):
    """``profile_blocks`` as :func:`costs_in_proportion` makes it: each block 1, the last 15."""
    return costs_in_proportion(profiled, real_profile, [1.0] * 9 + [15.0])


def test_a_v_shaped_schedule_is_balanced_by_default_given_an_example_input(monkeypatch):
    from twobp.partition import profiler, solve, stage_ranges

    profiled: list = []
    monkeypatch.setattr(
        profiler,
        "profile_blocks",
        _profiled_as_heavy_tailed(profiled, profiler.profile_blocks),
    )
    example = make_batch("mlp", 0, 2)[0]

    def stage_blocks(schedule, **options):
        pipe = Pipeline(
            _heavy_tailed_blocks(),
            loss_fn("mlp"),
            schedule=schedule,
            n_microbatches=N_MB,
            device="cpu",
            **options,
        )
        return pipe.stage_blocks

    balanced = stage_blocks("zb-v", example_input=example)
    (costs,) = profiled
    assert balanced == tuple(stage_ranges(solve(profiler.solver_costs(costs), 2).sizes))
    assert balanced[-1] == range(9, 10)  # the costly last block alone
    # With a partition given: that partition, nothing profiled.
    assert stage_blocks("zb-v", partition="uniform", example_input=example) == tuple(
        stage_ranges([5, 5])
    )
    assert len(profiled) == 1
    # Only a V: on 2 ranks, zb-v and dualpipev, not interleaved-1f1b, Chimera or DualPipe.
    v_shaped = {name for name in SCHEDULES if generate(name, 2, N_MB).is_v_shaped}
    assert v_shaped == {"zb-v", "dualpipev"}
    for name in SCHEDULES:
        want = "balanced" if name in v_shaped else None
        assert default_partition(generate(name, 2, N_MB), None, example) == want, name
        assert default_partition(generate(name, 2, N_MB), None, None) is None, name
        assert default_partition(generate(name, 2, N_MB), [5, 5], example) == [5, 5], name


def test_the_default_two_bp_splits_the_stages_a_profile_finds_it_pays_on(monkeypatch):
    from twobp.runtime.setup import two_bp_choice
    from twobp.schedule import prepare

    chosen = []
    real_choose = two_bp_choice.choose_split
    monkeypatch.setattr(
        two_bp_choice,
        "choose_split",
        lambda *a, **k: chosen.append(real_choose(*a, **k)) or chosen[-1],
    )
    example = make_batch("mlp", 0, 2)[0]
    # (On one rank interleaved-1f1b is a V: a uniform partition, not to profile twice.)
    pipe = _pipe(
        schedule="interleaved-1f1b", partition="uniform", example_input=example, num_threads=1
    )
    (choice,) = chosen
    assert pipe.two_bp_choice == choice and len(choice.split) == 2
    assert choice.step <= min(choice.fused_step, choice.split_step) * (1 + SPLIT_MARGIN)
    want = prepare("interleaved-1f1b", n_ranks=1, n_microbatches=N_MB, two_bp=choice.split)
    assert pipe.schedule == want
    # Set, or without an example input: as before (True splits every stage), nothing profiled.
    for options in ({"two_bp": True, "example_input": example}, {}):
        pipe = _pipe(schedule="interleaved-1f1b", **options)
        assert pipe.two_bp_choice is None and "+2bp:paper" in pipe.schedule.name
    assert _pipe(two_bp=False, example_input=example).schedule.name == "1f1b"
    assert len(chosen) == 1
    with pytest.raises(PipelineConfigError, match=r"two_bp=\[True\]: 1 entries for 2 stages"):
        _pipe(schedule="interleaved-1f1b", two_bp=[True])
    with pytest.raises(PipelineConfigError, match="schedule='auto', which chooses 2BP"):
        _pipe(schedule="auto", two_bp=[True, False], example_input=example)
    with pytest.raises(PipelineConfigError, match="one per stage\\) with costs='profile'"):
        _pipe(schedule="1f1b", two_bp=[True, False], costs="profile", example_input=example)
    # recompute="auto" keeps the stages given, and under a limit they fit, the schedule too.
    pipe = _pipe(
        schedule="interleaved-1f1b",
        partition="uniform",
        two_bp=[False, True],
        recompute="auto",
        memory_limit=1e9,
        example_input=example,
    )
    want = prepare("interleaved-1f1b", n_ranks=1, n_microbatches=N_MB, two_bp=(False, True))
    assert pipe.schedule == want and pipe.rebuild_choice is not None and pipe.plan is None


def test_auto_over_the_limit_splits_fewer_of_the_stages_the_profile_chose(monkeypatch):
    from twobp.runtime.setup import two_bp_choice
    from twobp.schedule import prepare
    from twobp.schedule.rebuild import rebuilt_microbatches
    from twobp.sim.split_choice import SplitChoice

    # The profile "chooses" every stage, whose stashes do not fit; fused stages hold none.
    monkeypatch.setattr(
        two_bp_choice, "choose_split", lambda *a, **k: SplitChoice((True, True), 1.0, 2.0, 1.0)
    )
    options = {
        "schedule": "interleaved-1f1b",
        "partition": "uniform",
        "recompute": "auto",
        "example_input": make_batch("mlp", 0, 2)[0],
    }
    peaks = {
        two_bp: _pipe(two_bp=two_bp, memory_limit=1e9, **options).rebuild_choice.peak
        for two_bp in (False, True)
    }
    assert peaks[False] < peaks[True]
    pipe = _pipe(memory_limit=(peaks[False] + peaks[True]) / 2, **options)
    rebuilt = pipe.rebuild_choice
    assert rebuilt is not None and rebuilt.peak == peaks[True]
    assert rebuilt.chosen_peak <= rebuilt.memory_limit < rebuilt.peak
    # One rank has no idle time for a rebuild to hide in: fewer split stages that fit as
    # they are run, and two_bp_choice names them.
    split = pipe.two_bp_choice.split
    assert rebuilt.alternative is not None, rebuilt.summary()
    assert split != (True, True) and rebuilt.rebuilds == 0
    assert not rebuilt_microbatches(pipe.schedule)
    want = prepare("interleaved-1f1b", n_ranks=1, n_microbatches=N_MB, two_bp=split)
    assert pipe.schedule == want and "instead, 0 stashes rebuilt" in rebuilt.summary()


def test_balanced_partition_solves_the_profiled_costs_and_trains(monkeypatch):
    from twobp.partition import profiler, solve, stage_ranges

    profiled: list = []
    monkeypatch.setattr(
        profiler,
        "profile_blocks",
        _profiled_as_heavy_tailed(profiled, profiler.profile_blocks),
    )
    pipe = Pipeline(
        _heavy_tailed_blocks(),
        loss_fn("mlp"),
        schedule="interleaved-1f1b",
        stages_per_rank=4,
        n_microbatches=N_MB,
        partition="balanced",
        example_input=make_batch("mlp", 0, 2)[0],
        device="cpu",
    )
    (costs,) = profiled
    assert [c.index for c in costs] == list(range(10))
    sizes = solve(profiler.solver_costs(costs), 4).sizes
    assert pipe.stage_blocks == tuple(stage_ranges(sizes))
    # The costly block has a stage of its own: the profile said so.
    assert pipe.stage_blocks[-1] == range(9, 10)

    # The pipeline trains as one process does, on its balanced stages.
    reference = nn.Sequential(*_heavy_tailed_blocks())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pipe, reference)]
    for step in range(3):
        inputs, targets = make_batch("mlp", step, 2 * N_MB)
        loss = pipe.step(inputs, targets)
        want = loss_fn("mlp")(reference(inputs), targets)
        want.backward()
        assert math.isclose(loss, float(want.detach()), rel_tol=0, abs_tol=TOL), step
        grads = {n: p.grad for n, p in pipe.named_parameters()}
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=TOL, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=0, atol=TOL, msg=name)


def test_errors_in_a_block_name_the_stage_and_action():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("bad block")

    blocks = [nn.Linear(2, 2).double(), Broken()]
    pipe = Pipeline(blocks, loss_fn("mlp"), schedule="gpipe", n_microbatches=2, device="cpu")
    with pytest.raises(ValueError, match="bad block") as info:
        pipe.step(torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))
    assert "(rank 0, stage 0, action 0F0, micro-batch(es) 0)" in info.value.__notes__


def test_load_state_dict_strict():
    pipe = _pipe()
    state = nn.Sequential(*build_blocks("mlp")).state_dict()
    pipe.load_state_dict(state)
    with pytest.raises(RuntimeError, match="missing keys"):
        pipe.load_state_dict({k: v for k, v in state.items() if k != "0.0.weight"})
    with pytest.raises(RuntimeError, match="unexpected keys"):
        pipe.load_state_dict({**state, "head.weight": torch.zeros(1)})
    result = pipe.load_state_dict({"0.0.weight": state["0.0.weight"]}, strict=False)
    assert "0.0.bias" in result.missing_keys


def test_loss_must_be_a_scalar():
    pipe = Pipeline(
        build_blocks("mlp"),
        lambda out, y: (out - y) ** 2,
        schedule="gpipe",
        n_microbatches=N_MB,
        device="cpu",
    )
    with pytest.raises(ValueError, match=r"shapes \[2, 4\]; it must return a scalar"):
        pipe.step(*make_batch("mlp", 0, 2 * N_MB))
    pipe.close()
    three = Pipeline(
        build_blocks("mlp"),
        lambda out, y: ((out - y).sum(), y.new_tensor(1.0), y.new_tensor(2.0)),
        schedule="gpipe",
        n_microbatches=N_MB,
        device="cpu",
    )
    with pytest.raises(ValueError, match=r"a tuple of tensors of shapes \[\], \[\], \[\]"):
        three.step(*make_batch("mlp", 0, 2 * N_MB))


def test_the_example_trains_in_a_world_of_one():
    example = load_script("examples/train_mlp.py")
    assert math.isfinite(example.train(steps=2))


def test_parameters_shared_by_stages_are_found_with_every_name():
    shared = nn.Linear(2, 2)
    blocks = [nn.Sequential(shared), nn.Linear(2, 2), nn.Sequential(nn.ReLU(), shared)]
    ranges = (range(0, 1), range(1, 2), range(2, 3))
    found = shared_parameters(blocks, ranges)
    assert sorted(t.names for t in found.values()) == [
        ("0.0.bias", "2.1.bias"),
        ("0.0.weight", "2.1.weight"),
    ]
    assert {t.model_stages for t in found.values()} == {(0, 2)}
    # Within one stage, sharing is no tie across stages.
    assert shared_parameters(blocks, (range(0, 3),)) == {}


def test_a_failed_step_leaves_the_pipeline_usable():
    calls = []

    def flaky_loss(out, y):
        calls.append(1)
        if len(calls) == 3:  # the third micro-batch of the first step
            raise RuntimeError("flaky")
        return loss_fn("mlp")(out, y)

    pipe = Pipeline(
        build_blocks("mlp"), flaky_loss, schedule="1f1b", n_microbatches=N_MB, device="cpu"
    )
    inputs, targets = make_batch("mlp", 0, 2 * N_MB)
    with pytest.raises(RuntimeError, match="flaky"):
        pipe.step(inputs, targets)
    pipe.zero_grad()
    loss = pipe.step(inputs, targets)
    reference = nn.Sequential(*build_blocks("mlp"))
    want = loss_fn("mlp")(reference(inputs), targets)
    want.backward()
    assert math.isclose(loss, float(want.detach()), abs_tol=TOL)
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=TOL)


def test_costs_that_cannot_be_read_say_what_to_pass(tmp_path):
    with pytest.raises(PipelineConfigError, match=r"missing.json.*not a readable cost model"):
        _pipe(costs=tmp_path / "missing.json")


def test_the_end_of_a_step_names_the_first_nonfinite_microbatch_and_its_rank():
    from twobp.runtime.base.group import Membership
    from twobp.runtime.errors import nonfinite_error
    from twobp.runtime.execution.step_end import end_step

    alone = Membership(0, 1, 1, None, None)
    losses = {3: torch.tensor(1.0), 2: torch.tensor(float("nan")), 5: torch.tensor(float("inf"))}
    end = end_step(alone, torch.device("cpu"), 5.0, losses, None)
    assert (end.first_bad, end.bad_rank, end.error) == (2, 0, None)
    assert math.isnan(end.loss)
    fine = end_step(alone, torch.device("cpu"), 5.0, {0: torch.tensor(2.0)}, None)
    assert (fine.loss, fine.first_bad, fine.bad_rank) == (2.0, -1, -1)
    text = str(nonfinite_error(1, 7, math.nan, end.first_bad, end.bad_rank))
    # The step as the progress line counts it (1-based), and its index.
    assert "step 8 (step_count 7) is nan (computed on rank 0, a last stage; micro-batch 2" in text


@pytest.mark.parametrize("two_bp", [False, True])
def test_an_input_that_requires_grad_gets_its_gradient_and_no_warning(two_bp):
    import warnings

    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(3)]
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, 4, dtype=torch.float64)
    plain = x.detach().clone().requires_grad_()
    F.mse_loss(nn.Sequential(*blocks)(plain), y).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Pipeline(blocks, F.mse_loss, "gpipe", 4, two_bp=two_bp, device="cpu") as pipe:
            pipe.step(x, y)
    assert not [w for w in caught if "not a leaf" in str(w.message)], caught
    torch.testing.assert_close(x.grad, plain.grad, rtol=0, atol=1e-12)


def test_a_v_on_one_rank_without_an_example_input_runs_uniform_without_a_warning():
    # Nothing to share the work with: built at once (on 2 ranks it balances at its first
    # step: tests/test_runtime_v_balance.py).
    import warnings

    from twobp.runtime.setup.pipeline_plan import UnbalancedPartitionWarning

    def built(schedule, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = Pipeline(
                _heavy_tailed_blocks(), loss_fn("mlp"), schedule=schedule,
                n_microbatches=N_MB, device="cpu", **options,
            )  # fmt: skip
        unbalanced = [w for w in caught if issubclass(w.category, UnbalancedPartitionWarning)]
        return pipe.partition_by, [str(w.message) for w in unbalanced]

    for schedule in ("zb-v", "dualpipev"):
        assert built(schedule) == ("uniform", [])
    by, said = built("zb-v", example_input=make_batch("mlp", 0, 2)[0])
    assert by.startswith("balanced on the example input") and not said
    by, said = built("zb-v", partition=[4, 6])
    assert by == "given" and not said
    by, said = built("1f1b")
    assert by == "uniform" and not said
