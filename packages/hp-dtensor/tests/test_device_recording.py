"""The recording stream/event double of the device layer (used to test stream ordering)."""

from __future__ import annotations

import torch

from hp_dtensor import device


def test_recording_streams_log_waits_records_and_current_stream() -> None:
    log = device.StreamLog()
    side = device.RecordingStream("side", log)
    compute = device.RecordingStream("compute", log)
    side.wait_stream(compute)
    assert log.current == "compute"
    with device.stream(side):
        log.mark("copy")
        side.record_tensor(torch.zeros(1))
        event = side.record_event()
    log.mark("use")
    event.wait()  # the current (compute) stream waits
    compute.wait_event(device.RecordingEvent("external", log))
    event.synchronize()
    assert log.ran_on == {"copy": ["side"], "use": ["compute"]}
    assert log.entries == [
        ("wait_stream", "side", "compute"),
        ("enter", "side"),
        ("record_tensor", "side"),
        ("record", "side_event", "side"),
        ("leave", "side"),
        ("wait_event", "compute", "side_event"),
        ("wait_event", "compute", "external"),
        ("synchronize", "side_event"),
    ]
    assert log.count("synchronize") == 1
    assert side != compute


def test_plain_cpu_streams_keep_no_op_behaviour() -> None:
    s = device.Stream("cpu")
    s.record_tensor(torch.zeros(1))  # no-op on the CPU
    with device.stream(s):
        pass
    event = device.Event("cpu")
    assert event.native is None
