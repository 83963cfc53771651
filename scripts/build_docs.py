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
    # Generate the autosummary stubs before the build: stubs written during the build itself are
    # found too late for the toctree ("document isn't included in any toctree").
    sources = [
        str(p) for p in sorted(docs.rglob("*.rst")) if not {"_build", "_templates"} & set(p.parts)
    ]
    autogen = [
        sys.executable,
        "-m",
        "sphinx.ext.autosummary.generate",
        "-t",
        str(docs / "_templates"),
        *sources,
    ]
    code = subprocess.call(autogen, env=env)
    if code != 0:
        return code
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-n",
        "-W",
        "--keep-going",
        "-b",
        "html",
        str(docs),
        str(docs / "_build" / "html"),
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
