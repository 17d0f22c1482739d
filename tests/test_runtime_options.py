"""The typed options of a pipeline: one field per keyword of ``Pipeline``, each documented."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from twobp.config import add_arguments
from twobp.runtime import Pipeline
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import (
    README_END,
    README_START,
    RESOURCES,
    PipelineOptions,
    option_help,
    options_table,
)
from twobp.train.config import TrainConfig


def test_the_pipeline_takes_exactly_the_fields_of_its_options_and_its_resources():
    signature = inspect.signature(Pipeline.__init__)
    keywords = {
        name: p.default
        for name, p in signature.parameters.items()
        if name not in ("self", "blocks", "loss_fn", "options", *RESOURCES)
    }
    fields = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    assert keywords == fields
    # The live resources are arguments, never options that a pipeline keeps.
    assert set(RESOURCES) <= set(signature.parameters)
    assert not set(RESOURCES) & set(fields)


def test_options_given_whole_and_keywords_that_change_them():
    blocks = [nn.Linear(4, 4).double() for _ in range(2)]
    x = torch.randn(4, 4, dtype=torch.float64)
    given = PipelineOptions(schedule="gpipe", n_microbatches=2, two_bp=False, timeout=7.0)
    with Pipeline(blocks, F.mse_loss, options=given) as pipe:
        assert pipe.options == given
        first = pipe.step(x, x)
        pipe.zero_grad()
    with Pipeline(blocks, F.mse_loss, options=given, timeout=9.0, two_bp=True) as again:
        assert again.options == dataclasses.replace(given, timeout=9.0, two_bp=True)
        assert again.step(x, x) == first
    with pytest.raises(PipelineConfigError, match="n_microbatches='many'"):
        Pipeline(blocks, F.mse_loss, options=dataclasses.replace(given, n_microbatches="many"))
    with pytest.raises(PipelineConfigError, match="not an option of a pipeline"):
        given.updated({"schedul": "gpipe"})


def test_every_option_is_documented():
    for f in dataclasses.fields(PipelineOptions):
        assert len(option_help(f.name)) > 20, f.name


def test_train_options_of_the_same_meaning_share_the_documentation():
    # (--two-bp is a switch of its own: no per-stage list, and its default always profiles.)
    shared = {
        "policy": "two_bp_policy",
        "weight_group_size": "weight_group_size",
        "timeout": "timeout",
        "auto_trials": "auto_trials",
    }
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
    for train_name, option in shared.items():
        assert helps[train_name] == option_help(option), train_name
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    assert "before PeerTimeoutError" in " ".join(parser.format_help().split())


def test_a_pipeline_keeps_what_it_was_built_with_and_builds_again_from_it():
    blocks = [nn.Linear(4, 4).double() for _ in range(2)]
    x = torch.randn(4, 4, dtype=torch.float64)
    with Pipeline(blocks, F.mse_loss, "gpipe", 2, two_bp=False, timeout=7.0) as pipe:
        assert pipe.options == PipelineOptions(
            schedule="gpipe", n_microbatches=2, two_bp=False, timeout=7.0
        )
        first = pipe.step(x, x)
        pipe.zero_grad()
        options = pipe.options
    with Pipeline(
        blocks, F.mse_loss, **dataclasses.replace(options, two_bp=True).keywords()
    ) as again:
        assert again.options.two_bp and again.options.timeout == 7.0
        assert again.step(x, x) == first


def test_the_readme_table_of_options_is_rendered_from_their_documentation():
    # Each option is documented once, in its field; the README shows that text.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index(README_START) + len(README_START) + 1
    end = readme.index(README_END)
    assert readme[start:end] == options_table(), "run render_readme('README.md')"
    for f in dataclasses.fields(PipelineOptions):
        assert f"| `{f.name}` |" in readme[start:end], f.name


def test_the_schedule_names_in_the_documentation_are_the_schedules():
    from twobp.schedule import SCHEDULES

    assert all(name in option_help("schedule") for name in SCHEDULES)


def test_scatter_each_w_is_refused_without_sharded_parameters_or_of_another_kind():
    blocks = [nn.Linear(4, 4).double() for _ in range(2)]
    with pytest.raises(PipelineConfigError, match="give shard_parameters=True with it"):
        Pipeline(blocks, F.mse_loss, scatter_each_w=True)
    with pytest.raises(PipelineConfigError, match="scatter_each_w='each': give False"):
        Pipeline(blocks, F.mse_loss, shard_parameters=True, scatter_each_w="each")  # type: ignore[arg-type]
