"""Imported by the workers' fork server when it starts, if ``preload_in_workers`` was given
files: runs each once there, so every process forked from the server inherits what it built."""

from __future__ import annotations

import os
import runpy
import sys

from hp_dtensor.testing._fork_server import PRELOAD_FILES_ENV


def _run_files() -> None:
    for path in filter(None, os.environ.pop(PRELOAD_FILES_ENV, "").split(os.pathsep)):
        try:
            runpy.run_path(path, run_name="__hp_preload__")
        except Exception as exc:  # the server must go on: a failure here would stop every pool
            print(f"hp_dtensor.testing: preload file {path} failed: {exc!r}", file=sys.stderr)


_run_files()
