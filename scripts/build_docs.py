"""Build the Sphinx site offline with warnings as errors (``hatch run docs``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    docs = ROOT / "docs"
    for generated in docs.rglob("generated"):
        shutil.rmtree(generated)
    env = dict(os.environ)
    env.setdefault("HP_DOCS_OFFLINE", "1")
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-n",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        str(docs),
        str(docs / "_build" / "html"),
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
