"""The migration guide's snippets run: docs/migration.rst is a doctest file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the guide creates (and destroys) a default process group, which
# must not leak into the test process.
_RUNNER = """
import doctest, sys
result = doctest.testfile(sys.argv[1], module_relative=False, optionflags=doctest.ELLIPSIS)
print(f"attempted={result.attempted} failed={result.failed}")
sys.exit(1 if result.failed else 0)
"""


def test_migration_guide_snippets_run() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(ROOT / "docs" / "migration.rst")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    attempted = int(proc.stdout.rsplit("attempted=", 1)[1].split()[0])
    # Guard against a guide that silently lost its examples.
    assert attempted >= 50, proc.stdout
