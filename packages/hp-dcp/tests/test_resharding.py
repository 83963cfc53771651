"""Resharding round trips between FSDP, HSDP, TP and FSDP x TP layouts, and torch DCP interop.

Models are sharded with PyTorch's own ``fully_shard`` and TP; every rank trains one step on
its own data, the sharded model + AdamW state is saved, and it is loaded at another world size
and layout. The oracle is the full (gathered) state at save time: the loaded state must equal it
bitwise. Dimensions (10 -> 12 -> 7): the 7-row tensors shard unevenly at world sizes 2, 3 and 4.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import hp_dcp
from hp_dtensor.testing import rank_seed, run_distributed

FULL = StateDictOptions(full_state_dict=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(10, 12)
        self.w2 = nn.Linear(12, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def build(layout: str, init_seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Build Net in ``layout``; return it, its AdamW and the data-parallel rank."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(init_seed)
    model = Net()
    dp_rank = rank
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (ws,))
        fully_shard(model.w1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("rep", "shard"))
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (ws,))
        parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        dp_rank = 0
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh.get_local_rank("dp")
    else:
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, dp_rank


def train_step(model: nn.Module, opt: torch.optim.Optimizer, dp_rank: int) -> None:
    g = torch.Generator().manual_seed(1000 + dp_rank)
    x = torch.randn(5, 10, generator=g)
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd = get_model_state_dict(model, options=FULL)
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    return {"model": msd, "optim": osd}


def save_layouts(root: str, layouts: list[str], use_torch: bool) -> dict[str, Any]:
    """Train one step in each layout, save it, return the full states (rank 0)."""
    out: dict[str, Any] = {}
    for layout in layouts:
        model, opt, dp_rank = build(layout, init_seed=0, lr=0.01)
        train_step(model, opt, dp_rank)
        msd, osd = get_state_dict(model, opt)
        path = str(Path(root) / f"{layout}_ws{dist.get_world_size()}")
        saver = tdcp.save if use_torch else hp_dcp.save
        saver({"model": msd, "optim": osd}, checkpoint_id=path)
        out[layout] = full_state(model, opt)
    return out


def load_layout(
    path: str, layout: str, use_torch: bool, hp_helpers: bool = False
) -> dict[str, Any]:
    """Load ``path`` into a freshly initialized model in ``layout``; return its full state.

    ``hp_helpers`` uses the state-dict helpers hp-dcp re-exports (hp-dtensor's) instead of
    torch's, as the docs show.
    """
    model, opt, dp_rank = build(layout, init_seed=123, lr=0.5)
    train_step(model, opt, dp_rank)  # different state everywhere before the load
    getter, setter = (
        (hp_dcp.get_state_dict, hp_dcp.set_state_dict)
        if hp_helpers
        else (get_state_dict, set_state_dict)
    )
    msd, osd = getter(model, opt)
    sd = {"model": msd, "optim": osd}
    (tdcp.load if use_torch else hp_dcp.load)(sd, checkpoint_id=path)
    setter(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return full_state(model, opt)


def assert_same_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), what
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{what}: model {k}"
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys(), what
    for fqn, st in want["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][fqn][k], v), f"{what}: optim {fqn}.{k}"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"], what


def _phase_ws2_save(root: str) -> dict[str, Any]:
    saved = save_layouts(root, ["fsdp", "tp"], use_torch=False)
    saved.update({f"torch_{k}": v for k, v in save_layouts(root + "/t", ["fsdp"], True).items()})
    _async_round_trip(root)
    return saved


def _sharded_rows() -> tuple[DeviceMesh, DTensor, torch.Tensor]:
    """A 7 x 5 tensor sharded unevenly (4 + 3 rows), different data on each rank."""
    rank = dist.get_rank()
    torch.manual_seed(rank_seed(7))
    mesh = init_device_mesh("cpu", (2,))
    local = torch.randn(4 if rank == 0 else 3, 5)
    dt = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([7, 5]), stride=(5, 1)
    )
    return mesh, dt, local


def _async_round_trip(root: str) -> None:
    mesh, dt, local = _sharded_rows()
    fut = hp_dcp.async_save({"w": dt, "n": 5}, checkpoint_id=f"{root}/a")
    assert isinstance(fut, Future)
    fut.result()
    target = {"w": dtensor_zeros(7, 5, device_mesh=mesh, placements=[Replicate()]), "n": 0}
    hp_dcp.load(target, checkpoint_id=f"{root}/a")
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, local)
    assert torch.equal(target["w"].to_local(), torch.cat(gathered))
    assert target["n"] == 5


def _load_corrupted(root: str) -> str:
    mesh, _, _ = _sharded_rows()
    target = {"w": dtensor_zeros(7, 5, device_mesh=mesh, placements=[Shard(0)]), "n": 0}
    with pytest.raises(hp_dcp.CheckpointCorruptionError) as info:
        hp_dcp.load(target, checkpoint_id=f"{root}/a")
    return str(info.value)


def _phase_ws4(root: str) -> dict[str, Any]:
    loaded = {
        "fsdp_ws2->hsdp": load_layout(f"{root}/fsdp_ws2", "hsdp", False),
        "tp_ws2->fsdp_tp": load_layout(f"{root}/tp_ws2", "fsdp_tp", False),
        "torch_fsdp_ws2->tp (hp load)": load_layout(f"{root}/t/fsdp_ws2", "tp", False),
    }
    saved = save_layouts(root, ["fsdp", "hsdp", "fsdp_tp"], use_torch=False)
    return {"loaded": loaded, "saved": saved}


def _phase_ws2_load(root: str) -> dict[str, Any]:
    return {
        "fsdp_ws4->fsdp": load_layout(f"{root}/fsdp_ws4", "fsdp", False),
        "hsdp_ws4->tp": load_layout(f"{root}/hsdp_ws4", "tp", False),
        "fsdp_tp_ws4->fsdp_tp": load_layout(f"{root}/fsdp_tp_ws4", "fsdp_tp", False),
        "fsdp_ws4->fsdp (torch load)": load_layout(f"{root}/fsdp_ws4", "fsdp", True),
    }


def _phase_ws3_load(root: str) -> dict[str, Any]:
    return {
        "fsdp_tp_ws4->fsdp": load_layout(f"{root}/fsdp_tp_ws4", "fsdp", False, True),
        "hsdp_ws4->tp": load_layout(f"{root}/hsdp_ws4", "tp", False, True),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    """Checkpoints saved at world sizes 2 and 4 (and the 2 -> 4 loads done at 4)."""
    root = str(tmp_path_factory.mktemp("reshard"))
    s2 = run_distributed(_phase_ws2_save, 2, root)[0]
    r4 = run_distributed(_phase_ws4, 4, root)
    return root, s2, r4


def test_two_to_four_and_torch_written_to_hp(saved: tuple[str, Any, Any]) -> None:
    _, s2, r4 = saved
    for rank_result in r4:
        got = rank_result["loaded"]
        assert_same_state(got["fsdp_ws2->hsdp"], s2["fsdp"], "fsdp@2 -> hsdp@4")
        assert_same_state(got["tp_ws2->fsdp_tp"], s2["tp"], "tp@2 -> fsdp_tp@4")
        assert_same_state(got["torch_fsdp_ws2->tp (hp load)"], s2["torch_fsdp"], "torch->hp")
    s4 = r4[0]["saved"]
    # The layouts saved at 4 are genuinely different states (different sharding of the data).
    assert not torch.equal(s4["fsdp"]["model"]["w1.weight"], s4["fsdp_tp"]["model"]["w1.weight"])


def test_four_to_two_and_hp_written_to_torch(saved: tuple[str, Any, Any]) -> None:
    root, _, r4 = saved
    s4 = r4[0]["saved"]
    for rank_result in run_distributed(_phase_ws2_load, 2, root):
        assert_same_state(rank_result["fsdp_ws4->fsdp"], s4["fsdp"], "fsdp@4 -> fsdp@2")
        assert_same_state(rank_result["hsdp_ws4->tp"], s4["hsdp"], "hsdp@4 -> tp@2")
        assert_same_state(rank_result["fsdp_tp_ws4->fsdp_tp"], s4["fsdp_tp"], "fsdp_tp 4 -> 2")
        assert_same_state(rank_result["fsdp_ws4->fsdp (torch load)"], s4["fsdp"], "hp->torch")


def _hf_round_trip(root: str) -> dict[str, Any]:
    """Save an FSDP model as two consolidated HF files, read them back into TP."""
    model, opt, dp_rank = build("fsdp", init_seed=0, lr=0.01)
    train_step(model, opt, dp_rank)
    mapping = {"w1.weight": 1, "w1.bias": 1, "w2.weight": 2, "w2.bias": 2}
    writer = hp_dcp.HuggingFaceStorageWriter(
        f"{root}/hf", fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
    )
    hp_dcp.save(get_model_state_dict(model), storage_writer=writer)
    want = get_model_state_dict(model, options=FULL)
    dist.barrier()
    tp_model, _, _ = build("tp", init_seed=5, lr=0.01)
    sd = get_model_state_dict(tp_model)
    hp_dcp.load(sd, storage_reader=hp_dcp.HuggingFaceStorageReader(f"{root}/hf"))
    tp_model.load_state_dict(sd)
    return {"want": want, "got": get_model_state_dict(tp_model, options=FULL)}


def test_hf_storage_distributed_save_and_reshard_load(saved: tuple[str, Any, Any]) -> None:
    root = saved[0]
    results = run_distributed(_hf_round_trip, 2, root)
    want = results[0]["want"]
    for r in results:
        assert r["got"].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(r["got"][k], v), k
    files = sorted(p.name for p in (Path(root) / "hf").glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    offline = hp_dcp.load_hf_safetensors(Path(root) / "hf")
    assert offline.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(offline[k], v), k


def test_flipped_byte_is_named_on_every_rank(saved: tuple[str, Any, Any]) -> None:
    root = saved[0]
    victim = Path(root) / "a" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    for msg in run_distributed(_load_corrupted, 2, root):
        assert "__1_0.distcp" in msg
        assert "checksum mismatch" in msg


def test_four_to_three_and_strided_layout_recorded(saved: tuple[str, Any, Any]) -> None:
    root, _, r4 = saved
    s4 = r4[0]["saved"]
    for rank_result in run_distributed(_phase_ws3_load, 3, root):
        assert_same_state(rank_result["fsdp_tp_ws4->fsdp"], s4["fsdp_tp"], "fsdp_tp@4 -> fsdp@3")
        assert_same_state(rank_result["hsdp_ws4->tp"], s4["hsdp"], "hsdp@4 -> tp@3")
    sums = hp_dcp.storage.read_checksums(Path(root) / "fsdp_tp_ws4")
    assert sums is not None
    layout = sums["layouts"]["model.w1.weight"]
    assert layout["mesh_shape"] == [2, 2]
    assert layout["placements"][0].startswith("_StridedShard(dim=0")
