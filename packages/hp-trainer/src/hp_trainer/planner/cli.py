"""``hp-plan``: rank the layouts of a model on a cluster, write the best as a config overlay.

Usage::

    hp-plan --model llama3 --flavor 8B --world-size 64 --device h100 [--seq-len 8192]
            [--global-batch-size N] [--memory-limit-gib G] [--top 15] [--out plan.toml]
    hp-plan calibrate [--world-size 4] [--out cpu.toml]
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _calibrate(argv: list[str]) -> int:
    from hp_trainer.planner.calibrate import calibrate_device_profile

    parser = argparse.ArgumentParser(prog="hp-plan calibrate", description=__doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--out", default="", help="write the profile here (TOML)")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    profile = calibrate_device_profile(opts.world_size, name=opts.name)
    text = profile.to_toml()
    if opts.out:
        with open(opts.out, "w") as fh:
            fh.write(f"# hp-plan calibrate --world-size {opts.world_size}\n{text}")
        print(f"wrote {opts.out}")
    print(text, end="")
    print(f"# measured in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hp-plan`` (see the module docstring).

    Returns:
        0 when a layout fits, 1 when none does (the closest are printed), 2 on bad input.

    See Also:
        :titan:`torchtitan.train.main`: TorchTitan has no planner; its user picks the degrees.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return _calibrate(argv[1:])
    from hp_trainer.planner.overlay import write_overlay
    from hp_trainer.planner.search import plan_layouts

    parser = argparse.ArgumentParser(prog="hp-plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--device", default="h100", help="profile name or .toml path")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--memory-limit-gib", type=float, default=None)
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default="", help="write the best layout as a config overlay")
    opts = parser.parse_args(argv)
    try:
        result = plan_layouts(
            opts.model,
            opts.flavor,
            opts.world_size,
            opts.device,
            seq_len=opts.seq_len,
            global_batch_size=opts.global_batch_size,
            memory_limit=None if opts.memory_limit_gib is None else opts.memory_limit_gib * 2**30,
            optimizer=opts.optimizer,
        )
    except ValueError as exc:
        print(f"hp-plan: {exc}", file=sys.stderr)
        return 2
    s = result.model
    print(
        f"{s.name}: {s.total_params / 1e9:.2f}B parameters, {result.world_size} x "
        f"{result.profile.name} ({result.memory_limit / 2**30:.1f} GiB), seq {opts.seq_len}: "
        f"{result.structures} degree structures, {len(result.estimates)} layouts estimated, "
        f"{len(result.rejected)} refused, {result.seconds:.2f} s"
    )
    print(result.table(opts.top))
    best = result.best
    if best is None:
        return 1
    if opts.out:
        header = (
            f"hp-plan --model {opts.model} --flavor {opts.flavor} --world-size "
            f"{opts.world_size} --device {opts.device}\npredicted: {best.step_time:.3f} s/step, "
            f"{best.tokens_per_second_per_device:.0f} tokens/s/device, MFU "
            f"{100 * best.mfu:.1f}%, peak {best.peak_memory / 2**30:.2f} GiB"
        )
        path = write_overlay(opts.out, opts.model, opts.flavor, best, header=header)
        print(f"wrote {path}: hp-train --config {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
