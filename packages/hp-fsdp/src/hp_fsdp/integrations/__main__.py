"""``python -m hp_fsdp.integrations [-m module | script] [args...]``: run with the switch on.

The program runs as ``python -m module`` or ``python script`` would run it (``sys.argv`` is its
own), with :func:`hp_fsdp.integrations.use_hp_fsdp` installed first; ``torchrun`` accepts it
(``torchrun --nproc-per-node 2 -m hp_fsdp.integrations -m llamafactory.launcher cfg.yaml``).
"""

from __future__ import annotations

import runpy
import sys

from hp_fsdp.integrations import use_hp_fsdp


def main(argv: list[str]) -> None:
    """Install the switch and run ``argv`` (``-m module args...`` or ``script args...``).

    Args:
        argv: the command line after ``python -m hp_fsdp.integrations``.

    Raises:
        ValueError: when no program is given.
    """
    if not argv or argv == ["-m"]:
        raise ValueError(
            f"usage: python -m hp_fsdp.integrations [-m module | script] [args...]; got {argv!r}"
        )
    use_hp_fsdp()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
