"""The bench's pure parts: options, variants, stage layout, order of runs, summaries."""

import pytest

from twobp.config import parse_overrides
from twobp.partition import stage_ranges
from twobp_bench import matrix
from twobp_bench.config import BenchConfig, default_microbatch_counts, resolve
from twobp_bench.matrix import Variant
from twobp_bench.stats import paired_ratios, speedup, summarize


def test_default_plan_is_the_two_llama_regimes_at_p_2p_and_8():
    plan = resolve(BenchConfig())
    assert [r.name for r in plan.regimes] == ["large", "small"]
    assert plan.microbatch_counts == (2, 4, 8)
    large, small = plan.regimes
    assert large.microbatch_size * large.overrides["seq_len"] >= 256
    assert small.microbatch_size * small.overrides["seq_len"] <= 32
    assert (large.overrides["dim"], small.overrides["dim"]) == (256, 512)
    # The 2BP limit reference is measured where W concatenation matters: small micro-batches.
    assert "2bp-limit" in small.references and "2bp-limit" not in large.references
    # schedule="auto" runs too: its target is evaluated by default.
    assert "auto" in plan.schedules


def test_quick_plan_is_tiny_and_overrides_reach_every_regime():
    plan = resolve(BenchConfig(quick=True, overrides="n_layers=3"))
    assert [r.name for r in plan.regimes] == ["quick"]
    assert plan.regimes[0].overrides["n_layers"] == 3
    assert plan.microbatch_counts == (2,)
    assert plan.rounds <= 2
    other = resolve(BenchConfig(model=["bert"], microbatch_size=3))
    assert [(r.name, r.microbatch_size) for r in other.regimes] == [("bert-tiny", 3)]
    # Several families in one run: llama's regimes, then each other family's preset.
    mixed = resolve(BenchConfig(model=["llama", "resnet", "bert"], size="small"))
    assert [(r.family, r.name) for r in mixed.regimes] == [
        ("llama", "large"), ("llama", "small"), ("resnet", "resnet-small"), ("bert", "bert-small"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "option"),
    [
        (BenchConfig(schedules=["nope"]), "--schedules"),
        (BenchConfig(torch_schedules=["Schedule1F1B"]), "--torch-schedules"),
        (BenchConfig(policies=["late"]), "--policies"),
        (BenchConfig(regimes=["huge"]), "--regimes"),
        (BenchConfig(warmup=0), "--warmup"),
        (BenchConfig(overrides="dim"), "--overrides"),
        (BenchConfig(model=["gpt"]), "--model: unknown family 'gpt'"),
        (BenchConfig(model=[]), "--model: give at least one family"),
        (BenchConfig(cprofile="twobp 1f1b+2bp:eager"), "--cprofile: no variant"),
        (BenchConfig(cprofile="baseline 1f1b"), "--cprofile: no variant"),
    ],
)
def test_bad_options_name_the_option(cfg, option):
    with pytest.raises(ValueError, match=option):
        resolve(cfg)


def test_overhead_mode_is_one_schedule_with_and_without_2bp_unless_chosen():
    plan = resolve(BenchConfig(overhead=True, baseline="HEAD~1", cprofile="baseline 1f1b+2bp"))
    assert plan.schedules == ("1f1b",)
    assert plan.policies == ("paper", "eager")
    assert plan.torch_schedules == ()
    assert not plan.simulate
    assert plan.baseline == "HEAD~1" and plan.baseline_path is None
    assert plan.cprofile == "baseline 1f1b+2bp" and plan.cprofile_dir == "runs/bench/cprofile"
    chosen = resolve(BenchConfig(overhead=True, schedules=["gpipe"], torch_schedules=["GPipe"]))
    assert (chosen.schedules, chosen.torch_schedules) == (("gpipe",), ("GPipe",))
    # Both modes: the tiny model, with the overhead matrix.
    both = resolve(BenchConfig(overhead=True, quick=True))
    assert [r.name for r in both.regimes] == ["quick"] and both.schedules == ("1f1b",)


def test_parse_overrides_reads_numbers():
    assert parse_overrides("dim=128, norm_eps=1e-6,name=x") == {
        "dim": 128,
        "norm_eps": 1e-6,
        "name": "x",
    }
    assert parse_overrides("") == {}
    assert default_microbatch_counts(4) == (4, 8)


def test_variants_pair_each_fused_schedule_with_and_without_2bp():
    variants = matrix.build_variants(["1f1b", "zb-v"], ["GPipe", "1F1B"], ["paper", "fill"])
    labels = [v.label for v in variants]
    # Compared variants run next to each other: each twobp schedule with torch's of the same order.
    assert labels == [
        "twobp 1f1b",
        "twobp 1f1b+2bp",
        "twobp 1f1b+2bp:fill",
        "torch 1F1B",
        "twobp zb-v",
        "torch GPipe",
        "reference microbatched",
        "reference whole-batch",
        "reference 2bp-limit",
    ]
    assert len(set(labels)) == len(labels)
    only_2bp = matrix.build_variants(["gpipe"], [], ["paper"], without_2bp=False, references=())
    assert [v.label for v in only_2bp] == ["twobp gpipe+2bp"]
    some = matrix.build_variants([], ["GPipe"], [], references=["whole-batch"])
    assert [v.label for v in some] == ["torch GPipe", "reference whole-batch"]
    with pytest.raises(ValueError, match="unknown reference"):
        matrix.build_variants([], [], [], references=["fastest"])


def test_baseline_variants_run_next_to_their_twobp_counterparts():
    variants = matrix.build_variants(["1f1b"], ["1F1B"], ["paper"], references=(), baseline=True)
    assert [v.label for v in variants] == [
        "twobp 1f1b",
        "twobp 1f1b+2bp",
        "baseline 1f1b",
        "baseline 1f1b+2bp",
        "torch 1F1B",
    ]
    assert variants[3].fused == variants[2]
    assert matrix.placement(variants[3], 2) == matrix.placement(variants[1], 2)
    reason = matrix.twobp_refusal(Variant("baseline", "interleaved-1f1b"), 2, 3)
    assert reason is not None and "interleaved" in reason


def test_auto_is_one_variant_that_chooses_its_layout_when_built():
    variants = matrix.build_variants(
        ["1f1b", "auto", "auto-m"], ["1F1B"], ["paper"], references=(), baseline=True,
        recomputes=(None, "all"),
    )  # fmt: skip
    autos = [v for v in variants if matrix.is_auto(v)]
    # One each, whatever the policies and recompute modes: it chooses its own; no baseline
    # copy. auto-m chooses the micro-batch count too.
    assert [v.label for v in autos] == ["twobp auto", "twobp auto-m"]
    auto = autos[0]
    assert matrix.placement(auto, 2) == () and matrix.model_stages(auto, 2) == 0
    assert matrix.twobp_refusal(auto, 2, 3) is None
    assert not matrix.is_auto(Variant("twobp", "1f1b"))
    resolve(BenchConfig(schedules=["auto", "auto-m", "gpipe"]))  # accepted
    with pytest.raises(ValueError, match=r"choose from .*auto"):
        resolve(BenchConfig(schedules=["automatic"]))


def test_placements_match_the_schedules():
    assert matrix.placement(Variant("torch", "1F1B"), 2) == (0, 1)
    assert matrix.placement(Variant("torch", "Interleaved1F1B"), 2) == (0, 1, 0, 1)
    assert matrix.placement(Variant("torch", "ZBVZeroBubble"), 2) == (0, 1, 1, 0)
    assert matrix.placement(Variant("torch", "DualPipeV"), 3) == (0, 1, 2, 2, 1, 0)
    # twobp's zb-v puts its stages where torch's ZBV does: the same partition means the same work.
    assert matrix.placement(Variant("twobp", "zb-v", True), 2) == (0, 1, 1, 0)
    assert matrix.placement(Variant("twobp", "interleaved-1f1b"), 2) == (0, 1, 0, 1)
    assert matrix.stages_of_rank((0, 1, 1, 0), 0) == [0, 3]


def test_stage_partition_spreads_the_body_and_keeps_the_ends_outside():
    kinds = ["embedding", *["body"] * 4, "head"]
    assert matrix.stage_partition(kinds, 2) == (3, 3)
    assert matrix.stage_partition(kinds, 4) == (2, 1, 1, 2)
    assert matrix.stage_partition(kinds, 1) == (6,)
    # Too few body blocks: fall back to an even split of all blocks.
    assert matrix.stage_partition(["embedding", "body", "body", "head"], 4) == (1, 1, 1, 1)
    # With the V placement, each rank holds the same number of body blocks.
    ranges = stage_ranges(list(matrix.stage_partition(kinds, 4)))
    for rank in (0, 1):
        held = [i for s in matrix.stages_of_rank((0, 1, 1, 0), rank) for i in ranges[s]]
        assert sum(kinds[i] == "body" for i in held) == 2


def test_round_robin_alternates_variants():
    assert matrix.round_robin(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    order = matrix.round_robin(3, 4)
    assert [v for _, v in order] == [0, 1, 2] * 4


def test_twobp_refusal_says_why():
    assert matrix.twobp_refusal(Variant("twobp", "1f1b"), 2, 3) is None
    reason = matrix.twobp_refusal(Variant("twobp", "interleaved-1f1b"), 2, 3)
    assert reason is not None and "interleaved" in reason
    assert matrix.twobp_refusal(Variant("torch", "DualPipeV"), 2, 2) is None


def test_a_default_torch_schedule_that_cannot_run_at_m_is_left_out():
    """torch's DualPipeV needs m >= its 2p stages: the default matrix leaves it out at m = p
    (it runs at 2p and 8), while one the user names is reported skipped, with torch's reason."""
    dual = Variant("torch", "DualPipeV")
    assert matrix.torch_cannot_run(dual, 2, 2) and matrix.torch_cannot_run(dual, 4, 4)
    assert not matrix.torch_cannot_run(dual, 2, 4)
    assert not matrix.torch_cannot_run(Variant("torch", "ZBVZeroBubble"), 2, 2)
    assert not matrix.torch_cannot_run(Variant("twobp", "dualpipev"), 2, 2)
    assert resolve(BenchConfig()).torch_by_default
    assert resolve(BenchConfig(quick=True)).torch_by_default
    assert not resolve(BenchConfig(torch_schedules=["DualPipeV"])).torch_by_default


def test_summaries_and_paired_speedups():
    s = summarize([3.0, 1.0, 2.0, 4.0, 100.0])
    assert (s.median, s.low, s.high, s.n) == (3.0, 1.0, 100.0, 5)
    assert s.q1 == 2.0 and s.q3 == 4.0
    assert summarize([2.0]).iqr_fraction == 0.0
    inverse = s.inverse(6.0)
    assert inverse.median == 2.0 and inverse.low == 6.0 / 100.0 and inverse.high == 6.0
    assert paired_ratios([2.0, 4.0], [1.0, 1.0]) == [2.0, 4.0]
    assert speedup([2.0, 3.0, 4.0], [1.0, 1.0, 2.0]).median == 2.0
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        paired_ratios([1.0], [0.0])


def test_torch_beside_auto_m_leaves_out_the_counts_torch_refuses():
    from twobp_bench.matrix import AUTO_MICROBATCHES, TORCH, TWOBP, Variant, counts_beside_auto

    variants = [
        Variant(TWOBP, AUTO_MICROBATCHES),
        Variant(TORCH, "1F1B"),
        Variant(TORCH, "DualPipeV"),
    ]
    added = {v.label for v in counts_beside_auto(variants, 16, 2, 8)}
    # auto-m chooses among 2, 4, 8 and 16 micro-batches of a 16-sample batch on 2 ranks.
    assert added == {"torch 1F1B m=2", "torch 1F1B m=4", "torch 1F1B m=16",
                     "torch DualPipeV m=4", "torch DualPipeV m=16"}  # fmt: skip
    assert counts_beside_auto(variants[1:], 16, 2, 8) == []


def test_a_given_partition_cuts_the_variants_with_that_many_stages_only():
    from twobp_bench.matrix import stage_partition, variant_partition

    kinds = ["embedding", "body", "body", "body", "body", "head"]
    assert variant_partition(kinds, 4, [1, 1, 1, 3]) == (1, 1, 1, 3)
    assert variant_partition(kinds, 2, [1, 1, 1, 3]) == stage_partition(kinds, 2)
    assert variant_partition(kinds, 4, None) == stage_partition(kinds, 4) == (2, 1, 1, 2)
    with pytest.raises(ValueError, match="holds 5 blocks; the model has 6"):
        variant_partition(kinds, 4, [1, 1, 1, 2])
