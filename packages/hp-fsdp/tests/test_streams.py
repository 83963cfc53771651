"""Stream and event ordering, observed through the device layer's recording double.

On the CPU the communication streams are no-ops, so the runtime's stream logic is exercised
by substituting :class:`hp_dtensor.device.RecordingStream` streams (``CommStreams.recording``)
and checking which stream each piece of work ran on and which events each stream waited for.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from hp_dtensor.device import RecordingEvent, StreamLog
from hp_dtensor.testing import distributed, load_test_module
from hp_fsdp.state import get_state
from hp_fsdp.streams import CommStreams


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


@distributed(world_size=4)
def test_streams_and_events_order_hsdp_step() -> None:
    h = _helpers()
    cfg = h.Config(mesh_shape=(2, 2), mp="bf16", reshard=True)
    ours, theirs, _, _ = h.build_pair(cfg)
    batch = h.make_batch(1 + torch.distributed.get_rank())
    h.loss_fn(ours, batch).backward()  # lazy init
    h.loss_fn(theirs, batch).backward()
    log = StreamLog()
    state = get_state(ours)
    assert state is not None
    state.ctx.comm.streams = CommStreams.recording(log)
    ours.set_post_optim_event(RecordingEvent("post_optim", log))
    h.loss_fn(ours, batch).backward()
    h.loss_fn(theirs, batch).backward()
    h.assert_bitwise(ours, theirs, "with recording streams")

    # where each piece of work ran
    assert set(log.ran_on["all_gather_copy_in"]) == {"copy_in"}
    assert set(log.ran_on["all_gather"]) == {"all_gather"}
    assert set(log.ran_on["reduce_scatter"]) == {"reduce_scatter"}
    assert set(log.ran_on["all_reduce"]) == {"all_reduce"}
    assert set(log.ran_on["post_reduce"]) == {"all_reduce"}  # HSDP: after the all-reduce
    gathers = len(log.ran_on["all_gather"])
    assert gathers == 3 + 2  # three units forward; the root stays unsharded for backward
    # the post-optimizer event replaces the wait on the whole compute stream
    entries = log.entries
    assert entries[:2] == [
        ("wait_event", "copy_in", "post_optim"),
        ("wait_event", "all_gather", "post_optim"),
    ]
    assert ("wait_stream", "copy_in", "compute") not in entries
    # data dependencies: each all-gather waits for its copy-in; compute waits for each
    # all-gather; each all-reduce waits for its reduce-scatter; compute for each post-reduce
    assert entries.count(("wait_event", "all_gather", "all_gather_copy_in")) == gathers
    assert entries.count(("wait_event", "compute", "all_gather")) == gathers
    reductions = len(log.ran_on["reduce_scatter"])
    assert reductions == 3
    assert entries.count(("wait_stream", "reduce_scatter", "compute")) == reductions
    assert entries.count(("wait_event", "all_reduce", "reduce_scatter")) == reductions
    assert entries.count(("wait_event", "compute", "post_reduce")) == reductions
    for i, entry in enumerate(entries):  # every wait on an event follows its record
        if entry[0] == "wait_event" and entry[2] != "post_optim":
            assert any(e[:2] == ("record", entry[2]) for e in entries[:i]), (i, entry)
    # no host synchronization in a training step
    assert log.count("synchronize") == 0

    # next iteration without an event: the communication streams wait for the compute stream
    log.entries.clear()
    h.loss_fn(ours, batch).backward()
    assert log.entries[:2] == [
        ("wait_stream", "copy_in", "compute"),
        ("wait_stream", "all_gather", "compute"),
    ]
