"""`accel merge-weights CHECKPOINT_DIRECTORY OUTPUT_PATH`: a sharded FSDP checkpoint merged into one file
(`accel.utils.merge_fsdp_weights`), as `accelerate merge-weights` does."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = (
    "Merge the shards of an FSDP checkpoint saved with SHARDED_STATE_DICT (a pytorch_model_fsdp_0/ or optimizer_0/ "
    "folder) into one model.safetensors (or pytorch_model.bin) in OUTPUT_PATH. It runs on the CPU and needs the "
    "whole state in memory."
)


def merge_command(args: argparse.Namespace) -> None:
    """Run the merge the parsed `args` describe."""
    from accel.utils.fsdp_utils import merge_fsdp_weights

    merge_fsdp_weights(
        args.checkpoint_directory,
        args.output_path,
        safe_serialization=not args.unsafe_serialization,
        remove_checkpoint_dir=args.remove_checkpoint_dir,
    )


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The command's parser: a sub-command of `subparsers` when given, else a parser of its own."""
    if subparsers is not None:
        parser = subparsers.add_parser("merge-weights", description=DESCRIPTION, help="merge sharded FSDP weights")
    else:
        parser = argparse.ArgumentParser(prog="accel merge-weights", description=DESCRIPTION)
    parser.add_argument("checkpoint_directory", help="the folder of the sharded checkpoint (it holds .metadata)")
    parser.add_argument("output_path", help="the folder to write the merged file into (created if missing)")
    parser.add_argument(
        "--unsafe_serialization",
        action="store_true",
        default=False,
        help="write pytorch_model.bin (torch.save) instead of model.safetensors",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        action="store_true",
        default=False,
        help="delete the sharded checkpoint once merged",
    )
    if subparsers is not None:
        parser.set_defaults(func=merge_command, run=run, parser=parser)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `merge-weights` sub-command of `accel`."""
    return merge_command_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """`accel merge-weights`: returns the exit code (1, with the reason, for a folder that holds no checkpoint)."""
    try:
        merge_command(args)
    except ValueError as error:
        print(f"accel merge-weights: {error}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    merge_command(merge_command_parser().parse_args())


if __name__ == "__main__":
    main()
