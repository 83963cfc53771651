"""``preload_in_workers``: the fork server imports the named modules and runs the named files
once, and the workers of every pool start with what they left; names and paths are checked, and
a request after the server started warns and is not recorded."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from hp_dtensor.testing import fork_server_preload, preload_in_workers, run_distributed

#: A standard-library module nothing in the stack or its test tools imports: in a worker it can
#: only come from the fork server's preload.
_PROBE = "wave"
_FILE = Path(__file__).with_name("_preload_probe.py")  # marks the module in the server
preload_in_workers(_PROBE, files=[_FILE])  # at collection, before the first distributed test


def _preloaded(name: str) -> tuple[bool, bool]:
    module = sys.modules.get(name)
    return module is not None, bool(getattr(module, "HP_TESTING_PRELOADED", False))


def test_a_requested_module_and_file_are_in_every_worker_before_its_first_job() -> None:
    assert _PROBE not in sys.modules  # never imported by the test process itself
    preload = fork_server_preload()
    assert preload[:4] == ["torch", "torch.distributed", "torch.distributed.tensor", "hp_dtensor"]
    assert preload.index(_PROBE) < preload.index("hp_dtensor.testing._server_files")
    assert run_distributed(_preloaded, 3, _PROBE) == [(True, True)] * 3
    assert run_distributed(_preloaded, 3, "nntplib") == [(False, False)] * 3


def test_names_are_checked_and_a_request_after_the_start_warns(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"expected module names, got 3"):
        preload_in_workers("json", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected module names, got ''"):
        preload_in_workers("")
    with pytest.raises(ValueError, match=r"expected paths of Python files, got .*nope.py"):
        preload_in_workers(files=[tmp_path / "nope.py"])
    run_distributed(_preloaded, 2, _PROBE)  # the server runs from here on
    before = fork_server_preload()
    with pytest.warns(RuntimeWarning, match=r"\['nntplib'\] not preloaded: the fork server has"):
        preload_in_workers("nntplib")
    assert fork_server_preload() == before  # not recorded: the server never imports it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preload_in_workers(_PROBE, files=[_FILE])  # already requested: nothing to say
