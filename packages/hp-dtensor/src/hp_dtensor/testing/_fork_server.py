"""The fork server every pool worker starts from, and what it imports once when it starts."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import warnings
from pathlib import Path

#: Modules imported once by the fork server, so each new pool starts without re-importing torch
#: (and pytest, which every test module a worker loads imports).
_BASE = ["torch", "torch.distributed", "torch.distributed.tensor", "hp_dtensor", "pytest"]
#: The stack's packages, preloaded when the test process has imported them.
_PACKAGES = ["hp_fsdp", "hp_tp", "hp_pp", "hp_cp_ep", "hp_dcp", "hp_kernels", "hp_trainer"]
#: The module the server imports to run the requested files (found through this variable,
#: which the server removes from its environment once read).
_RUN_FILES = "hp_dtensor.testing._server_files"
PRELOAD_FILES_ENV = "HP_TESTING_PRELOAD_FILES"
#: What a test session asked the server to import or run too (``preload_in_workers``).
_MODULES: list[str] = []
_FILES: list[str] = []


def running() -> bool:
    """Whether this process's multiprocessing fork server has started (its preload is fixed)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return bool(getattr(server, "_forkserver_pid", None))


def request(modules: tuple[str, ...], files: tuple[str | os.PathLike[str], ...]) -> None:
    """Add to what the server imports and runs when it starts (see ``preload_in_workers``)."""
    for name in modules:
        if not isinstance(name, str) or not name:
            raise TypeError(f"preload_in_workers: expected module names, got {name!r}")
    paths = []
    for file in files:
        if not isinstance(file, str | os.PathLike) or not Path(file).is_file():
            raise ValueError(f"preload_in_workers: expected paths of Python files, got {file!r}")
        paths.append(str(Path(file).resolve()))
    new_modules = [name for name in dict.fromkeys(modules) if name not in _MODULES]
    new_files = [path for path in dict.fromkeys(paths) if path not in _FILES]
    if (new_modules or new_files) and running():
        warnings.warn(
            f"preload_in_workers: {[*new_modules, *new_files]} not preloaded: the fork server "
            "has already started (the workers do without); call it at collection (a "
            "conftest.py or a test module), before the first distributed test",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    _MODULES.extend(new_modules)
    _FILES.extend(new_files)


def preload() -> list[str]:
    """The modules the server imports when it starts, in that order (see fork_server_preload)."""
    loaded = [name for name in _PACKAGES if name in sys.modules]
    return list(dict.fromkeys([*_BASE, *loaded, *_MODULES, *([_RUN_FILES] if _FILES else [])]))


def start() -> None:
    """Start the server if it has not started, without waiting for its imports."""
    from multiprocessing import forkserver

    if running():
        return
    mp.get_context("forkserver").set_forkserver_preload(preload())
    before = os.environ.get(PRELOAD_FILES_ENV)
    os.environ[PRELOAD_FILES_ENV] = os.pathsep.join(_FILES)  # the server's environment only
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[PRELOAD_FILES_ENV]
        else:
            os.environ[PRELOAD_FILES_ENV] = before
