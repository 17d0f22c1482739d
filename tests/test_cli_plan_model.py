"""`twobp plan` of a model by name, by its config.json or by its sizes, from analytic costs."""

import json
import re

import pytest

from twobp.cli.main import build_parser, main
from twobp.schedule.prepare import prepare
from twobp.sim.analytic import decoder_shape, load_hardware, plan_layouts
from twobp.sim.analytic.shapes import custom_shape, hf_shape
from twobp.sim.candidate import build_schedule
from twobp.sim.costs import CostModel

LLAMA_7B = ["plan", "--model", "llama", "--size", "7b", "--gpus", "8", "--gpu", "a100-80g"]
LAYOUT = re.compile(r"^\d\. P=(\d+) D=(\d+) T=(\d+), ")

# Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), the keys a plan reads.
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
MIXTRAL_PARAMS = 46_702_792_704  # the published checkpoint's count


def _plan(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_llama_7b_on_eight_a100_fits_and_says_how_to_run_it(capsys):
    code, out, _ = _plan([*LLAMA_7B, "--global-batch", "512", "--seq-len", "4096"], capsys)
    assert code == 0
    layouts = [LAYOUT.match(line) for line in out.splitlines() if LAYOUT.match(line)]
    assert len(layouts) == 3
    for match in layouts:
        p, d, t = (int(x) for x in match.groups())
        assert p * d * t <= 8 and p >= 2
    memory = re.findall(r"memory per rank: (.*) \(of 74.5 GiB\)", out)
    assert len(memory) == 3
    train = [line.strip() for line in out.splitlines() if line.strip().startswith("twobp train")]
    assert len(train) == 3 and all(" --model llama --size 7b " in line for line in train)
    for match, line in zip(layouts, train, strict=True):
        p, d, t = (int(x) for x in match.groups())
        assert f" --ranks {p * d * t} " in line  # the world: D x P x T
    assert out.count("Pipeline(blocks, loss_fn, schedule=") == 3
    # The options are twobp train's own.
    for line, match in zip(train, layouts, strict=True):
        args = build_parser().parse_args(line.split()[1:])
        assert args.command == "train" and args.size == "7b"
        assert getattr(args, "tensor_parallel", 1) == int(match.group(3))
    only = [*LLAMA_7B, "--global-batch", "512", "--seq-len", "4096", "--tensor-parallel", "1"]
    code, out, _ = _plan(only, capsys)
    assert code == 0
    assert {m.group(3) for m in map(LAYOUT.match, out.splitlines()) if m} == {"1"}


def test_the_options_printed_run_the_schedule_that_was_simulated():
    """A schedule split by its own design (zb-v) simulated as generated runs with
    two_bp=True; two_bp=False would merge its backward into B."""
    shape = decoder_shape("llama", "7b")
    layouts = plan_layouts(shape, load_hardware("a100-80g"), 8, 512, 4096)
    for layout in layouts[:3]:
        c = layout.candidate
        simulated, _ = build_schedule(
            c.schedule,
            layout.pipeline,
            layout.microbatches,
            c.stages_per_rank,
            c.policy,
            CostModel.uniform(layout.pipeline),
            data_parallel=layout.data,
        )
        words = layout.pipeline_options()
        two_bp = "two_bp=True" in words
        policy = re.search(r"two_bp_policy='(\w+)'", words)
        run = prepare(
            c.schedule,
            n_ranks=layout.pipeline,
            n_microbatches=layout.microbatches,
            two_bp=two_bp,
            policy=policy.group(1) if policy else "paper",
            stages_per_rank=c.stages_per_rank,
            data_parallel=layout.data,
        )
        assert run.actions == simulated.actions, words


def test_llama_70b_plans_tensor_and_pipeline_layouts(capsys):
    argv = ["plan", "--model", "llama", "--size", "70b", "--gpus", "16", "--gpu", "h100"]
    code, out, _ = _plan([*argv, "--global-batch", "32", "--seq-len", "2048"], capsys)
    assert code == 0
    assert "llama-70b (68.98B parameters) on 16 x h100" in out
    assert any(int(m.group(3)) > 1 for m in map(LAYOUT.match, out.splitlines()) if m)


def test_a_custom_decoder_by_its_sizes(capsys):
    sizes = ["--layers", "8", "--hidden", "1024", "--heads", "8", "--ffn", "2816"]
    argv = ["plan", *sizes, "--vocab", "32000", "--gpus", "4", "--gpu", "h100"]
    code, out, _ = _plan([*argv, "--global-batch", "32", "--seq-len", "1024"], capsys)
    assert code == 0
    params = custom_shape("x", layers=8, hidden=1024, heads=8, ffn=2816, vocab=32000).params
    assert out.startswith(f"custom decoder ({params / 1e9:.2f}B parameters) on 4 x h100")
    assert "twobp train" not in out  # no preset to name: the Pipeline keywords only
    assert "Pipeline(blocks, loss_fn" in out


def test_sizes_given_with_a_preset_replace_its_own(capsys):
    code, out, _ = _plan([*LLAMA_7B, "--layers", "16", "--global-batch", "64"], capsys)
    assert code == 0
    halved = custom_shape("x", layers=16, hidden=4096, heads=32, ffn=11008, vocab=32000)
    assert out.startswith(f"llama-7b (changed) ({halved.params / 1e9:.2f}B parameters)")
    assert "twobp train" not in out


def test_a_hugging_face_config(tmp_path, capsys):
    path = tmp_path / "mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL))
    assert hf_shape(MIXTRAL, "mixtral").params == pytest.approx(MIXTRAL_PARAMS, rel=1e-3)
    argv = ["plan", "--hf-config", str(path), "--gpus", "16", "--gpu", "h100"]
    code, out, _ = _plan([*argv, "--global-batch", "32", "--seq-len", "2048"], capsys)
    assert code == 0
    assert out.startswith("mixtral (46.70B parameters) on 16 x h100")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "8", "--hidden", "1024"], r"needs --heads --ffn --vocab too"),
        (
            ["--layers", "8", "--hidden", "1000", "--heads", "16", "--ffn", "8", "--vocab", "8"],
            r"16 heads do not divide the width 1000",
        ),
        (["--model", "llama", "--size", "7b", "--kv-heads", "5"], r"5 key-value heads do not"),
        (["--model", "llama", "--size", "3b"], r"no analytic shapes for llama 3b; known"),
        (["--model", "llama", "--hf-config", "x.json"], r"give one"),
        (["--hf-config", "missing.json"], r"--hf-config missing.json: not a readable JSON"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(argv, message, capsys):
    code, out, err = _plan(["plan", *argv, "--gpus", "8"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_a_config_that_is_not_a_llama_like_decoder(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}))
    code, _, err = _plan(["plan", "--hf-config", str(path), "--gpus", "8"], capsys)
    assert code == 2
    assert "not a LLaMA-like decoder configuration: no num_hidden_layers, hidden_size" in err


def test_recomputation_where_nothing_fits_without_it(capsys):
    # LLaMA-13B, 8192 tokens a sequence, on 4 x 80 GB: every layout holds too much
    # without rebuilding activations.
    argv = ["plan", "--model", "llama", "--size", "13b", "--gpus", "4", "--gpu", "a100-80g"]
    code, out, _ = _plan([*argv, "--seq-len", "8192", "--global-batch", "16"], capsys)
    assert code == 0
    first = next(line for line in out.splitlines() if LAYOUT.match(line))
    assert "recompute 'activations'" in first or "recompute 'all'" in first
    assert "--recompute " in out and "recompute='" in out
    # The same plan with 2048 tokens fits without.
    code, out, _ = _plan([*argv, "--seq-len", "2048", "--global-batch", "16"], capsys)
    assert code == 0 and "recompute" not in out
