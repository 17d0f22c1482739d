"""``twobp checkpoint``: look into a checkpoint, merge it into one state dict, convert it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from twobp.cli.errors import OneLineParser, UsageError, report_usage_error
from twobp.config import check_writable


def register(subparsers: Any) -> None:
    """Add the ``checkpoint`` sub-command."""
    parser = subparsers.add_parser(
        "checkpoint",
        help="show, merge or convert a pipeline checkpoint",
        description=(
            "Checkpoints of Pipeline.save / twobp train hold their tensors in "
            "torch.distributed.checkpoint format and a JSON manifest. 'info' prints the "
            "manifest and checks every file's size and CRC-32 (exit code 2 if one is "
            "damaged); 'merge' writes the single-process state dict that "
            "nn.Sequential(*blocks).load_state_dict takes; 'export-hf' writes the Hugging Face "
            "folder of a pipeline of integrations.transformers.blocks(model) that "
            "from_pretrained reads; 'convert' turns a checkpoint of "
            "twobp's first format (a pickle per rank) into the current one."
        ),
    )
    _add_actions(parser)


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser(
        "info", help="print what a checkpoint holds, and check that its files are intact"
    )
    info.add_argument("path", help="a checkpoint, a folder of checkpoints or a run's --out")
    info.set_defaults(func=_guarded(_info))
    merge = actions.add_parser("merge", help="write the single-process state dict (torch.save)")
    merge.add_argument("path", help="a checkpoint, a folder of checkpoints or a run's --out")
    merge.add_argument("output", help="the .pt file to write")
    merge.set_defaults(func=_guarded(_merge))
    export = actions.add_parser(
        "export-hf",
        help="write a Hugging Face save_pretrained folder from a checkpoint of a pipeline of "
        "twobp.integrations.transformers.blocks(model)",
    )
    export.add_argument("path", help="a checkpoint, a folder of checkpoints or a run's --out")
    export.add_argument("output", help="the folder to write (from_pretrained reads it)")
    export.add_argument(
        "--hf-config-file",
        default=None,
        help="the model's config.json (or a folder holding one); not needed for a checkpoint "
        "of twobp train --hf-config, whose manifest says which model it trained",
    )
    export.set_defaults(func=_guarded(_export_hf))
    convert = actions.add_parser(
        "convert", help="convert a checkpoint of the first format (rank-*.pt files)"
    )
    convert.add_argument("path", help="a checkpoint of the first format, or a folder of them")
    convert.add_argument(
        "output",
        help="the folder of checkpoints to write into (the same folder replaces it in place)",
    )
    convert.set_defaults(func=_guarded(_convert))


def _guarded(action: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``action`` with a missing or bad checkpoint reported as a mistake in the options."""

    def run(args: argparse.Namespace) -> int:
        from twobp.runtime.errors import CheckpointError

        try:
            return action(args)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from exc

    return run


def _info(args: argparse.Namespace) -> int:
    from pathlib import Path

    from twobp.runtime.state.checkpoint import integrity

    manifest = integrity.checked_manifest(args.path)
    _print_manifest(manifest)
    folder = Path(manifest["path"])
    files = manifest.get("files")
    if files is None:
        print("  files: saved before twobp recorded their sizes: checked against DCP's metadata")
    else:
        total = sum(entry["bytes"] for entry in files.values())
        print(f"  files: {len(files)}, {total:,} bytes, each checked for its size and CRC-32")
    damaged = integrity.damage(folder, manifest)
    for line in damaged:
        print(f"  damaged: {line}")
    if damaged:
        raise integrity.damaged_error(folder, damaged)
    print("  intact")
    return 0


def _print_manifest(manifest: dict[str, Any]) -> None:
    tensors = manifest["tensors"]
    n_values = sum(_numel(t["shape"]) for t in tensors.values())
    print(f"checkpoint {manifest['path']}")
    print(f"  step {manifest['step']}, written {manifest.get('created', '?')}")
    # "world_size" is the pipeline's size: data-parallel copies save one state between them.
    tensor_parallel = manifest.get("tensor_parallel", 1)
    ranks = f"{manifest['world_size']} pipeline ranks"
    if tensor_parallel > 1:
        ranks += f" x {tensor_parallel} tensor-parallel"
    print(
        f"  {ranks}, schedule {manifest['schedule']} with {manifest['n_microbatches']} "
        f"micro-batches, stages on pipeline ranks {manifest['placement']}"
    )
    if tensor_parallel > 1:
        print(f"  tensor parallel {tensor_parallel}: each rank's shards of the split tensors")
    blocks = ", ".join(f"{a}-{b - 1}" for a, b in manifest["stage_blocks"])
    print(f"  blocks per stage: {blocks}")
    print(f"  {len(tensors)} tensors, {n_values:,} values; optimizer: {manifest['optimizer']}")
    print(
        f"  format: twobp version {manifest['version']}, tensors in {manifest.get('storage', '?')}"
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _merge(args: argparse.Namespace) -> int:
    import torch

    from twobp.runtime.state.checkpoint import merge

    try:
        check_writable("output", args.output, folder=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    state = merge(args.path)
    torch.save(state, args.output)
    print(f"wrote {len(state)} tensors to {args.output}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from twobp.integrations.hf_export import ExportError, save_pretrained

    try:
        check_writable("output", args.output, folder=True)
        model = _hf_model(args.path, args.hf_config_file)
        save_pretrained(model, args.path, args.output)
    except (ValueError, ExportError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {type(model).__name__} to {args.output} (from_pretrained reads it)")
    return 0


def _hf_model(path: str, config_file: str | None) -> Any:
    """The model a checkpoint's pipeline was cut from: of ``config_file``, or of the
    ``twobp train --hf-config`` run its manifest names."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "export-hf needs the transformers extra: pip install 'twobp[transformers]'"
        ) from None
    if config_file is not None:
        config = transformers.AutoConfig.from_pretrained(config_file)
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            raise ValueError(
                f"--hf-config-file {config_file} names no model class of transformers "
                f"(architectures: {names}): write it with the model's save_pretrained, or set "
                "config.architectures to its class name (e.g. ['GPT2LMHeadModel'])"
            )
        return model_class(config)
    from twobp.runtime.state.checkpoint import read_manifest
    from twobp.train.config import TrainConfig
    from twobp.train.task import hf_model

    saved = read_manifest(path).get("meta", {}).get("config") or {}
    if not saved.get("hf_config"):
        raise ValueError(
            f"{path} is not a checkpoint of twobp train --hf-config: pass --hf-config-file "
            "<the config.json of the model whose blocks the pipeline ran>"
        )
    known = TrainConfig.__dataclass_fields__
    return hf_model(TrainConfig(**{k: v for k, v in saved.items() if k in known}))


def _convert(args: argparse.Namespace) -> int:
    from twobp.runtime.state.checkpoint.convert import convert

    try:
        check_writable("output", args.output, folder=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {convert(args.path, args.output)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``twobp checkpoint`` on its own (``python -m twobp.cli.checkpoint``)."""
    parser = OneLineParser(prog="twobp checkpoint")
    _add_actions(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        return report_usage_error("twobp checkpoint", exc)


if __name__ == "__main__":
    sys.exit(main())
