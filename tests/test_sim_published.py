"""The simulator and the analytic planner against published figures.

Each figure is data with its source. Where twobp's figure differs from the
published one, the test pins the difference and its docstring says why.
"""

from dataclasses import dataclass

import pytest

from twobp.schedule import generate
from twobp.sim.analytic import decoder_shape, load_hardware
from twobp.sim.analytic.layout import stage_costs
from twobp.sim.analytic.shapes import block_costs
from twobp.sim.candidate import simulate_candidate
from twobp.sim.costs import CostModel
from twobp.sim.simulate import simulate


@dataclass(frozen=True)
class Published:
    """A figure and where it was published."""

    what: str
    source: str


ONE_F_ONE_B = Published(
    "1F1B bubble fraction (p - 1) / (m + p - 1)",
    "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM', SC 2021, section 2.2.1",
)
ZB_H1 = Published(
    "ZB-H1 bubble rate (p - 1) / (3m) at T_F = T_B = T_W (bubble over the compute m(F + B + W))",
    "Qi et al., 'Zero Bubble Pipeline Parallelism', ICLR 2024, section 2.1 and Table 1",
)
DUALPIPE = Published(
    "bubble and memory per device: 1F1B (PP-1)(F+B), 1x parameters, PP activations; "
    "ZB1P (PP-1)(F+B-2W), 1x, PP; DualPipe (PP/2-1)(F&B+B-3W), 2x, PP+1 on PP devices; "
    "DualPipeV the same on PP/2 devices (PP: pipeline stages, F and B of one chunk)",
    "github.com/deepseek-ai/DualPipe README, 'Pipeline Bubbles and Memory Usage Comparison'; "
    "DeepSeek-V3 Technical Report (arXiv 2412.19437), Table 2",
)
TWO_BP_PAPER = Published(
    "1.70x throughput with 2BP, LLaMA-7B-like transformer, 4 GPUs, 1F1B-1",
    "Rae, Lee, Richings, '2BP: 2-Stage Backpropagation', arXiv 2405.18047, 2024",
)


def _run(name: str, p: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0):
    schedule = generate(name, p, m)
    costs = CostModel.uniform(p, f, i, w).for_schedule(schedule.n_stages, schedule.n_pipelines)
    return simulate(schedule, costs)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_one_f_one_b_bubble(p: int, m: int) -> None:
    assert _run("1f1b", p, m).bubble_ratio == pytest.approx((p - 1) / (m + p - 1)), ONE_F_ONE_B


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 12), (8, 8), (8, 24)])
def test_zb_h1_bubble_rate(p: int, m: int) -> None:
    result = _run("zb-h1", p, m)
    compute = 3 * m  # m (F + B + W) with B the input gradient (I)
    for idle in result.idle:
        assert idle / compute == pytest.approx((p - 1) / (3 * m)), ZB_H1


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipe", "dualpipev"])
@pytest.mark.parametrize("p", [4, 6, 8])
def test_dualpipe_table_memory(name: str, p: int) -> None:
    """Activations per device in chunks (one stage's activations of one micro-batch),
    parameters per device against a 1F1B device's, as the README counts them."""
    schedule = generate(name, p, 4 * p)
    costs = CostModel.uniform(p).for_schedule(schedule.n_stages, schedule.n_pipelines)
    result = simulate(schedule, costs)
    stages = schedule.n_stages // schedule.n_pipelines  # PP: stages of one pipeline
    chunk = p / stages  # a chunk's activations, in a 1F1B stage's
    published = {"1f1b": stages, "zb-h1": stages, "dualpipe": stages + 1, "dualpipev": stages + 1}
    # 1F1B's first device holds PP; ZB1P's and DualPipe's every device.
    assert max(result.peak_memory) / chunk == pytest.approx(published[name]), DUALPIPE
    # Parameters in chunks (a stage of the PP-stage model), as many as a 1F1B device's.
    held = [list(schedule.placement).count(rank) for rank in range(p)]
    expected = 2.0 if name.startswith("dualpipe") else 1.0
    assert held == pytest.approx([expected] * p), DUALPIPE


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("p", [4, 6, 8])
@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (1, 1.5, 0.5), (1, 2, 1)])
def test_dualpipe_table_bubble(name: str, p: int, f: float, i: float, w: float) -> None:
    """Idle time per device against (PP/2 - 1)(F&B + B - 3W).

    The README counts an F and a B that run overlapped as one unit, ``F&B``; twobp
    runs them as two actions, so a device may start a B whose gradient has
    come while the F of the pair still waits for its input. Without overlap
    (``F&B = F + B``) every device here idles at most the published bubble,
    and at ``F = I = W`` exactly ``(PP/2 - 1)(F + B - 2W)``, the published
    figure less ``(PP/2 - 1) I``: the wait the pairing adds.
    """
    result = _run(name, p, 4 * p, f, i, w)
    schedule = generate(name, p, 4 * p)
    stages = schedule.n_stages // schedule.n_pipelines
    share = p / stages  # a chunk's share of a 1F1B stage's work
    chunk_f, chunk_b, chunk_w = f * share, (i + w) * share, w * share
    published = (stages / 2 - 1) * ((chunk_f + chunk_b) + chunk_b - 3 * chunk_w)
    assert max(result.idle) <= published + 1e-9, DUALPIPE
    if f == i == w:
        unpaired = (stages / 2 - 1) * (chunk_f + chunk_b - 2 * chunk_w)
        assert result.idle == pytest.approx((unpaired,) * p)
        assert published - unpaired == pytest.approx((stages / 2 - 1) * i * share)


def test_two_bp_paper_setting() -> None:
    """LLaMA-7B on 4 devices, 1F1B-1 (m = p = 4), 2BP against none.

    Reordering alone gains at most 21/15 = 1.40x there (equal F, I and W: the
    2BP paper's Figure 1). LLaMA-7B's analytic costs put attention's whole
    backward into I, so W is smaller than I and the gain is less: 1.29-1.38x
    over sequence lengths 512-4096. The paper's 1.70x is beyond what any
    placement of these costs gives; the rest is in the operations' own
    speed, which the analytic model leaves at their FLOPs: one concatenated
    W over all micro-batches running faster than separate ones, and the
    baseline's own backward (measured by the paper, not modelled here).
    """
    shape = decoder_shape("llama", "7b")
    device = load_hardware("a100-80g")
    ratios = []
    for seq_len in (512, 1024, 2048, 4096):
        block = block_costs(shape, seq_len, 1, "bfloat16", 1)
        costs, _ = stage_costs(shape, device, block, 4, 1, "bfloat16")
        without, _ = simulate_candidate("1f1b", "off", 4, 4, costs)
        with_2bp, _ = simulate_candidate("1f1b", "paper", 4, 4, costs)
        ratios.append(without.makespan / with_2bp.makespan)
    equal, _ = simulate_candidate("1f1b", "off", 4, 4, CostModel.uniform(4))
    equal_2bp, _ = simulate_candidate("1f1b", "paper", 4, 4, CostModel.uniform(4))
    bound = equal.makespan / equal_2bp.makespan
    assert bound == pytest.approx(21 / 15)
    assert all(1.25 < r < bound for r in ratios), (ratios, TWO_BP_PAPER)
    # Longer sequences put more of the step into attention (all in I): less gain.
    assert ratios == sorted(ratios, reverse=True)
    assert max(ratios) < 1.70
