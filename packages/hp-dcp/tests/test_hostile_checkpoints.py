"""The bad-input battery: crafted and damaged checkpoints.

Every case loads a checkpoint that an attacker or a bad disk produced and expects a documented
error (``UnsafeCheckpointError``, ``CheckpointCorruptionError``, ``IncompleteCheckpointError``,
``FileNotFoundError``) within a time bound, with no side effect on the process (class
attributes of the classes the unpickler may touch are unchanged, no file descriptor leaked) and
the caller's state dict unchanged. Pickle attacks on ``.metadata`` also rewrite the checksum
file to match (a malicious rewrite of both), so the unpickler itself must refuse them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import io
import json
import os
import pathlib
import pickle
import shutil
import signal
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

import hp_dcp
from hp_dcp._safe_pickle import load_metadata
from hp_dcp.storage import CHECKSUM_FILE, INCOMPLETE_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_TIME_BOUND_S = 20.0  # generous: a shared 2-core CI machine; a hang is stopped by the alarm
_DOCUMENTED = (
    hp_dcp.UnsafeCheckpointError,
    hp_dcp.CheckpointCorruptionError,
    hp_dcp.IncompleteCheckpointError,
    FileNotFoundError,
    ValueError,
)
_WATCHED_CLASSES = (
    pathlib.Path,
    pathlib.PurePath,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    collections.OrderedDict,
    torch.Size,
    dcp_md.Metadata,
    dcp_md.TensorStorageMetadata,
    dcp_md.TensorProperties,
    dcp_md.ChunkStorageMetadata,
    dcp_md.BytesStorageMetadata,
    dcp_md.MetadataIndex,
    dcp_md.StorageMeta,
    _StorageInfo,
)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(6, 5, generator=g),
        "b": {"c": torch.randn(3, generator=g).to(torch.bfloat16), "lr": 0.25},
        "tag": "step-3",
    }


def _empty() -> dict[str, Any]:
    return {
        "a": torch.full((6, 5), -1.0),
        "b": {"c": torch.zeros(3, dtype=torch.bfloat16), "lr": 0.0},
        "tag": "",
    }


@pytest.fixture(scope="module", autouse=True)
def _fast_gc() -> Iterator[None]:
    """Move the (large) heap of torch and friends out of the collector's way: the per-case
    ``gc.collect()`` then scans only what the case created."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    hp_dcp.save(_state(), checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(scope="module")
def torch_good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch_good") / "ckpt"
    tdcp.save(_state(), checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture
def ckpt(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


@pytest.fixture
def tckpt(torch_good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "tckpt"
    shutil.copytree(torch_good, dst)
    return dst


def _class_snapshot() -> list[dict[str, Any]]:
    return [dict(vars(cls)) for cls in _WATCHED_CLASSES]


def _open_fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def _raise(*_: object) -> None:
        raise TimeoutError(f"the case did not finish within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _rejected(
    load: Callable[[], object], error: type[BaseException], match: str, state: Any = None
) -> BaseException:
    """Run ``load``; it must raise ``error`` (matching) in time with no side effects."""
    before_classes, before_fds = _class_snapshot(), _open_fds()
    before_state = copy.deepcopy(state)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hp_dcp.UnverifiedCheckpointWarning)
        with _alarm(_TIME_BOUND_S), pytest.raises(error, match=match) as info:
            load()
    assert time.monotonic() - start < _TIME_BOUND_S
    assert isinstance(info.value, _DOCUMENTED)
    assert _class_snapshot() == before_classes, "a class attribute changed"
    assert _open_fds() == before_fds, "a file descriptor leaked"
    if state is not None:
        assert _same(state, before_state), "the caller's state dict changed"
    return info.value


def _load_rejected(path: Path, error: type[BaseException], match: str) -> BaseException:
    state = _empty()
    return _rejected(
        lambda: hp_dcp.load(state, checkpoint_id=path, no_dist=True), error, match, state
    )


def _write_sums(path: Path, sums: Any) -> None:
    """Write a checksum file, its own checksum recomputed (a rewrite, not a corruption)."""
    if isinstance(sums, dict):
        sums.pop("self_crc32", None)
        sums["self_crc32"] = zlib.crc32(json.dumps(sums, separators=(",", ":")).encode())
    (path / CHECKSUM_FILE).write_text(json.dumps(sums, separators=(",", ":")))


def _rewrite_metadata(path: Path, blob: bytes) -> None:
    """Replace ``.metadata`` and update the checksum file to match (a malicious rewrite)."""
    (path / ".metadata").write_bytes(blob)
    sidecar = path / CHECKSUM_FILE
    if sidecar.exists():
        sums = json.loads(sidecar.read_text())
        sums["files"][".metadata"] = {"size": len(blob), "crc32": zlib.crc32(blob)}
        _write_sums(path, sums)


def _edit_metadata(path: Path, edit: Callable[[Any], None]) -> None:
    md = load_metadata((path / ".metadata").read_bytes(), "test")
    edit(md)
    _rewrite_metadata(path, pickle.dumps(md))


def _storage(md: Any, fqn: str) -> tuple[Any, Any]:
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return index, info
    raise KeyError(fqn)


def _set_storage(md: Any, fqn: str, **changes: Any) -> None:
    index, info = _storage(md, fqn)
    md.storage_data[index] = _StorageInfo(
        changes.get("relative_path", info.relative_path),
        changes.get("offset", info.offset),
        changes.get("length", info.length),
    )


# --- pickle opcode attacks on .metadata --------------------------------------------------------

_BUILD_ON_PATH_CLASS = b"cpathlib\nPath\nN}Vexists\nK\x01s\x86b."
_PICKLE_ATTACKS: dict[str, tuple[bytes, str]] = {
    "global_os_system": (b"cos\nsystem\n(Vtrue\ntR.", r"global (os|posix)\.system"),
    "stack_global_eval": (
        b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93\x8c\x011\x85R.",
        r"global builtins\.eval",
    ),
    "py2_builtin_name": (
        b"\x80\x02c__builtin__\neval\nX\x01\x00\x00\x001\x85R.",
        r"builtins\.eval",
    ),
    "build_on_path_class": (_BUILD_ON_PATH_CLASS, "opcode BUILD"),
    "build_on_metadata_class": (
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n}Vversion\nV9\nsb.",
        "opcode BUILD",
    ),
    "build_unknown_field": (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\n)\x81}Vevil\nK\x01sb.",
        r"opcode BUILD setting \['evil'\]",
    ),
    "build_dunder_field": (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\n)\x81}V__class__\nK\x01sb.",
        "opcode BUILD setting",
    ),
    "inst": (b"(ipathlib\nPath\nVx\n.", "opcode INST"),
    "obj": (b"(cpathlib\nPath\nVx\no.", "opcode OBJ"),
    "newobj_non_class": (b"\x80\x02ctorch\nSize\n)\x81.", "opcode NEWOBJ"),
    "newobj_ex": (b"\x80\x04ctorch\nSize\n)}\x92.", "opcode NEWOBJ"),
    "reduce_codecs_rot13": (b"c_codecs\nencode\nVabc\nVrot13\n\x86R.", "_codecs.encode"),
    "persid": (b"Pfoo\n.", "opcode PERSID"),
    "binpersid": (b"\x80\x02Vfoo\nQ.", "BINPERSID"),
    "ext1": (b"\x80\x02\x82\x01.", "opcode EXT1"),
    "setitem_on_path": (b"cpathlib\nPath\n)RVa\nK\x01s.", "opcode SETITEM on a PosixPath"),
    "append_on_size": (b"\x80\x02ctorch\nSize\n)RK\x01a.", "opcode APPEND on a Size"),
    "torch_function_global": (b"ctorch\nload\n.", r"global torch\.load"),
    "dotted_attribute": (
        b"\x80\x04\x8c\x07pathlib\x8c\x0bPath.exists\x93.",
        r"pathlib\.Path\.exists",
    ),
    "subprocess": (b"csubprocess\nPopen\n.", r"subprocess\.Popen"),
    # nested protocols: a protocol-0 attack inside a protocol-4 frame
    "nested_protocol_frame": (
        b"\x80\x04\x95\x12\x00\x00\x00\x00\x00\x00\x00cos\nsystem\n(Vx\ntR.",
        r"(os|posix)\.system",
    ),
}


@pytest.mark.parametrize("name", sorted(_PICKLE_ATTACKS))
def test_pickle_attack_in_metadata_refused(ckpt: Path, name: str) -> None:
    payload, match = _PICKLE_ATTACKS[name]
    _rewrite_metadata(ckpt, payload)
    err = _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, match)
    assert ".metadata" in str(err)


def test_build_on_class_would_rewrite_path_with_plain_pickle() -> None:
    """The BUILD payload is a real attack: the C unpickler applies it to the class."""
    saved = pathlib.Path.__dict__.get("exists")
    try:
        pickle.loads(_BUILD_ON_PATH_CLASS)
        assert pathlib.Path.exists == 1  # type: ignore[comparison-overlap]
    finally:
        if saved is None:
            del pathlib.Path.exists  # type: ignore[attr-defined]
        else:
            pathlib.Path.exists = saved  # type: ignore[method-assign]
    assert pathlib.Path.__dict__.get("exists") is saved


@pytest.mark.parametrize(
    ("name", "payload", "match"),
    [
        ("random_bytes", bytes(range(7, 200)), "not a valid pickle"),
        ("empty", b"", "not a valid pickle"),
        ("a_dict", pickle.dumps({"state_dict_metadata": {}}), "expected DCP Metadata"),
        ("protocol5_out_of_band", b"\x80\x05\x97.", "not a valid pickle"),
    ],
)
def test_garbage_metadata_is_corruption(ckpt: Path, name: str, payload: bytes, match: str) -> None:
    _rewrite_metadata(ckpt, payload)
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, match)


def test_truncated_metadata_with_matching_sidecar(ckpt: Path) -> None:
    _rewrite_metadata(ckpt, (ckpt / ".metadata").read_bytes()[:-40])
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "not a valid pickle")


# --- byte and tensor items ---------------------------------------------------------------------


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


class _Custom:
    pass


@pytest.mark.parametrize(
    ("value", "match"), [(_Evil(), r"(os|posix)\.system"), (_Custom(), "_Custom")]
)
def test_byte_item_with_foreign_object_refused(tmp_path: Path, value: Any, match: str) -> None:
    path = tmp_path / "t"
    tdcp.save({"a": torch.ones(2), "obj": value}, checkpoint_id=path, no_dist=True)
    state: dict[str, Any] = {"a": torch.zeros(2), "obj": None}
    _rejected(
        lambda: hp_dcp.load(state, checkpoint_id=path, no_dist=True),
        hp_dcp.UnsafeCheckpointError,
        match,
        state,
    )


def _replace_item(path: Path, fqn: str, blob: bytes) -> None:
    """Append ``blob`` to the data file and point ``fqn`` at it (metadata rewritten to match)."""
    data = path / "__0_0.distcp"
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(blob)
    _edit_metadata(path, lambda md: _set_storage(md, fqn, offset=offset, length=len(blob)))


def test_tensor_item_holding_a_non_tensor(tckpt: Path) -> None:
    buf = io.BytesIO()
    torch.save({"not": "a tensor", "pad": torch.zeros(40)}, buf)
    _replace_item(tckpt, "a", buf.getvalue())
    _load_rejected(tckpt, hp_dcp.CheckpointCorruptionError, "expected a tensor")


def test_tensor_item_holding_code(tckpt: Path) -> None:
    buf = io.BytesIO()
    torch.save([_Evil(), torch.zeros(40)], buf)
    _replace_item(tckpt, "a", buf.getvalue())
    _load_rejected(tckpt, hp_dcp.UnsafeCheckpointError, r"(os|posix)\.system")


def test_tensor_item_not_an_archive(tckpt: Path) -> None:
    _replace_item(tckpt, "a", b"\x00" * 200)
    _load_rejected(tckpt, hp_dcp.CheckpointCorruptionError, "not a readable torch.save")


# --- paths ------------------------------------------------------------------------------------


def _point(path: Path, rel: str) -> None:
    _edit_metadata(path, lambda md: _set_storage(md, "a", relative_path=rel))


@pytest.mark.parametrize(
    ("rel", "match"),
    [
        ("/etc/passwd", "outside the checkpoint"),
        ("../outside.distcp", "outside the checkpoint"),
        ("sub/../../x.distcp", "outside the checkpoint"),
        ("a\x00b", "not a file name"),
        ("C:\\\\evil", "outside the checkpoint"),
    ],
)
def test_metadata_path_escape_refused(ckpt: Path, rel: str, match: str) -> None:
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    _point(ckpt, rel)
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, match)


def test_symlink_leading_out_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    (ckpt / "link.distcp").symlink_to(outside)
    _point(ckpt, "link.distcp")
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "outside the checkpoint")


def test_symlink_to_device_refused(ckpt: Path) -> None:
    (ckpt / "zero.distcp").symlink_to("/dev/zero")
    _point(ckpt, "zero.distcp")
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "outside the checkpoint")


def test_fifo_refused_without_hanging(ckpt: Path) -> None:
    os.mkfifo(ckpt / "fifo.distcp")
    _point(ckpt, "fifo.distcp")
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "not a regular file")


def test_metadata_as_fifo_refused_without_hanging(tckpt: Path) -> None:
    (tckpt / ".metadata").unlink()
    os.mkfifo(tckpt / ".metadata")
    _load_rejected(tckpt, hp_dcp.UnsafeCheckpointError, "not a regular file")


def test_directory_as_data_file_refused(ckpt: Path) -> None:
    (ckpt / "dir.distcp").mkdir()
    _point(ckpt, "dir.distcp")
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "not a regular file")


def test_sidecar_naming_outside_file_refused(ckpt: Path) -> None:
    sums = json.loads((ckpt / CHECKSUM_FILE).read_text())
    sums["files"]["../x"] = {"size": 1, "crc32": 0}
    _write_sums(ckpt, sums)
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "outside the checkpoint")


def test_sidecar_symlink_out_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "sums.json"
    shutil.move(ckpt / CHECKSUM_FILE, outside)
    (ckpt / CHECKSUM_FILE).symlink_to(outside)
    _load_rejected(ckpt, hp_dcp.UnsafeCheckpointError, "outside the checkpoint")


def test_symlink_inside_the_directory_is_followed(ckpt: Path) -> None:
    """Control: a link that stays inside the checkpoint is an ordinary file."""
    (ckpt / "sub").mkdir()
    shutil.move(ckpt / "__0_0.distcp", ckpt / "sub" / "__0_0.distcp")
    (ckpt / "__0_0.distcp").symlink_to(Path("sub") / "__0_0.distcp")
    got = _empty()
    hp_dcp.load(got, checkpoint_id=ckpt, no_dist=True)
    assert _same(got, _state())


# --- truncated, extended, flipped, missing ----------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda b: b[:-10], "has .* bytes, its items end at byte"),
        (lambda b: b + b"\0" * 64, "has .* bytes, the save wrote"),
        (lambda b: b"", "has 0 bytes"),
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum mismatch"),
        (lambda b: b[:-200] + bytes([b[-200] ^ 0x80]) + b[-199:], "checksum mismatch"),
    ],
    ids=["truncated", "extended", "emptied", "flip_first_item", "flip_last_item"],
)
def test_damaged_data_file(ckpt: Path, damage: Callable[[bytes], bytes], match: str) -> None:
    data = ckpt / "__0_0.distcp"
    data.write_bytes(damage(data.read_bytes()))
    err = _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, match)
    assert "__0_0.distcp" in str(err)


def test_truncated_unverified_data_file(tckpt: Path) -> None:
    data = tckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-30])
    _load_rejected(tckpt, hp_dcp.CheckpointCorruptionError, "items end at byte")


def test_flipped_metadata_byte(ckpt: Path) -> None:
    md = ckpt / ".metadata"
    blob = bytearray(md.read_bytes())
    blob[len(blob) // 3] ^= 0x04
    md.write_bytes(bytes(blob))
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "checksum mismatch.*metadata")


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_flipped_sidecar_byte(ckpt: Path, where: float) -> None:
    sidecar = ckpt / CHECKSUM_FILE
    blob = bytearray(sidecar.read_bytes())
    blob[int(len(blob) * where)] ^= 0x01
    sidecar.write_bytes(bytes(blob))
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "")


def test_deleted_sidecar_cannot_switch_verification_off(ckpt: Path) -> None:
    (ckpt / CHECKSUM_FILE).unlink()
    data = ckpt / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-200] ^= 0x80  # a flipped data byte that would otherwise load as a wrong value
    data.write_bytes(bytes(blob))
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "checksum file .* is missing")
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match="missing"):
        hp_dcp.verify_checkpoint(ckpt)


def test_deleted_data_file(ckpt: Path) -> None:
    (ckpt / "__0_0.distcp").unlink()
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "is missing")


def test_deleted_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()
    _load_rejected(ckpt, hp_dcp.IncompleteCheckpointError, "no .metadata")


def test_incomplete_marker(ckpt: Path) -> None:
    (ckpt / INCOMPLETE_MARKER).write_text("x")
    _load_rejected(ckpt, hp_dcp.IncompleteCheckpointError, "did not finish")


def test_missing_checkpoint(tmp_path: Path) -> None:
    _load_rejected(tmp_path / "nothing", FileNotFoundError, "does not exist")


# --- sizes that lie -----------------------------------------------------------------------------


def _chunk_edit(size: tuple[int, ...], chunk: tuple[int, ...], offs: tuple[int, ...]) -> Any:
    def edit(md: Any) -> None:
        entry = md.state_dict_metadata["a"]
        old_index, info = _storage(md, "a")
        del md.storage_data[old_index]
        entry.size = torch.Size(size)
        entry.chunks = [dcp_md.ChunkStorageMetadata(torch.Size(offs), torch.Size(chunk))]
        md.storage_data[dcp_md.MetadataIndex("a", torch.Size(offs))] = info

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda md: _set_storage(md, "a", length=10**9), "items end at byte"),
        (lambda md: _set_storage(md, "a", offset=10**12), "items end at byte"),
        (lambda md: _set_storage(md, "a", offset=-5), "non-negative ints"),
        (lambda md: _set_storage(md, "a", length="12"), "non-negative ints"),
        (_chunk_edit((2**40,), (2**40,), (0,)), "needs 4398046511104 bytes"),
        (_chunk_edit((2**20, 2**20), (2**20, 2**20), (0, 0)), "needs"),
        (_chunk_edit((6, 5), (6, 9), (0, 0)), "exceeds its shape"),
        (_chunk_edit((2**40, 5), (6, 5), (0, 0)), "hold 30 of its 5497558138880 elements"),
        (_chunk_edit((6, 5), (6,), (0,)), "has 1 dims"),
        (_chunk_edit((1,) * 100, (1,) * 100, (0,) * 100), "tuple of non-negative ints"),
        (_chunk_edit((6, -5), (6, -5), (0, 0)), "non-negative ints"),
        (lambda md: md.state_dict_metadata["a"].chunks.append("x"), "has a chunk"),
        (lambda md: md.storage_data.clear(), "not stored"),
        (lambda md: setattr(md, "storage_data", ["x"]), "expected a dict"),
        (lambda md: setattr(md.state_dict_metadata["a"], "properties", None), "expected a dtype"),
        (lambda md: md.state_dict_metadata.update({"z": 3}), "entry 'z' is a int"),
        (lambda md: setattr(md, "storage_meta", "x"), "storage_meta"),
    ],
    ids=[
        "length_past_end",
        "offset_past_end",
        "negative_offset",
        "string_length",
        "2**40_elements",
        "2**40_elements_2d",
        "chunk_past_shape",
        "shape_larger_than_chunks",
        "chunk_rank",
        "100_dims",
        "negative_dim",
        "bad_chunk",
        "no_storage",
        "storage_not_dict",
        "no_dtype",
        "bad_entry",
        "bad_storage_meta",
    ],
)
def test_metadata_sizes_that_lie(ckpt: Path, edit: Callable[[Any], None], match: str) -> None:
    _edit_metadata(ckpt, edit)
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, match)


def _drop_tensor_fields(md: Any) -> None:
    # A pickle can create the object with NEWOBJ and BUILD only some of its fields.
    entry = md.state_dict_metadata["a"]
    hollow = type(entry).__new__(type(entry))
    object.__setattr__(hollow, "size", entry.size)
    md.state_dict_metadata["a"] = hollow


def test_metadata_object_missing_fields_is_corruption(ckpt: Path) -> None:
    """Found by the fuzzer: a TensorStorageMetadata without ``chunks`` reached torch's planner."""
    _edit_metadata(ckpt, _drop_tensor_fields)
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "lacks its fields")


def test_offline_tools_refuse_shapes_the_files_cannot_back(ckpt: Path, tmp_path: Path) -> None:
    """dcp_to_hf and extract_tensor allocate from the metadata: they must refuse first."""
    _edit_metadata(ckpt, _chunk_edit((2**40, 5), (6, 5), (0, 0)))
    for tool in (
        lambda: hp_dcp.extract_tensor(ckpt, "a"),
        lambda: hp_dcp.dcp_to_hf(ckpt, tmp_path / "hf", progress=False),
        lambda: hp_dcp.describe_checkpoint(ckpt),
    ):
        _rejected(tool, hp_dcp.CheckpointCorruptionError, "elements")


def test_shape_mismatch_with_callers_tensor(ckpt: Path) -> None:
    state = _empty()
    state["a"] = torch.zeros(7, 5)
    _rejected(
        lambda: hp_dcp.load(state, checkpoint_id=ckpt, no_dist=True),
        ValueError,
        "Size mismatch",
        state,
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["files"]["__0_0.distcp"].update(size=10**9), "bytes, the save wrote"),
        (lambda s: s["files"]["__0_0.distcp"]["items"].append([10**9, 5, 0]), "past its size"),
        (lambda s: s["files"]["__0_0.distcp"].update(items="x"), "not a list"),
        (lambda s: s["files"]["__0_0.distcp"].update(size=-1), "no valid size"),
        (lambda s: s.update(files={}), "lists no files"),
        (lambda s: s.update(format="other"), "not an hp-dcp checksum file"),
        (lambda s: s.update(algorithm="md5"), "unknown checksum algorithm"),
        (lambda s: s["files"].pop("__0_0.distcp"), "not listed"),
    ],
    ids=[
        "size",
        "item_past_end",
        "items_type",
        "negative_size",
        "no_files",
        "format",
        "algo",
        "unlisted",
    ],
)
def test_sidecar_that_lies(ckpt: Path, edit: Callable[[Any], None], match: str) -> None:
    sidecar = ckpt / CHECKSUM_FILE
    sums = json.loads(sidecar.read_text())
    edit(sums)
    _write_sums(ckpt, sums)
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, match)


def test_sidecar_with_duplicate_keys(ckpt: Path) -> None:
    sidecar = ckpt / CHECKSUM_FILE
    text = sidecar.read_text()
    sidecar.write_text(text[:-1] + ',"format":"hp-dcp-checksums"}')
    _load_rejected(ckpt, hp_dcp.CheckpointCorruptionError, "duplicate key 'format'")


# --- HF safetensors -----------------------------------------------------------------------------


def _hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "w": torch.randn(4, 3, generator=g),
        "v": torch.arange(5),
        "u": torch.randn(2, generator=g),
    }


@pytest.fixture
def hf(tmp_path: Path) -> Path:
    hp_dcp.save_hf_safetensors(_hf_state(), tmp_path / "hf", max_shard_size=60)
    return tmp_path / "hf"


def _index(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / hp_dcp.HF_INDEX_FILE).read_text()))


def _set_index(root: Path, index: dict[str, Any]) -> None:
    (root / hp_dcp.HF_INDEX_FILE).write_text(json.dumps(index))


def test_hf_written_by_hp_dcp_is_verified(hf: Path) -> None:
    assert "hp_dcp_checksums" in _index(hf)["metadata"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = hp_dcp.load_hf_safetensors(hf)
    assert _same(got, _hf_state())
    first = sorted(hf.glob("*.safetensors"))[0]
    blob = bytearray(first.read_bytes())
    blob[-1] ^= 0x01
    first.write_bytes(bytes(blob))
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(hf),
        hp_dcp.CheckpointCorruptionError,
        "checksum mismatch",
    )


def test_hf_index_deleted_cannot_switch_verification_off(hf: Path) -> None:
    (hf / hp_dcp.HF_INDEX_FILE).unlink()
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(hf),
        hp_dcp.CheckpointCorruptionError,
        "cannot be verified",
    )


def test_hf_checksums_stripped_from_index(hf: Path) -> None:
    index = _index(hf)
    del index["metadata"]["hp_dcp_checksums"]
    _set_index(hf, index)
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(hf),
        hp_dcp.CheckpointCorruptionError,
        "cannot be verified",
    )


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("missing.safetensors", FileNotFoundError, "does not exist"),
        ("foreign.safetensors", hp_dcp.CheckpointCorruptionError, "no valid checksum"),
        ("../outside.safetensors", hp_dcp.UnsafeCheckpointError, "outside the checkpoint"),
        ("/etc/passwd", hp_dcp.UnsafeCheckpointError, "outside the checkpoint"),
        (7, hp_dcp.UnsafeCheckpointError, "not a file name"),
    ],
)
def test_hf_index_pointing_elsewhere(
    hf: Path, target: Any, error: type[BaseException], match: str
) -> None:
    save_file({"w": torch.ones(1)}, str(hf.parent / "outside.safetensors"))
    save_file({"w": torch.ones(1)}, str(hf / "foreign.safetensors"))
    index = _index(hf)
    index["weight_map"]["w"] = target
    _set_index(hf, index)
    _rejected(lambda: hp_dcp.load_hf_safetensors(hf), error, match)


def test_hf_index_duplicate_keys_and_garbage(hf: Path) -> None:
    index_path = hf / hp_dcp.HF_INDEX_FILE
    text = index_path.read_text()
    index_path.write_text('{"weight_map": {"w": "a", "w": "b"}, ' + text.lstrip()[1:])
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(hf), hp_dcp.CheckpointCorruptionError, "duplicate key"
    )
    index_path.write_text("{not json")
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(hf), hp_dcp.CheckpointCorruptionError, "not valid JSON"
    )


def test_hf_foreign_loads_with_one_warning(tmp_path: Path) -> None:
    root = tmp_path / "foreign"
    root.mkdir()
    save_file({"w": torch.ones(3)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"v": torch.zeros(2)}, str(root / "model-00002-of-00002.safetensors"))
    with pytest.warns(hp_dcp.UnverifiedCheckpointWarning) as record:
        got = hp_dcp.load_hf_safetensors(root)
    assert len([w for w in record if w.category is hp_dcp.UnverifiedCheckpointWarning]) == 1
    assert torch.equal(got["w"], torch.ones(3))


def test_hf_foreign_garbage_file(tmp_path: Path) -> None:
    root = tmp_path / "foreign"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\xff" * 64)
    _rejected(
        lambda: hp_dcp.load_hf_safetensors(root), hp_dcp.CheckpointCorruptionError, "not a readable"
    )


# --- torch-written checkpoints: one warning, then they load -------------------------------------


def test_torch_written_checkpoint_loads_with_one_warning(tckpt: Path) -> None:
    got = _empty()
    with pytest.warns(hp_dcp.UnverifiedCheckpointWarning) as record:
        hp_dcp.load(got, checkpoint_id=tckpt, no_dist=True)
    assert len([w for w in record if w.category is hp_dcp.UnverifiedCheckpointWarning]) == 1
    assert _same(got, _state())


# --- fuzzing ------------------------------------------------------------------------------------

_FUZZ = settings(
    max_examples=60,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _load_fuzzed(path: Path) -> None:
    state = _empty()
    before = copy.deepcopy(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hp_dcp.load(state, checkpoint_id=path, no_dist=True)
        except _DOCUMENTED:
            assert _same(state, before)


@_FUZZ
@given(
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255), st.sampled_from("xdi")),
        min_size=1,
        max_size=4,
    )
)
def test_fuzzed_metadata_is_refused_cleanly(good: Path, tmp_path: Path, edits: Any) -> None:
    path = tmp_path / f"f{time.monotonic_ns()}"
    shutil.copytree(good, path)
    blob = bytearray((path / ".metadata").read_bytes())
    for where, value, how in edits:
        i = int(where * len(blob))
        if how == "x":
            blob[i] ^= value or 1
        elif how == "d":
            del blob[i]
        else:
            blob.insert(i, value)
    before = _class_snapshot()
    _rewrite_metadata(path, bytes(blob))
    with _alarm(_TIME_BOUND_S):
        _load_fuzzed(path)
    assert _class_snapshot() == before
    shutil.rmtree(path)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@_FUZZ
@given(
    field=st.sampled_from(["format", "algorithm", "files", "file_entry", "items", "size", "crc32"]),
    value=_JSON,
)
def test_fuzzed_sidecar_is_refused_cleanly(
    good: Path, tmp_path: Path, field: str, value: Any
) -> None:
    path = tmp_path / f"s{time.monotonic_ns()}"
    shutil.copytree(good, path)
    sums = json.loads((path / CHECKSUM_FILE).read_text())
    entry = sums["files"]["__0_0.distcp"]
    if field in ("format", "algorithm", "files"):
        sums[field] = value
    elif field == "file_entry":
        sums["files"]["__0_0.distcp"] = value
    else:
        entry[field] = value
    _write_sums(path, sums)
    with _alarm(_TIME_BOUND_S):
        _load_fuzzed(path)
    shutil.rmtree(path)
