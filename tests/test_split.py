"""twobp.split on models written as one nn.Module: the cuts, the errors, and 2 real ranks.

The GPT (tied head), the LLaMA-like model (rotary tables and a causal mask
built once in its forward) and the ResNet (cut by name inside a Sequential,
BatchNorm buffers) each train 2 SGD steps on 2 gloo ranks in float64 as a
pipeline of the blocks split cuts, and must match one process running the
whole model, under the model's own names; the checkpoint merges into a state
dict that the model loads with strict=True.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import twobp
from split_models import GPT, VOCAB, EarlyExit, Reversed, Shared
from split_workers import CASES, build, reference, train_all
from twobp.cut import SplitError
from twobp.runtime import PipelineConfigError, launch
from twobp.runtime.state.checkpoint import merge
from twobp.schedule.action import Action, Kind

TOL = 1e-10
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    folder = tmp_path_factory.mktemp("split")
    return launch(train_all, 2, str(folder), timeout=600), folder


def test_blocks_run_the_model_and_cut_at_every_layer():
    for model, n_blocks in ((build("gpt"), 6), (build("llama"), 6)):
        blocks = twobp.split(model)
        assert len(blocks) == n_blocks
        ids = torch.randint(0, VOCAB, (3, 5))
        out = ids
        for block in blocks:
            out = block(out)
        torch.testing.assert_close(out, model(ids), rtol=0, atol=0)


def test_the_blocks_share_the_models_parameters_and_a_tied_weight_stays_one():
    model = build("gpt")
    blocks = twobp.split(model)
    assert blocks[0].tok.weight is model.tok.weight is blocks[-1].head.weight
    assert blocks.model_names["0.tok.weight"] == ("tok.weight", "head.weight")
    assert blocks.model_names["2.blocks.1.qkv.weight"] == ("blocks.1.qkv.weight",)


def test_cut_points_by_name_inside_a_sequential():
    model = build("resnet")
    blocks = twobp.split(model, at=["layer1.1", "layer2"])
    assert len(blocks) == 3
    assert "layer1.1.conv1.weight" in dict(blocks[1].named_parameters())
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    model.eval(), blocks.eval()
    torch.testing.assert_close(blocks[2](blocks[1](blocks[0](images))), model(images))


@pytest.mark.parametrize(
    ("model", "at", "message"),
    [
        (EarlyExit(), None, r"cannot cut EarlyExit: the forward of EarlyExit cannot be traced"),
        (GPT(), ["blocks.9"], r"at= names 'blocks.9', which is not a module of GPT"),
        (GPT(), ["blocks.2", "blocks.1"], r"runs blocks.1 before blocks.2"),
        (Reversed(), None, r"cannot cut Reversed: its forward runs layers.1 before layers.0"),
        (Shared(), ["layer"], r"cannot cut Shared at layer: its forward runs it 3 times"),
        (torch.nn.Linear(2, 2), None, r"found no nn.ModuleList or nn.Sequential of layers"),
    ],
)
def test_a_model_that_cannot_be_cut_there_is_named(model, at, message):
    with pytest.raises(SplitError, match=message):
        twobp.split(model, at=at)


def test_a_whole_model_given_to_pipeline_points_to_split():
    message = r"a list of blocks; for a whole model use `twobp.split\(model\)`"
    with pytest.raises(PipelineConfigError, match=message):
        twobp.Pipeline(GPT(), torch.nn.functional.cross_entropy)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_as_the_whole_model_under_its_names(trained, name):
    results, _ = trained
    want = reference(name)
    for rank in results:
        assert rank[name]["losses"] == pytest.approx(want["losses"], rel=TOL, abs=TOL)
    state: dict[str, torch.Tensor] = {}
    for rank in results:
        state.update(rank[name]["state"])
    assert set(want["state"]) - set(state) <= {"head.weight"}  # a tied weight: once
    for key, value in state.items():
        torch.testing.assert_close(value, want["state"][key], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_the_merged_checkpoint_loads_into_the_model_strictly(trained, name):
    results, folder = trained
    merged = merge(folder / name)
    model = build(name, seed=3)
    model.load_state_dict(merged, strict=True)
    want = reference(name)["state"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL)
    for rank in results:  # and a fresh pipeline of the model loads it by those names
        for key, value in rank[name]["loaded"].items():
            torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL)


def test_parameters_are_listed_under_the_models_names(trained):
    results, _ = trained
    names = [n for rank in results for n in rank["gpt"]["names"]]
    assert "tok.weight" in names and "head.weight" not in names
    assert "blocks.3.mlp.0.weight" in names


def test_the_timeline_shows_the_waits_on_peers_and_for_the_tied_weights_reduction(trained):
    results, _ = trained
    timeline = results[0]["gpt"]["timeline"]  # the tied weight is reduced over both ranks
    compute, waits = timeline["compute"], timeline["waits"]
    for rank in (0, 1):
        mine = [(Action.parse(a).kind, start, end) for r, a, start, end in waits if r == rank]
        assert any(kind in (Kind.RECV_F, Kind.RECV_B) for kind, _, _ in mine), mine
        reductions = [(start, end) for kind, start, end in mine if kind is Kind.REDUCE]
        assert len(reductions) == 1, mine  # the wait for the all-reduce, at the end
        last_compute = max(end for r, _, _, end in compute if r == rank)
        assert reductions[0][0] >= last_compute - 1e-9
        assert all(end >= start for _, start, end in mine)


def test_a_hugging_face_model_is_pointed_to_the_integration():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(SplitError, match=r"twobp\.integrations\.transformers\.blocks\(model\)"):
        twobp.split(model)
