"""Analytic decoder costs against published architectures."""

import pytest

from twobp.sim.analytic import decoder_shape
from twobp.sim.analytic.shapes import block_costs

# LLaMA-2 parameter counts: the Hugging Face checkpoints (meta-llama/Llama-2-*-hf),
# Touvron et al. 2023, Table 1 (7B, 13B, 70B).
PUBLISHED_PARAMS = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}


@pytest.mark.parametrize("size", sorted(PUBLISHED_PARAMS))
def test_llama2_parameter_counts(size: str) -> None:
    assert decoder_shape("llama", size).params == PUBLISHED_PARAMS[size]


@pytest.mark.parametrize("size", sorted(PUBLISHED_PARAMS))
def test_weight_flops_are_six_params_per_token(size: str) -> None:
    shape = decoder_shape("llama", size)
    block = block_costs(shape, seq_len=1, microbatch=1)
    weights = shape.layers * (block.forward_matmul + block.input_matmul + block.weight_matmul)
    head = 6 * shape.vocab * shape.hidden
    assert weights + head == pytest.approx(6 * PUBLISHED_PARAMS[size], rel=0.02)


def test_a_device_fitted_to_its_own_times_gives_them_back() -> None:
    from twobp.sim.analytic import HARDWARE
    from twobp.sim.analytic.calibrate import fit_hardware

    shape = decoder_shape("llama", "7b")
    block = block_costs(shape, seq_len=512, microbatch=1, dtype="float32")
    truth = HARDWARE["a100-80g"]
    seconds = truth.seconds

    def times(device):
        f = device.seconds(block.forward_matmul, "matmul", "float32") + device.seconds(
            block.forward_attention, "attention", "float32"
        )
        i = device.seconds(block.input_matmul, "matmul", "float32") + device.seconds(
            block.input_attention, "attention", "float32"
        )
        return f, i, device.seconds(block.weight_matmul, "matmul", "float32")

    measured = times(truth)
    assert measured[2] == seconds(block.weight_matmul, "matmul", "float32")
    fitted = fit_hardware(HARDWARE["cpu"], block, [measured, measured], name="x", source="y")
    f, i, w = times(fitted)
    assert w == pytest.approx(measured[2], rel=1e-12)
    assert f + i == pytest.approx(measured[0] + measured[1], rel=1e-12)
    assert fitted.memory == HARDWARE["cpu"].memory and fitted.source == "y"
    with pytest.raises(ValueError, match="no measured layers"):
        fit_hardware(truth, block, [], name="x", source="y")
    with pytest.raises(ValueError, match="must be positive"):
        fit_hardware(truth, block, [(1.0, 0.0, 1.0)], name="x", source="y")
