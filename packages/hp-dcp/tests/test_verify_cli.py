"""``hp-dcp verify`` and ``check_checkpoint``: one verdict, the first bad file and item."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from safetensors.torch import save_file

import hp_dcp
from hp_dcp import CheckpointStatus
from hp_dcp.cli import main
from hp_dcp.storage import CHECKSUM_FILE, INCOMPLETE_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(8, 4, generator=g), "b": torch.arange(6), "lr": 0.5}


class _Custom:
    pass


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify")
    hp_dcp.save(_state(), checkpoint_id=root / "hp", no_dist=True)
    tdcp.save(_state(), checkpoint_id=root / "torch", no_dist=True)
    tdcp.save({**_state(), "obj": _Custom()}, checkpoint_id=root / "torch_obj", no_dist=True)
    hp_dcp.save_hf_safetensors(
        {"w": torch.ones(3), "v": torch.zeros(4)}, root / "hf", max_shard_size=8
    )
    (root / "foreign_hf").mkdir()
    save_file({"w": torch.ones(2)}, str(root / "foreign_hf" / "model.safetensors"))
    return {p.name: p for p in root.iterdir()}


def _copy(saved: dict[str, Path], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(saved[name], dst)
    return dst


def _item_at(path: Path, fqn: str) -> tuple[int, int]:
    md = hp_dcp.FileSystemReader(path).read_metadata()
    info = next(i for k, i in md.storage_data.items() if k.fqn == fqn)
    return info.offset, info.length


def test_verified_and_unverified(saved: dict[str, Path]) -> None:
    report = hp_dcp.check_checkpoint(saved["hp"])
    assert report.status is CheckpointStatus.VERIFIED
    assert report.items == 3
    assert report.files == (".metadata", "__0_0.distcp")
    report = hp_dcp.check_checkpoint(saved["torch"])
    assert report.status is CheckpointStatus.UNVERIFIED
    assert report.items == 3
    assert main(["verify", str(saved["hp"])]) == 0
    assert main(["verify", str(saved["torch"])]) == 2


def test_flipped_byte_names_file_and_item(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved, "hp", tmp_path)
    offset, length = _item_at(path, "b")
    data = path / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[offset + length - 5] ^= 0x40
    data.write_bytes(bytes(blob))
    report = hp_dcp.check_checkpoint(path)
    assert report.status is CheckpointStatus.CORRUPT
    assert (report.bad_file, report.bad_item) == ("__0_0.distcp", "b")
    assert main(["verify", str(path)]) == 3


def test_truncated_torch_checkpoint_names_item(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved, "torch", tmp_path)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-20])
    report = hp_dcp.check_checkpoint(path)
    assert report.status is CheckpointStatus.CORRUPT
    assert report.bad_file == "__0_0.distcp"
    assert report.bad_item is not None


def test_missing_sidecar_of_hp_checkpoint_is_corrupt(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    path = _copy(saved, "hp", tmp_path)
    (path / CHECKSUM_FILE).unlink()
    report = hp_dcp.check_checkpoint(path)
    assert report.status is CheckpointStatus.CORRUPT
    assert "checksum file" in report.message


def test_incomplete(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved, "hp", tmp_path)
    (path / INCOMPLETE_MARKER).write_text("x")
    assert hp_dcp.check_checkpoint(path).status is CheckpointStatus.INCOMPLETE
    assert main(["verify", str(path)]) == 4


def test_unsafe_metadata_and_unsafe_item(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved, "hp", tmp_path)
    blob = b"cos\nsystem\n(Vtrue\ntR."
    (path / ".metadata").write_bytes(blob)
    sums = json.loads((path / CHECKSUM_FILE).read_text())
    sums.pop("self_crc32")
    sums["files"][".metadata"] = {"size": len(blob), "crc32": zlib.crc32(blob)}
    sums["self_crc32"] = zlib.crc32(json.dumps(sums, separators=(",", ":")).encode())
    (path / CHECKSUM_FILE).write_text(json.dumps(sums, separators=(",", ":")))
    report = hp_dcp.check_checkpoint(path)
    assert report.status is CheckpointStatus.UNSAFE
    assert report.bad_file == ".metadata"
    assert "system" in report.message
    report = hp_dcp.check_checkpoint(saved["torch_obj"])
    assert report.status is CheckpointStatus.UNSAFE
    assert report.bad_item == "obj"
    assert main(["verify", str(saved["torch_obj"])]) == 5


def test_hf_directories(saved: dict[str, Path], tmp_path: Path) -> None:
    assert hp_dcp.check_checkpoint(saved["hf"]).status is CheckpointStatus.VERIFIED
    assert hp_dcp.check_checkpoint(saved["foreign_hf"]).status is CheckpointStatus.UNVERIFIED
    path = _copy(saved, "hf", tmp_path)
    victim = sorted(path.glob("*.safetensors"))[-1]
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 1
    victim.write_bytes(bytes(blob))
    report = hp_dcp.check_checkpoint(path)
    assert report.status is CheckpointStatus.CORRUPT
    assert report.bad_file == victim.name


def test_missing_path(tmp_path: Path) -> None:
    assert main(["verify", str(tmp_path / "nothing")]) == 1
