"""Saving into a directory that holds other files, against torch 2.13's DCP.

torch's ``FileSystemWriter`` writes its files next to whatever the directory holds (the usual
case: ``torch_save_to_dcp(model.pt, dir_of_model.pt)``). hp-dcp does too, with its guarantees:
files that are not a checkpoint's are never opened, moved or deleted (their bytes, inode and
mtime are compared), ``.metadata`` is renamed in last, the previous checkpoint in the directory
stays loadable (verified) until then, and a second save never reuses the names of the files
already there. Crashes are injected at each rename of the in-place commit.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
import torch.distributed.checkpoint.format_utils as format_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import hp_dcp
from hp_dcp import _in_place
from hp_dcp.storage import CHECKSUM_FILE, staging_dir
from hp_dtensor.testing import run_distributed

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore::hp_dcp.UnverifiedCheckpointWarning",
)


def _foreign(root: Path, distcp: bool = True) -> dict[str, tuple[bytes, int, int]]:
    """Put files that are no checkpoint's in ``root``; return their fingerprints."""
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.arange(5.0)}, root / "model.pt")
    (root / "notes.txt").write_text("keep me")
    (root / "logs").mkdir(exist_ok=True)
    (root / "logs" / "train.log").write_text("step 1\n")
    names = ["model.pt", "notes.txt", "logs/train.log"]
    if distcp:
        (root / "old_0.distcp").write_bytes(b"not ours either")  # a foreign .distcp name
        names.append("old_0.distcp")
    return _fingerprint(root, names)


def _fingerprint(root: Path, names: list[str]) -> dict[str, tuple[bytes, int, int]]:
    out = {}
    for name in names:
        st = (root / name).stat()
        out[name] = ((root / name).read_bytes(), st.st_ino, st.st_mtime_ns)
    return out


def _state(k: float) -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(3, 4) * k, "step": int(k)}


def _load(path: Path, reader: Any = None) -> dict[str, Any]:
    out = {"w": torch.zeros(3, 4), "step": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("error", hp_dcp.UnverifiedCheckpointWarning)
        if reader is None:
            hp_dcp.load(out, checkpoint_id=path, no_dist=True)
        else:
            tdcp.load(out, storage_reader=reader, no_dist=True)
    return out


def test_torch_save_to_dcp_next_to_model_pt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """torch's helper with its FileSystemWriter rebound to hp-dcp's (a migrating user), against
    torch's own writer: the same DCP files next to model.pt, which stays as it was."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    before = {d: _foreign(d, distcp=False) for d in (ours, theirs)}
    format_utils.torch_save_to_dcp(theirs / "model.pt", theirs)
    monkeypatch.setattr(format_utils, "FileSystemWriter", hp_dcp.FileSystemWriter)
    format_utils.torch_save_to_dcp(ours / "model.pt", ours)
    assert set(os.listdir(ours)) == set(os.listdir(theirs)) | {CHECKSUM_FILE}
    for d in (ours, theirs):
        assert _fingerprint(d, list(before[d])) == before[d]
        for reader in (hp_dcp.FileSystemReader(d), tdcp.FileSystemReader(d)):
            out: dict[str, Any] = {"w": torch.zeros(5)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tdcp.load(out, storage_reader=reader, no_dist=True)
            assert torch.equal(out["w"], torch.arange(5.0))
    assert hp_dcp.check_checkpoint(ours).status == hp_dcp.CheckpointStatus.VERIFIED
    assert not staging_dir(ours).exists()


def _ws3_saves_alongside(root: str) -> dict[str, Any]:
    path = Path(root) / "ckpt"
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict[str, Any] = {}
    for round_ in (1, 2):
        g = torch.Generator().manual_seed(round_)
        full = torch.randn(9, 4, generator=g)  # each rank saves a different shard
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": round_}
        hp_dcp.save(state, checkpoint_id=path)
        for lib in ("hp", "torch"):
            target = {"w": distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0)]), "step": 0}
            if lib == "hp":
                hp_dcp.load(target, checkpoint_id=path)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tdcp.load(target, storage_reader=tdcp.FileSystemReader(path))
            results[f"{round_} {lib}"] = (
                torch.equal(target["w"].to_local(), state["w"].to_local()),
                target["step"],
            )
        dist.barrier()
        if rank == 0:
            results[f"{round_} files"] = sorted(os.listdir(path))
        dist.barrier()
    return results


def test_ws3_saves_alongside_foreign_files_twice(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    before = _foreign(path)
    results = run_distributed(_ws3_saves_alongside, 3, str(tmp_path))
    for rank, res in enumerate(results):
        for key in ("1 hp", "1 torch", "2 hp", "2 torch"):
            assert res[key] == (True, int(key[0])), (rank, key)
    first, second = results[0]["1 files"], results[0]["2 files"]
    ours1 = {n for n in first if n.startswith("__")}
    ours2 = {n for n in second if n.startswith("__")}
    assert len(ours1) == len(ours2) == 3  # one file per rank
    assert not ours1 & ours2  # the second save never reused a name that was there
    assert all(n.startswith(f"__{r}_") for r, n in enumerate(sorted(ours2)))
    assert set(second) - ours2 == set(first) - ours1  # the old data files went, nothing else
    assert _fingerprint(path, list(before)) == before
    assert hp_dcp.check_checkpoint(path).status == hp_dcp.CheckpointStatus.VERIFIED


class _CrashError(Exception):
    pass


@pytest.mark.parametrize(
    ("fail_at", "expect"),
    [
        ("link:1", 1),  # while the data files move in: the previous checkpoint is intact
        ("replace:2", 1),  # sidecar replaced, .metadata not yet: the previous one, verified
        ("replace:3", 2),  # .metadata in, the final sidecar not yet: the new one, verified
    ],
)
def test_crash_during_in_place_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str, expect: int
) -> None:
    path = tmp_path / "ckpt"
    before = _foreign(path)
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    kind, nth = fail_at.split(":")
    calls = {"link": 0, "replace": 0}
    real = {"link": os.link, "replace": os.replace}

    def failing(which: str) -> Any:
        def op(src: Any, dst: Any) -> None:
            calls[which] += 1
            if which == kind and calls[which] == int(nth):
                raise _CrashError(f"crash at {fail_at}")
            real[which](src, dst)

        return op

    monkeypatch.setattr(_in_place.os, "link", failing("link"))
    monkeypatch.setattr(_in_place.os, "replace", failing("replace"))
    with pytest.raises(CheckpointException) as info:
        hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    assert any(isinstance(err, _CrashError) for err, _ in info.value.failures.values())
    monkeypatch.undo()
    got = _load(path)  # verified: an unverified load would warn, and warnings are errors here
    assert torch.equal(got["w"], _state(expect)["w"])
    assert got["step"] == expect
    assert hp_dcp.check_checkpoint(path).status == hp_dcp.CheckpointStatus.VERIFIED
    assert _fingerprint(path, list(before)) == before
    # the next save recovers and commits; the foreign files are still untouched
    hp_dcp.save(_state(3), checkpoint_id=path, no_dist=True)
    assert _load(path)["step"] == 3
    assert _fingerprint(path, list(before)) == before
    assert not staging_dir(path).exists()


def test_overwrite_false_refuses_only_an_existing_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    before = _foreign(path)
    writer = hp_dcp.FileSystemWriter(path, overwrite=False)
    tdcp.save(_state(1), storage_writer=writer, no_dist=True)  # no checkpoint there yet
    with pytest.raises(FileExistsError, match="overwrite=False"):
        hp_dcp.save(
            _state(2),
            storage_writer=hp_dcp.FileSystemWriter(path, overwrite=False),
            no_dist=True,
        )
    assert _load(path)["step"] == 1
    assert _fingerprint(path, list(before)) == before


def test_torch_checkpoint_next_to_foreign_files_is_replaced_in_place(tmp_path: Path) -> None:
    """A previous checkpoint written by torch (no checksums) next to foreign files; its metadata
    forged to also name model.pt as a data file: replacing it deletes only its .distcp files."""
    path = tmp_path / "ckpt"
    before = _foreign(path)
    tdcp.save(_state(1), storage_writer=tdcp.FileSystemWriter(path), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "step")
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo("model.pt", 0, 1)  # forged: names a foreign file
    (path / ".metadata").write_bytes(pickle.dumps(md))
    torch_file = info.relative_path
    hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    assert _load(path)["step"] == 2
    assert _fingerprint(path, list(before)) == before  # model.pt kept despite the forgery
    assert torch_file not in os.listdir(path)  # the previous checkpoint's data file went


class _LateForeignFileWriter(hp_dcp.FileSystemWriter):
    """Another program drops a file named like this save's data file while the save runs."""

    def finish(self, metadata: Any, results: Any) -> None:
        (Path(self.path) / "__0_0.distcp").write_bytes(b"someone else's")
        super().finish(metadata, results)


def test_a_name_taken_during_the_save_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _foreign(path, distcp=False)  # no .distcp there: the save plans torch's names
    hp_dcp.save(_state(1), storage_writer=_LateForeignFileWriter(path), no_dist=True)
    assert (path / "__0_0.distcp").read_bytes() == b"someone else's"
    assert _load(path)["step"] == 1  # verified, from the renamed file
    names = {
        info.relative_path
        for info in tdcp.FileSystemReader(path).read_metadata().storage_data.values()
    }
    assert names
    assert "__0_0.distcp" not in names
    assert hp_dcp.check_checkpoint(path).status == hp_dcp.CheckpointStatus.VERIFIED


def test_a_name_taken_during_the_move_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race after the names were checked: the file appears just before the move."""
    path = tmp_path / "ckpt"
    _foreign(path, distcp=False)
    real_link = os.link

    def racing_link(src: Any, dst: Any) -> None:
        if Path(dst).name == "__0_0.distcp" and not Path(dst).exists():
            Path(dst).write_bytes(b"someone else's")
        real_link(src, dst)

    monkeypatch.setattr(_in_place.os, "link", racing_link)
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    monkeypatch.undo()
    assert (path / "__0_0.distcp").read_bytes() == b"someone else's"
    assert _load(path)["step"] == 1
    assert hp_dcp.check_checkpoint(path).status == hp_dcp.CheckpointStatus.VERIFIED
