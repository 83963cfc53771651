"""Device and network profiles: the numbers the cost model turns FLOPs and bytes into seconds.

A profile is a TOML file of one flat table (see ``profiles/h100.toml`` for the fields and the
sources of the published figures). ``hp-plan calibrate`` writes one measured on this machine.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceProfile", "available_device_profiles", "load_device_profile"]

_HERE = Path(__file__).parent / "profiles"


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One accelerator kind and the links between accelerators of a cluster built from it.

    Attributes:
        name: Short name (``h100``).
        description: One line saying what the figures describe.
        peak_flops: Peak dense FLOP/s in the training compute dtype (what MFU divides by).
        sustained_fraction: Share of ``peak_flops`` a large matrix multiply sustains.
        memory_bytes: Memory of one device.
        memory_bandwidth: Device memory bandwidth, bytes/s (optimizer step, elementwise work).
        devices_per_node: Devices joined by the intra-node link.
        intra_node_bandwidth: Per-device link bandwidth inside a node, bytes/s each way.
        intra_node_efficiency: Share of it a ring collective reaches (bus bandwidth).
        intra_node_latency: Per-hop latency inside a node, seconds (the alpha term).
        inter_node_bandwidth: Per-device network bandwidth across nodes, bytes/s each way.
        inter_node_efficiency: Share of it a ring collective reaches.
        inter_node_latency: Per-hop latency across nodes, seconds.
        host_bandwidth: Device <-> host copy bandwidth, bytes/s each way (offload, swap).
        host_memory_bandwidth: Host memory bandwidth available to one device's optimizer step.
        host_memory_bytes: Host memory of one node.
        kernel_overhead: Fixed cost of one operator launch, seconds (dominant on a CPU run).
        dtensor_overhead: Extra host cost of one operator on DTensor parameters (tensor
            parallel), seconds: DTensor's sharding propagation. 0 where the device's kernels
            outlast it (it runs on the host while the device computes).
        source: The file the profile was read from.

    See Also:
        :titan:`torchtitan.tools.utils.get_peak_flops`: TorchTitan's peak-FLOPS table (one
        number per device, no links).
    """

    name: str
    description: str = ""
    peak_flops: float
    sustained_fraction: float = 0.7
    memory_bytes: float
    memory_bandwidth: float
    devices_per_node: int = 8
    intra_node_bandwidth: float
    intra_node_efficiency: float = 0.8
    intra_node_latency: float = 5e-6
    inter_node_bandwidth: float
    inter_node_efficiency: float = 0.8
    inter_node_latency: float = 10e-6
    host_bandwidth: float
    host_memory_bandwidth: float
    host_memory_bytes: float
    kernel_overhead: float = 5e-6
    dtensor_overhead: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "description", "source"):
                if not isinstance(value, str):
                    raise TypeError(f"DeviceProfile.{f.name} must be a str, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"DeviceProfile.{f.name} must be a number >= 0, got {value!r}")
        if self.devices_per_node < 1 or not float(self.devices_per_node).is_integer():
            raise ValueError(
                f"DeviceProfile.devices_per_node must be an integer >= 1, got "
                f"{self.devices_per_node!r}"
            )
        if not 0 < self.sustained_fraction <= 1:
            raise ValueError(
                f"DeviceProfile.sustained_fraction must be in (0, 1], got "
                f"{self.sustained_fraction!r}"
            )

    @property
    def sustained_flops(self) -> float:
        """FLOP/s a large matrix multiply reaches."""
        return self.peak_flops * self.sustained_fraction

    def to_toml(self) -> str:
        """The profile as the TOML text :func:`load_device_profile` reads."""
        lines = []
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            lines.append(f"{f.name} = {value!r}" if not isinstance(value, str) else
                         f'{f.name} = "{value}"')  # fmt: skip
        return "\n".join(lines) + "\n"


def available_device_profiles() -> list[str]:
    """The names of the shipped profiles (``h100``, ``h200``, ``ascend910b``, ``cpu``).

    See Also:
        :titan:`torchtitan.tools.utils.get_peak_flops`: the device names TorchTitan knows.
    """
    return sorted(p.stem for p in _HERE.glob("*.toml"))


def load_device_profile(name_or_path: str | Path) -> DeviceProfile:
    """Read a shipped profile by name, or a profile file by path.

    Args:
        name_or_path: ``h100``, ``h200``, ``ascend910b``, ``cpu``, or a ``.toml`` path (for
            instance one written by ``hp-plan calibrate``).

    Returns:
        The profile.

    Raises:
        ValueError: An unknown name (the message lists the available ones), or a file with an
            unknown or missing field.

    See Also:
        :titan:`torchtitan.tools.utils.get_peak_flops`: TorchTitan's device table.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") and path.is_file()):
        shipped = _HERE / f"{text.lower()}.toml"
        if not shipped.is_file():
            raise ValueError(
                f"unknown device profile {text!r}: expected one of "
                f"{', '.join(available_device_profiles())} or the path of a .toml profile "
                "(hp-plan calibrate writes one)"
            )
        path = shipped
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    known = {f.name for f in dataclasses.fields(DeviceProfile)} - {"source"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"device profile {path}: unknown field(s) {unknown}; expected {sorted(known)}"
        )
    try:
        return DeviceProfile(**data, source=str(path))
    except TypeError as exc:
        raise ValueError(f"device profile {path}: {exc}") from None
