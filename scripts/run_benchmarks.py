"""Run every benchmark under ``benchmarks/`` (``hatch run bench``); each writes its own results.

Benchmarks time ours against PyTorch's implementation of the same job in one process and report
ratios (ours / torch) under ``benchmarks/results/``. Pass names to run a subset:
``hatch run bench fsdp_vs_torch``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def main() -> int:
    wanted = set(sys.argv[1:])
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    unknown = wanted - {p.stem for p in scripts}
    if unknown:
        print(f"unknown benchmarks {sorted(unknown)}; have {[p.stem for p in scripts]}")
        return 2
    failed = []
    for script in scripts:
        if wanted and script.stem not in wanted:
            continue
        print(f"=== {script.stem} ===", flush=True)
        if subprocess.call([sys.executable, str(script)]) != 0:
            failed.append(script.stem)
    if failed:
        print(f"benchmarks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
