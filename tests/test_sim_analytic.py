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
