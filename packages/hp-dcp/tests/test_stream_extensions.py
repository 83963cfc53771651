"""PyTorch's stream extensions (``FileSystemWriter(_extensions=...)``,
``FileSystemReader(_extension_registry=...)``) in hp-dcp, against torch 2.13's DCP.

- ZStandard-compressed checkpoints: written by hp-dcp and loaded by torch's reader, written by
  torch and loaded by hp-dcp, at 3 ranks with a sharded DTensor (different data on each rank)
  and a byte item; the stored file is smaller than the raw tensor bytes.
- A user extension (an XOR mask) and a chain of two: registered in an ``ExtensionRegistry``.
- Checksums cover the stored (transformed) bytes: one flipped stored byte is a
  ``CheckpointCorruptionError`` before anything is decompressed.
- Hostile streams: a zstd bomb (256 MiB of zeros in a few KiB) in place of a 40-byte tensor is
  refused after reading at most the item's allowance (observed with ``tracemalloc``); a pickle
  payload inside a compressed byte item is refused by the allow-list unpickler; an unknown
  extension name is refused naming it; malformed descriptors in ``.metadata`` are corruption.

The ZStandard cases need ``zstandard`` (an optional dev dependency) and skip cleanly without it.
"""

from __future__ import annotations

import io
import os
import pickle
import tracemalloc
import warnings
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hp_dcp
from hp_dcp.storage import CHECKSUM_FILE
from hp_dtensor.testing import run_distributed

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore::hp_dcp.UnverifiedCheckpointWarning",
)

needs_zstd = pytest.mark.skipif(
    not ZStandard.is_available(), reason="zstandard (optional dev dependency) is not installed"
)


# ------------------------------------------------------------------------------------------
# a user extension: XOR with a one-byte key (the key is the version, so two keys differ)
# ------------------------------------------------------------------------------------------


class _XorWriter(io.RawIOBase):
    def __init__(self, out: IO[bytes], key: int) -> None:
        super().__init__()
        self._out, self._key = out, key

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self._out.write(bytes(x ^ self._key for x in data))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._out.close()
        super().close()


class _XorReader(io.RawIOBase):
    def __init__(self, inp: IO[bytes], key: int) -> None:
        super().__init__()
        self._inp, self._key = inp, key

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._inp.read(len(b))
        out = bytes(x ^ self._key for x in data)
        memoryview(b).cast("B")[: len(out)] = out
        return len(out)


class Xor(StreamTransformExtension):
    """XOR every stored byte with ``key``; descriptor ``test.xor/<key>``."""

    def __init__(self, key: int = 0x5A) -> None:
        super().__init__()
        self.key = key

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        return Xor(int(version))

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/{self.key}"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _XorWriter(output, self.key)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _XorReader(input, self.key)  # type: ignore[return-value]


class Tag(StreamTransformExtension):
    """Prefix the stream with one tag byte (checked on read): order-sensitive, unlike XOR."""

    @staticmethod
    def registry_name() -> str:
        return "test.tag"

    @staticmethod
    def from_descriptor(version: str) -> Tag:
        return Tag()

    def get_descriptor(self) -> str:
        return "test.tag/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        output.write(b"T")
        return _XorWriter(output, 0)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        if input.read(1) != b"T":
            raise ValueError("missing tag byte")
        return input


def _registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(Xor)
    reg.register(Tag)
    return reg


def _state() -> dict[str, Any]:
    return {"w": (torch.arange(600.0) % 7).reshape(20, 30), "meta": {"step": 7, "name": "run"}}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(20, 30), "meta": {"step": 0, "name": ""}}


def _load(reader: Any, state: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _save(writer: Any) -> None:
    tdcp.save(_state(), storage_writer=writer, no_dist=True)


def _items(path: Path) -> dict[str, Any]:
    md = tdcp.FileSystemReader(path).read_metadata()
    return {k.fqn: v for k, v in md.storage_data.items()}


# ------------------------------------------------------------------------------------------
# interoperability with torch
# ------------------------------------------------------------------------------------------


def _ws3_round_trips(root: str) -> dict[str, Any]:
    """Each rank holds a different shard of ``w``; save compressed by one library, load by the
    other (and itself), into a DTensor of the same layout."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(3)
    full = torch.randn(9, 40, generator=g).round(decimals=1)  # compressible, different per rank
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 11}
    out: dict[str, Any] = {}
    for writer_lib in ("hp", "torch"):
        path = f"{root}/{writer_lib}"
        writer_cls = hp_dcp.FileSystemWriter if writer_lib == "hp" else tdcp.FileSystemWriter
        tdcp.save(state, storage_writer=writer_cls(path, _extensions=[ZStandard()]))
        for reader_lib in ("hp", "torch"):
            reader_cls = hp_dcp.FileSystemReader if reader_lib == "hp" else tdcp.FileSystemReader
            target = {"w": distribute_tensor(torch.zeros(9, 40), mesh, [Shard(0)]), "step": 0}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tdcp.load(target, storage_reader=reader_cls(path))
            assert isinstance(target["w"], DTensor)
            out[f"{writer_lib}->{reader_lib}"] = (
                torch.equal(target["w"].to_local(), state["w"].to_local()),
                target["step"],
            )
        dist.barrier()
        if rank == 0:
            out[f"{writer_lib} files"] = sorted(os.listdir(path))
            out[f"{writer_lib} descriptors"] = {
                tuple(v.transform_descriptors or ()) for v in _items(Path(path)).values()
            }
    return out


@needs_zstd
def test_zstd_checkpoints_interoperate_with_torch_at_ws3(tmp_path: Path) -> None:
    results = run_distributed(_ws3_round_trips, 3, str(tmp_path))
    for rank, res in enumerate(results):
        for pair in ("hp->hp", "hp->torch", "torch->hp", "torch->torch"):
            assert res[pair] == (True, 11), (rank, pair)
    assert results[0]["hp descriptors"] == results[0]["torch descriptors"] == {("stream.zstd/1",)}
    assert CHECKSUM_FILE in results[0]["hp files"]
    assert hp_dcp.check_checkpoint(tmp_path / "hp").status == hp_dcp.CheckpointStatus.VERIFIED


@needs_zstd
def test_zstd_compresses_and_checksums_the_stored_bytes(tmp_path: Path) -> None:
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    _save(hp_dcp.FileSystemWriter(plain))
    _save(hp_dcp.FileSystemWriter(packed, _extensions=[ZStandard()]))
    raw = _items(plain)["w"].length
    stored = _items(packed)["w"]
    assert stored.transform_descriptors == ["stream.zstd/1"]
    assert stored.length < raw / 2  # 600 floats of 7 values compress well
    # the checksum is of the stored (compressed) bytes
    sums = hp_dcp.storage.read_checksums(packed)
    assert sums is not None
    blob = (packed / stored.relative_path).read_bytes()[
        stored.offset : stored.offset + stored.length
    ]
    recorded = {o: (n, c) for o, n, c in sums["files"][stored.relative_path]["items"]}
    from hp_dcp._checksum import crc32

    assert recorded[stored.offset] == (stored.length, crc32(blob))
    assert torch.equal(_load(hp_dcp.FileSystemReader(packed), _empty())["w"], _state()["w"])
    # one flipped stored byte: refused by the checksum, before any decompression
    data = bytearray((packed / stored.relative_path).read_bytes())
    data[stored.offset + stored.length // 2] ^= 0x01
    (packed / stored.relative_path).write_bytes(bytes(data))
    target = _empty()
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match="checksum mismatch"):
        hp_dcp.load(target, checkpoint_id=packed, no_dist=True)
    assert torch.equal(target["w"], torch.zeros(20, 30))  # unchanged


def test_user_extension_round_trips_and_interoperates(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _save(hp_dcp.FileSystemWriter(ours, _extensions=[Xor(0x5A)]))
    theirs.mkdir()
    _save(tdcp.FileSystemWriter(theirs, _extensions=[Xor(0x5A)]))
    # the stored bytes really are transformed, and the two libraries store the same item bytes
    item = _items(ours)["w"]
    assert item.transform_descriptors == ["test.xor/90"]
    head = (ours / item.relative_path).read_bytes()[item.offset : item.offset + 2]
    assert head == bytes([ord("P") ^ 0x5A, ord("K") ^ 0x5A])
    for path in (ours, theirs):
        for reader in (
            hp_dcp.FileSystemReader(path, _extension_registry=_registry()),
            tdcp.FileSystemReader(path, _extension_registry=_registry()),
        ):
            got = _load(reader, _empty())
            assert torch.equal(got["w"], _state()["w"])
            assert got["meta"] == {"step": 7, "name": "run"}


def test_two_extensions_are_undone_in_the_order_that_inverts_the_write(tmp_path: Path) -> None:
    """torch 2.13 records [Xor, Tag] written as Tag(Xor(data)) and undoes Xor first, so it cannot
    read its own two-extension checkpoints; hp-dcp reads both libraries' (a documented
    difference; the stored bytes are identical)."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _save(hp_dcp.FileSystemWriter(ours, _extensions=[Tag(), Xor(7)]))
    theirs.mkdir()
    _save(tdcp.FileSystemWriter(theirs, _extensions=[Tag(), Xor(7)]))
    for path in (ours, theirs):
        item = _items(path)["w"]
        assert item.transform_descriptors == ["test.xor/7", "test.tag/1"]  # as torch records
        assert (path / item.relative_path).read_bytes()[item.offset : item.offset + 1] == b"T"
        got = _load(hp_dcp.FileSystemReader(path, _extension_registry=_registry()), _empty())
        assert torch.equal(got["w"], _state()["w"])
    with pytest.raises(tdcp.api.CheckpointException) as info:  # torch's own reader
        _load(tdcp.FileSystemReader(theirs, _extension_registry=_registry()), _empty())
    assert any("missing tag byte" in str(err) for err, _ in info.value.failures.values())


def test_unknown_extension_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(hp_dcp.FileSystemWriter(path, _extensions=[Xor()]))
    target = _empty()
    with pytest.raises(ValueError, match=r"'test\.xor/90'.*'test\.xor' is not in the extension"):
        hp_dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["w"], torch.zeros(20, 30))
    report = hp_dcp.check_checkpoint(path)
    assert report.status == hp_dcp.CheckpointStatus.UNSAFE
    assert "test.xor" in report.message


def test_bad_extension_arguments_are_type_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="StreamTransformExtension instances"):
        hp_dcp.FileSystemWriter(tmp_path / "a", _extensions=[object()])
    with pytest.raises(TypeError, match="sequence of StreamTransformExtension"):
        hp_dcp.FileSystemWriter(tmp_path / "a", _extensions=Xor())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes an ExtensionRegistry"):
        hp_dcp.FileSystemReader(tmp_path / "a", _extension_registry=[Xor])


# ------------------------------------------------------------------------------------------
# hostile compressed streams
# ------------------------------------------------------------------------------------------


def _rewrite_item(path: Path, fqn: str, payload: bytes, descriptors: list[str]) -> None:
    """Append ``payload`` to the item's file and point the item at it (a torch-style checkpoint
    without checksums, as an attacker could write one)."""
    md_path = path / ".metadata"
    md = pickle.loads(md_path.read_bytes())  # test-side: our own file
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            file = path / info.relative_path
            offset = file.stat().st_size
            with file.open("ab") as f:
                f.write(payload)
            md.storage_data[index] = _StorageInfo(
                info.relative_path, offset, len(payload), transform_descriptors=descriptors
            )
    md_path.write_bytes(pickle.dumps(md))


@needs_zstd
def test_decompression_bomb_is_refused_within_the_item_allowance(tmp_path: Path) -> None:
    import zstandard

    path = tmp_path / "ckpt"
    path.mkdir()
    state = {"w": torch.arange(10.0)}  # 40 bytes of tensor data
    tdcp.save(state, storage_writer=tdcp.FileSystemWriter(path), no_dist=True)
    sink = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(sink, closefd=False) as w:
        zeros = bytes(1 << 20)
        for _ in range(256):  # 256 MiB of zeros
            w.write(zeros)
    bomb = sink.getvalue()
    assert len(bomb) < 64 << 10
    _rewrite_item(path, "w", bomb, ["stream.zstd/1"])
    target = {"w": torch.full((10,), -1.0)}
    tracemalloc.start()
    try:
        with pytest.raises(hp_dcp.UnsafeCheckpointError, match="decompression bomb"):
            hp_dcp.load(target, checkpoint_id=path, no_dist=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the item's allowance (40 B + 64 KiB), not 256 MiB
    assert torch.equal(target["w"], torch.full((10,), -1.0))
    assert hp_dcp.check_checkpoint(path).status == hp_dcp.CheckpointStatus.UNSAFE


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


@needs_zstd
@pytest.mark.parametrize("fqn", ["meta.step", "w"])  # a byte item, a tensor item
def test_pickle_payload_inside_a_compressed_item_is_refused(tmp_path: Path, fqn: str) -> None:
    import zstandard

    path = tmp_path / "ckpt"
    path.mkdir()
    tdcp.save(_state(), storage_writer=tdcp.FileSystemWriter(path), no_dist=True)
    raw = io.BytesIO()
    torch.save(_Payload(), raw)  # a torch.save archive, as DCP stores every item
    _rewrite_item(path, fqn, zstandard.ZstdCompressor().compress(raw.getvalue()), ["stream.zstd/1"])
    target = _empty()
    with pytest.raises(hp_dcp.UnsafeCheckpointError, match=r"(os|posix)\.system"):
        hp_dcp.load(target, checkpoint_id=path, no_dist=True)
    assert target["meta"] == {"step": 0, "name": ""}
    assert torch.equal(target["w"], torch.zeros(20, 30))


def test_malformed_descriptors_in_metadata_are_corruption(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    tdcp.save(_state(), storage_writer=tdcp.FileSystemWriter(path), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    for index, info in md.storage_data.items():
        md.storage_data[index] = _StorageInfo(
            info.relative_path, info.offset, info.length, transform_descriptors=[b"x" * 10]
        )
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match="stream transform descriptors"):
        hp_dcp.load(_empty(), checkpoint_id=path, no_dist=True)


class _Unbuildable(Xor):
    """Known to the registry, but cannot be built here (as ZStandard without zstandard)."""

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        raise ValueError("no module named 'xorlib'")


def test_extension_that_cannot_be_built_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(hp_dcp.FileSystemWriter(path, _extensions=[Xor()]))
    registry = ExtensionRegistry()
    registry.register(_Unbuildable)
    target = _empty()
    reader = hp_dcp.FileSystemReader(path, _extension_registry=registry)
    with pytest.raises(ValueError, match=r"\['test\.xor/90'\].*no module named 'xorlib'"):
        hp_dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], torch.zeros(20, 30))
