"""The ``hp-dcp`` command: ``convert`` (HF <-> DCP), ``inspect`` and ``verify``, all offline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hp_dcp.convert import (
    KeyMap,
    dcp_to_hf,
    describe_checkpoint,
    extract_tensor,
    format_entries,
    hf_to_dcp,
    load_key_map,
)
from hp_dcp.errors import (
    CheckpointCorruptionError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp.verify import CheckpointStatus, check_checkpoint

__all__ = ["main"]


def _key_map(args: argparse.Namespace) -> KeyMap | None:
    hook = load_key_map(args.key_map) if args.key_map else None
    strip, add = args.strip_prefix, args.add_prefix
    if hook is None and not strip and not add:
        return None

    def mapped(key: str) -> str | None:
        if strip:
            if not key.startswith(strip):
                return None
            key = key[len(strip) :]
        out = hook(key) if hook is not None else key
        return None if out is None else f"{add or ''}{out}"

    return mapped


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hp-dcp", description="Offline tools for DCP and HuggingFace checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert between HF safetensors and DCP")
    c.add_argument("direction", choices=["hf-to-dcp", "dcp-to-hf"])
    c.add_argument("src", type=Path)
    c.add_argument("dst", type=Path)
    c.add_argument("--key-map", help="'package.module:function' renaming each key (None drops)")
    c.add_argument("--strip-prefix", default="", help="keep only keys with it, removing it")
    c.add_argument("--add-prefix", default="", help="prefix added to every key")
    c.add_argument("--max-shard-size", default="5GB", help="largest HF file (dcp-to-hf)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("inspect", help="list a DCP checkpoint's entries, or extract one tensor")
    i.add_argument("path", type=Path)
    i.add_argument("--tensor", help="print one tensor's summary (and save it with --output)")
    i.add_argument("--output", type=Path, help="where to save --tensor (.pt or .safetensors)")
    v = sub.add_parser(
        "verify",
        help="report whether a checkpoint is complete, verified, unverified, corrupt or unsafe",
        description="Exit status: 0 verified, 2 unverified (complete, no checksums), 3 corrupt, "
        "4 incomplete, 5 unsafe, 1 other errors (e.g. no such path).",
    )
    v.add_argument("path", type=Path)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hp-dcp`` command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The process exit status: 0, or 1 after printing a one-line error (a damaged, incomplete
        or unsafe checkpoint, a missing path or key, a bad argument). ``verify`` returns the
        :class:`hp_dcp.CheckpointStatus` value: 0 verified, 2 unverified (complete, written
        without checksums), 3 corrupt, 4 incomplete, 5 unsafe (and 1 for a missing path).

    See Also:
        :pt:`torch.distributed.checkpoint.format_utils`: PyTorch's offline conversion helpers.
    """
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (
        CheckpointCorruptionError,
        IncompleteCheckpointError,
        UnsafeCheckpointError,
        FileNotFoundError,
        KeyError,
        ValueError,
    ) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hp-dcp: error: {message}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "convert":
        key_map = _key_map(args)
        if args.direction == "hf-to-dcp":
            n = hf_to_dcp(args.src, args.dst, key_map=key_map, progress=not args.no_progress)
            print(f"wrote {n} tensors to DCP checkpoint {args.dst}")
        else:
            n, skipped = dcp_to_hf(
                args.src,
                args.dst,
                key_map=key_map,
                max_shard_size=args.max_shard_size,
                progress=not args.no_progress,
            )
            print(f"wrote {n} tensors to HF checkpoint {args.dst}")
            if skipped:
                print(f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:8])}")
        return 0
    if args.command == "verify":
        report = check_checkpoint(args.path)
        print(f"{report.status.name.lower()}: {report.path}")
        if report.bad_file is not None:
            item = f", item {report.bad_item!r}" if report.bad_item is not None else ""
            print(f"  first bad file: {report.bad_file}{item}")
        print(f"  {report.message}")
        return report.status.value if report.status != CheckpointStatus.VERIFIED else 0
    if args.tensor:
        t = extract_tensor(args.path, args.tensor)
        stats = ""
        if t.numel() and not t.is_complex():
            f = t.double()
            stats = f" min {f.min().item():.6g} max {f.max().item():.6g} mean {f.mean().item():.6g}"
        print(f"{args.tensor}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}{stats}")
        if args.output is not None:
            if args.output.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file({args.tensor: t.contiguous()}, str(args.output))
            else:
                torch.save(t, args.output)
            print(f"saved to {args.output}")
        return 0
    for line in format_entries(describe_checkpoint(args.path)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
