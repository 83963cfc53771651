"""``preload_in_workers``: the fork server imports the named modules once, and the workers of
every pool start with them; names are checked, and a request after the server started warns."""

from __future__ import annotations

import sys

import pytest

from hp_dtensor.testing import fork_server_preload, preload_in_workers, run_distributed

#: A standard-library module nothing in the stack or its test tools imports: in a worker it can
#: only come from the fork server's preload.
_PROBE = "wave"
preload_in_workers(_PROBE)  # at collection, before the first distributed test


def _imported_before_the_job(name: str) -> bool:
    return name in sys.modules


def test_a_requested_module_is_in_every_worker_before_its_first_job() -> None:
    assert _PROBE not in sys.modules  # never imported by the test process itself
    assert _PROBE in fork_server_preload()
    assert fork_server_preload()[:4] == [
        "torch",
        "torch.distributed",
        "torch.distributed.tensor",
        "hp_dtensor",
    ]
    assert run_distributed(_imported_before_the_job, 3, _PROBE) == [True, True, True]
    assert run_distributed(_imported_before_the_job, 3, "nntplib") == [False, False, False]


def test_names_are_checked_and_a_request_after_the_start_warns() -> None:
    with pytest.raises(TypeError, match=r"expected module names, got 3"):
        preload_in_workers("json", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected module names, got ''"):
        preload_in_workers("")
    run_distributed(_imported_before_the_job, 2, _PROBE)  # the server runs from here on
    before = fork_server_preload()
    with pytest.warns(RuntimeWarning, match=r"\('nntplib',\): the fork server has already start"):
        preload_in_workers("nntplib")
    assert fork_server_preload() == before  # not recorded: the server never imports it
    preload_in_workers(_PROBE)  # already requested: nothing to say
