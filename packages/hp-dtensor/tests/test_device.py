"""The device layer on the CPU (accelerator paths run only where an accelerator exists)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import device

needs_accelerator = pytest.mark.skipif(
    not torch.accelerator.is_available(), reason="needs an accelerator"
)


def test_device_type_and_backends_on_cpu() -> None:
    assert device.get_device_type() == device.DEVICE_TYPE_CPU
    assert device.get_device() == torch.device("cpu")
    assert device.get_default_backend() == device.BACKEND_GLOO
    assert device.get_default_backend("cpu") == "gloo"
    assert device.get_default_backend(device.DEVICE_TYPE_CUDA) == device.BACKEND_NCCL
    assert device.get_default_backend(device.DEVICE_TYPE_NPU) == device.BACKEND_HCCL
    assert device.get_default_backend(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="no collective backend is known for device type 'meta'"):
        device.get_default_backend("meta")
    with pytest.raises(TypeError, match="expected a device type string"):
        device.get_default_backend(3)  # type: ignore[arg-type]
    assert device.dispatch_key_for("cpu") == device.DISPATCH_KEY_CPU == "CPU"
    assert device.dispatch_key_for(device.DEVICE_TYPE_NPU) == "PrivateUse1"
    with pytest.raises(ValueError, match="no dispatch key"):
        device.dispatch_key_for("meta")
    assert not device.is_accelerator("cpu")
    assert not device.is_accelerator("meta")
    assert device.is_accelerator(device.DEVICE_TYPE_CUDA)
    assert device.device_count("cpu") == 1
    assert not device.pin_memory_available()
    device.set_device(0)
    with pytest.raises(ValueError, match="single device index 0, got index 1"):
        device.set_device(1)
    device.synchronize()
    device.synchronize("cpu")


def test_npu_plugin_absent_is_handled() -> None:
    assert not device.is_npu_available()
    assert "torch_npu" not in sys.modules  # nothing was imported
    assert device.get_device_type() == "cpu"


def test_npu_plugin_is_imported_lazily_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []

    class FakeSpec:
        pass

    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: FakeSpec())
    monkeypatch.setattr(
        device.importlib, "import_module", lambda name: imported.append(name) or sys
    )
    assert not device.is_npu_available()  # the plug-in "loads" but torch has no npu module
    assert imported == ["torch_npu"]


def test_cpu_streams_and_events_are_logged_no_ops(caplog: pytest.LogCaptureFixture) -> None:
    device._LOGGED.clear()
    with caplog.at_level(logging.DEBUG, logger="hp_dtensor.device"):
        s1 = device.Stream()
        s2 = device.Stream("cpu", priority=-1)
        event = s1.record_event()
        s2.wait_event(event)
        s2.wait_stream(s1)
        event.wait(s2)
        event.synchronize()
        s1.synchronize()
        with device.stream(s1):
            x = torch.ones(2) + 1
    assert torch.equal(x, torch.full((2,), 2.0))
    assert event.query()
    assert s1.native is None
    assert event.native is None
    assert device.current_stream() == s1
    messages = [r.getMessage() for r in caplog.records if r.name == "hp_dtensor.device"]
    assert sum("streams are no-ops" in m for m in messages) == 1  # logged once, at debug level
    assert sum("events are no-ops" in m for m in messages) == 1
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "hp_dtensor.device")
    with pytest.raises(RuntimeError, match="event timing needs an accelerator"):
        event.elapsed_time(device.Event())
    with caplog.at_level(logging.DEBUG, logger="hp_dtensor.device"):
        device.empty_cache()
        device.empty_cache()
    assert sum("empty_cache is a no-op" in r.getMessage() for r in caplog.records) == 1


def test_cpu_memory_stats_track_peak_rss() -> None:
    stats = device.memory_stats()
    assert set(stats) == {"allocated", "peak_allocated", "reserved"}
    assert stats["peak_allocated"] >= stats["allocated"] > 0
    device.reset_peak_memory_stats()
    base = device.peak_memory_bytes()
    big = torch.ones(48 * 1024 * 1024 // 4)  # 48 MiB, touched
    grown = device.peak_memory_bytes()
    del big
    assert grown - base >= 40 * 1024 * 1024
    device.reset_peak_memory_stats()
    assert device.peak_memory_bytes() < grown


def test_init_and_destroy_process_group_choose_gloo() -> None:
    assert not dist.is_initialized()
    store = dist.HashStore()
    device.init_process_group(store=store, world_size=1, rank=0)
    try:
        assert dist.get_backend() == "gloo"
        with pytest.raises(RuntimeError, match="already initialized"):
            device.init_process_group(store=store, world_size=1, rank=0)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        device.destroy_process_group()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="nothing to destroy"):
        device.destroy_process_group()


@needs_accelerator
def test_accelerator_streams_events_and_memory() -> None:  # pragma: no cover - needs a device
    kind = device.get_device_type()
    assert device.is_accelerator(kind)
    assert device.get_default_backend() in (device.BACKEND_NCCL, device.BACKEND_HCCL)
    side = device.Stream()
    assert side.native is not None
    device.reset_peak_memory_stats()
    x = torch.ones(1024, 1024, device=device.get_device())
    with device.stream(side):
        side.wait_stream(device.current_stream())
        y = x * 2
    event = side.record_event()
    device.current_stream().wait_event(event)
    device.synchronize()
    assert event.query()
    assert float(y.sum()) == 2 * 1024 * 1024
    assert device.peak_memory_bytes() >= 2 * 4 * 1024 * 1024
