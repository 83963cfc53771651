"""Crash safety: interrupted saves are never taken for complete ones; damage is detected and named;
loading never runs code from the checkpoint."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import hp_dcp
from hp_dcp.storage import INCOMPLETE_MARKER, staging_dir

# Single-process saves and loads: torch says so with a warning each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _plain_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(6, 5, generator=g),
        "b": {"c": torch.randn(3, generator=g).to(torch.bfloat16), "lr": 0.25},
        "tag": "step-3",
    }


def _empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "a": torch.zeros_like(sd["a"]),
        "b": {"c": torch.zeros_like(sd["b"]["c"]), "lr": 0.0},
        "tag": "",
    }


class _DyingWriter(hp_dcp.FileSystemWriter):
    """Rank 1 dies by SIGKILL after writing its files, before the coordinator can commit."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return fut


def _rank_state(value: float) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((3, 4), value + dist.get_rank())
    return {"w": DTensor.from_local(local, mesh, [Shard(0)]), "step": int(value)}


def _killed_save_rank(rank: int, port: str, path: str, log: str) -> None:
    """One rank of a 2-rank job: commit a checkpoint, then start overwriting it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    hp_dcp.save(_rank_state(1.0), checkpoint_id=path)
    dist.barrier()
    Path(f"{log}.{rank}").write_text("first save committed\n")
    hp_dcp.save(_rank_state(2.0), storage_writer=_DyingWriter(path))
    Path(f"{log}.{rank}").write_text("second save unexpectedly finished\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigkilled_rank_leaves_previous_checkpoint_and_rejects_partial(tmp_path: Path) -> None:
    path, log, port = tmp_path / "ckpt", str(tmp_path / "log"), str(_free_port())
    # Own processes, forked (no re-import of torch), never the warm pool.
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_killed_save_rank, args=(r, port, str(path), log)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        procs[1].join(timeout=60)
        assert procs[1].exitcode == -signal.SIGKILL
        # The coordinator cannot commit without rank 1: it waits in the gather (or fails).
        procs[0].join(timeout=3)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    assert Path(f"{log}.0").read_text() == "first save committed\n"
    # The previous checkpoint is intact and loads (rank 0 rows 1.0, rank 1 rows 2.0).
    target: dict[str, Any] = {"w": torch.zeros(6, 4), "step": 0}
    hp_dcp.load(target, checkpoint_id=path)
    assert torch.equal(target["w"], torch.cat([torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)]))
    assert target["step"] == 1
    hp_dcp.verify_checkpoint(path)
    # The interrupted save's directory is rejected with a clear message.
    partial = staging_dir(path)
    assert (partial / INCOMPLETE_MARKER).exists()
    with pytest.raises(hp_dcp.IncompleteCheckpointError, match="did not finish on every rank"):
        hp_dcp.load({"w": torch.zeros(6, 4), "step": 0}, checkpoint_id=partial)


class _CrashBeforeCommit(hp_dcp.FileSystemWriter):
    def finish(self, metadata: Metadata, results: Any) -> None:
        raise OSError("simulated crash before the commit")


def test_interrupted_first_save_is_rejected_not_missing(tmp_path: Path) -> None:
    path = tmp_path / "new"
    with pytest.raises(CheckpointException, match="simulated crash"):
        hp_dcp.save(_plain_state(0), storage_writer=_CrashBeforeCommit(path), no_dist=True)
    assert not path.exists()
    with pytest.raises(hp_dcp.IncompleteCheckpointError, match="interrupted") as info:
        hp_dcp.load(_empty_like(_plain_state(0)), checkpoint_id=path)
    assert str(staging_dir(path)) in str(info.value)
    # torch DCP does not see a checkpoint there either.
    assert not (path / ".metadata").exists()
    # A later save commits and replaces the leftover.
    hp_dcp.save(_plain_state(0), checkpoint_id=path, no_dist=True)
    assert not staging_dir(path).exists()


def test_overwrite_replaces_whole_checkpoint_and_keeps_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_plain_state(0), checkpoint_id=path, no_dist=True)
    hp_dcp.save(_plain_state(1), checkpoint_id=path, no_dist=True)
    got = _empty_like(_plain_state(1))
    hp_dcp.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["a"], _plain_state(1)["a"])
    assert got["tag"] == "step-3"
    assert got["b"]["lr"] == 0.25
    with pytest.raises(FileExistsError, match="overwrite=False"):
        hp_dcp.save(
            _plain_state(2),
            storage_writer=hp_dcp.FileSystemWriter(path, overwrite=False),
            no_dist=True,
        )
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    hp_dcp.save(_plain_state(0), checkpoint_id=foreign, no_dist=True)  # written alongside
    assert (foreign / "notes.txt").read_text() == "keep me"
    got = _empty_like(_plain_state(0))
    hp_dcp.load(got, checkpoint_id=foreign, no_dist=True)
    assert torch.equal(got["a"], _plain_state(0)["a"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        hp_dcp.save(_plain_state(0), checkpoint_id=tmp_path / "file", no_dist=True)


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_flipped_byte_detected_and_file_named(tmp_path: Path, which: str) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_plain_state(0), checkpoint_id=path, no_dist=True)
    victim = path / ("__0_0.distcp" if which == "data" else ".metadata")
    data = bytearray(victim.read_bytes())
    data[len(data) - 200 if which == "data" else len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match=victim.name) as info:
        hp_dcp.load(_empty_like(_plain_state(0)), checkpoint_id=path, no_dist=True)
    assert "checksum mismatch" in str(info.value)
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match=victim.name):
        hp_dcp.verify_checkpoint(path)


def test_truncated_file_detected(tmp_path: Path) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_plain_state(0), checkpoint_id=path, no_dist=True)
    victim = path / "__0_0.distcp"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match=r"__0_0\.distcp"):
        hp_dcp.load(_empty_like(_plain_state(0)), checkpoint_id=path, no_dist=True)


class Custom:
    """An arbitrary Python object a torch-written checkpoint may pickle."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_torch_checkpoint_with_arbitrary_object_rejected_unless_class_allowed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t"
    tdcp.save({"w": torch.ones(3), "obj": Custom(7)}, checkpoint_id=path, no_dist=True)
    target: dict[str, Any] = {"w": torch.zeros(3), "obj": None}
    with (
        pytest.warns(hp_dcp.UnverifiedCheckpointWarning),
        pytest.raises(hp_dcp.UnsafeCheckpointError, match="Custom") as info,
    ):
        hp_dcp.load(target, checkpoint_id=path, no_dist=True)
    assert "'obj'" in str(info.value)
    assert target["obj"] is None
    assert torch.equal(target["w"], torch.zeros(3))
    # Allowing just that class loads it, through the safe unpickler.
    with (
        torch.serialization.safe_globals([Custom]),
        pytest.warns(hp_dcp.UnverifiedCheckpointWarning),
    ):
        hp_dcp.load(target, checkpoint_id=path, no_dist=True)
    assert target["obj"].x == 7
    assert torch.equal(target["w"], torch.ones(3))


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_never_executes_code(tmp_path: Path) -> None:
    path = tmp_path / "t"
    tdcp.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    md.planner_data = {"evil": _Boom()}
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(hp_dcp.UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        hp_dcp.load({"w": torch.zeros(3)}, checkpoint_id=path, no_dist=True)


def test_torch_written_checkpoint_round_trip_and_torch_reads_ours(tmp_path: Path) -> None:
    sd = _plain_state(4)
    tdcp.save(sd, checkpoint_id=tmp_path / "t", no_dist=True)
    got = _empty_like(sd)
    hp_dcp.load(got, checkpoint_id=tmp_path / "t", no_dist=True)
    assert torch.equal(got["a"], sd["a"])
    assert torch.equal(got["b"]["c"], sd["b"]["c"])
    assert got["b"]["lr"] == 0.25
    hp_dcp.save(sd, checkpoint_id=tmp_path / "h", no_dist=True)
    got = _empty_like(sd)
    tdcp.load(got, checkpoint_id=tmp_path / "h", no_dist=True)
    assert torch.equal(got["a"], sd["a"])
    assert got["tag"] == "step-3"


def test_bad_arguments_raise_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_id"):
        hp_dcp.save({"a": torch.ones(1)})
    with pytest.raises(ValueError, match="checkpoint_id"):
        hp_dcp.load({"a": torch.ones(1)})
    with pytest.raises(ValueError, match="use_collectives"):
        hp_dcp.save({"a": torch.ones(1)}, checkpoint_id=tmp_path / "x", use_collectives=False)
    with pytest.raises(ValueError, match="TORCH_SAVE"):
        hp_dcp.FileSystemWriter(
            tmp_path, serialization_format=tdcp.filesystem.SerializationFormat.SAFETENSORS
        )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hp_dcp.load({"a": torch.ones(1)}, checkpoint_id=tmp_path / "nothing", no_dist=True)


@pytest.mark.parametrize(
    "options",
    [{"thread_count": 2}, {"single_file_per_rank": False}, {"sync_files": False}],
)
def test_writer_options_round_trip_through_torch(tmp_path: Path, options: dict[str, Any]) -> None:
    sd = _plain_state(5)
    path = tmp_path / "w"
    hp_dcp.save(sd, storage_writer=hp_dcp.FileSystemWriter(path, **options), no_dist=True)
    files = [p.name for p in path.iterdir() if p.suffix == ".distcp"]
    if "single_file_per_rank" in options:
        assert len(files) == 4  # one per item: a, b.c, b.lr, tag
    for loader in (hp_dcp.load, tdcp.load):
        got = _empty_like(sd)
        loader(got, checkpoint_id=path, no_dist=True)
        assert torch.equal(got["a"], sd["a"])
        assert torch.equal(got["b"]["c"], sd["b"]["c"])
        assert got["tag"] == "step-3"
    assert len(hp_dcp.verify_checkpoint(path)) == len(files) + 1


def test_describe_torch_written_checkpoint(tmp_path: Path) -> None:
    tdcp.save(_plain_state(0), checkpoint_id=tmp_path / "t", no_dist=True)
    entries = {e.key: e for e in hp_dcp.describe_checkpoint(tmp_path / "t")}
    assert entries["a"].shape == (6, 5)
    assert entries["b.c"].dtype == torch.bfloat16
    assert entries["b.lr"].kind == "bytes"
    assert entries["a"].layout is None
    with pytest.raises(FileNotFoundError, match="not written by hp-dcp"):
        hp_dcp.verify_checkpoint(tmp_path / "t")


def test_every_dtype_round_trips_and_torch_reads_our_encoding(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(5, 7, generator=g) * 50
    sd: dict[str, Any] = {
        str(dtype).removeprefix("torch."): base.to(dtype)
        for dtype in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
            torch.float8_e4m3fn,  # not encoded by hp-dcp: written through torch.save
        )
    }
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 4)
    sd["transposed"] = torch.randn(6, 3, generator=g).t()
    sd["big"] = torch.randn(300, 200, generator=g)
    hp_dcp.save(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    hp_dcp.verify_checkpoint(tmp_path / "c")
    for loader in (hp_dcp.load, tdcp.load):
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        loader(got, checkpoint_id=tmp_path / "c", no_dist=True)
        for k, v in sd.items():
            assert got[k].dtype == v.dtype, k
            raw_got = got[k].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(raw_got, v.contiguous().reshape(-1).view(torch.uint8)), k


def test_malformed_tensor_blob_cannot_view_outside_its_storage(tmp_path: Path) -> None:
    """A blob whose pickle claims a larger tensor than its storage is refused, not viewed."""
    import io as _io

    from hp_dcp._tensor_blob import decode_tensor, encode_tensor

    buf = _io.BytesIO()
    encode_tensor(torch.arange(4, dtype=torch.float32), buf.write)
    blob = bytearray(buf.getvalue())
    # Patch the pickled size (4,) -> (64,): BININT1 4 follows the storage offset BININT1 0.
    at = blob.index(b"K\x00K\x04\x85")
    blob[at + 3] = 64
    assert decode_tensor(memoryview(blob)) is None
    with pytest.raises(RuntimeError):
        torch.load(_io.BytesIO(bytes(blob)), weights_only=True)


def test_copy_ahead_hint_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="hp_dcp.storage"):
        hp_dcp.FileSystemWriter("unused", per_thread_copy_ahead=5)
        hp_dcp.FileSystemWriter("unused")
    hints = [r for r in caplog.records if "per_thread_copy_ahead=5" in r.getMessage()]
    assert len(hints) == 1
