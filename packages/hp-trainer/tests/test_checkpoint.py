"""CheckpointManager: exact stop/resume, resume under another DP degree, keep-k, fallback.

The training loop lives in this file (tiny Llama 3 decoder sharded with FSDP, AdamW, a LambdaLR
warm-up and a rank-sharded data iterator whose state is a global sample position), so these
tests do not depend on the trainer. The oracle of a resumed run is the uninterrupted run of the
same job: bitwise in the same layout, ``rtol=1e-5`` under another data-parallel degree.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hp_dcp
import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed, run_distributed
from hp_trainer.components.checkpoint import CheckpointManager
from hp_trainer.models.common.decoder import Decoder, DecoderArgs
from hp_trainer.models.llama3 import llama3_flavors

# hp-fsdp's fully_shard when it exists (it does in this repo), torch's FSDP2 otherwise
if hasattr(hp_fsdp, "fully_shard"):
    fully_shard = hp_fsdp.fully_shard
else:  # pragma: no cover - only while hp-fsdp is unfinished
    from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 6  # divisible by dp degrees 1, 2, 3: the same global sample order at each
SEQ = 16
N = 3  # steps before the stop; the resumed run trains N more


@dataclass
class CkptConfig:
    """The checkpoint section the manager reads (TorchTitan's field names)."""

    enable: bool = True
    folder: str = "checkpoint"
    interval: int = N
    keep_latest_k: int = 0
    async_mode: str = "disabled"
    last_save_model_only: bool = False
    load_step: int = -1


class GlobalOrderData:
    """A rank's slice of one global sample order; its state is the global position."""

    def __init__(self, dp_rank: int, dp_degree: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.samples = torch.randint(0, vocab, (64, SEQ + 1), generator=gen)
        self.local = GLOBAL_BATCH // dp_degree
        self.offset = dp_rank * self.local
        self.pos = 0

    def next(self) -> torch.Tensor:
        idx = [(self.pos + self.offset + i) % len(self.samples) for i in range(self.local)]
        self.pos += GLOBAL_BATCH
        return self.samples[idx]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])


class StepCounter:
    """The trainer's own state (its step), saved through ``states``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def tiny_args() -> DecoderArgs:
    args = copy.deepcopy(llama3_flavors["tiny"])
    args.vocab_size = 128
    args.max_seq_len = SEQ
    return args


def build(init_seed: int, folder: str, cfg: CkptConfig) -> dict[str, Any]:
    """Model (FSDP over all ranks), AdamW, LR schedule, data, step counter and manager."""
    sharded = dist.is_initialized()  # else: one process, plain (unsharded) parameters
    ws, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    torch.manual_seed(init_seed)
    model = Decoder(tiny_args())
    model.init_weights()
    if sharded:
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    data = GlobalOrderData(rank, ws, model.args.vocab_size)
    counter = StepCounter()
    manager = CheckpointManager(
        data, [model], [opt], [sched], {"train_state": counter}, cfg, base_folder=folder
    )
    return {"model": model, "opt": opt, "sched": sched, "data": data, "counter": counter,
            "manager": manager}  # fmt: skip


def train(parts: dict[str, Any], until: int, noise: bool) -> list[float]:
    """Train to step ``until``; ``noise`` corrupts inputs with the (per-rank) global RNG."""
    model, opt, sched = parts["model"], parts["opt"], parts["sched"]
    counter, manager = parts["counter"], parts["manager"]
    losses = []
    while counter.step < until:
        batch = parts["data"].next()
        inputs, labels = batch[:, :-1], batch[:, 1:]
        if noise:  # depends on the RNG state: an unrestored generator changes the losses
            mask = torch.rand(inputs.shape) < 0.2
            inputs = torch.where(mask, torch.randint_like(inputs, 128), inputs)
        opt.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        sched.step()
        counter.step += 1
        reported = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(reported)
            reported /= dist.get_world_size()
        losses.append(reported.item())
        manager.save(counter.step, last_step=counter.step == until)
    manager.close()
    return losses


def stop_and_resume(folder: str, async_mode: str) -> tuple[list[float], list[float]]:
    """Uninterrupted 2N steps (saving at N), then a rebuilt job resumed from step N."""
    torch.manual_seed(rank_seed(7))
    cfg = CkptConfig(async_mode=async_mode)
    first = build(0, folder, cfg)
    full = train(first, 2 * N, noise=True)
    del first
    torch.manual_seed(rank_seed(99))  # a different generator state: the load must restore it
    second = build(5, folder, cfg)  # different init: the load must overwrite it
    assert second["manager"].load(step=N)
    assert second["counter"].step == N
    assert second["data"].pos == N * GLOBAL_BATCH
    resumed = train(second, 2 * N, noise=True)
    return full, resumed


def print_table(title: str, full: list[float], resumed: list[float]) -> None:
    print(f"\n{title}\n| step | uninterrupted | resumed | difference |\n|---|---|---|---|")
    for i, value in enumerate(full):
        step = i + 1
        r = resumed[i - N] if step > N else None
        diff = "" if r is None else f"{r - value:+.3e}"
        shown = "" if r is None else f"{r:.9f}"
        print(f"| {step} | {value:.9f} | {shown} | {diff} |")


# synchronous saves: test_trainer_resume.py (the trainer stopped and resumed bitwise)
@pytest.mark.parametrize("async_mode", ["async"])
def test_stop_resume_is_bitwise_in_same_layout(tmp_path: Path, async_mode: str) -> None:
    results = run_distributed(stop_and_resume, 2, str(tmp_path), async_mode)
    full, resumed = results[0]
    print_table(f"stop at {N}, resume to {2 * N} (ws=2, FSDP, {async_mode} save)", full, resumed)
    assert resumed == full[N:]  # bitwise: same layout, fp32, restored RNG and data position
    names = {p.name for p in (tmp_path / "checkpoint").iterdir()}
    assert names == {f"step-{N}", f"step-{2 * N}"}


# grouped with the ws=2 tests by the harness's pytest plugin (one pool start for all of them)
test_stop_resume_is_bitwise_in_same_layout.__hp_world_size__ = 2  # type: ignore[attr-defined]


def train_from(folder: str, load: bool) -> list[float]:
    """Without input noise (per-rank RNG streams differ across degrees): N or 2N steps."""
    torch.manual_seed(rank_seed(3))
    parts = build(0 if not load else 11, folder, CkptConfig())
    if load:
        assert parts["manager"].load(step=N)
    return train(parts, 2 * N, noise=False)


def test_resume_under_other_dp_degree(tmp_path: Path) -> None:
    full = run_distributed(train_from, 2, str(tmp_path), False)[0]
    resumed = run_distributed(train_from, 3, str(tmp_path), True)
    assert resumed[0] == resumed[1] == resumed[2]
    single = train_from(str(tmp_path), True)  # this process: no process group, no FSDP
    for label, losses in (("ws=3 (FSDP)", resumed[0]), ("ws=1 (unsharded)", single)):
        print_table(f"saved at ws=2 (FSDP), step {N}; resumed at {label}", full, losses)
        torch.testing.assert_close(
            torch.tensor(losses, dtype=torch.float64),
            torch.tensor(full[N:], dtype=torch.float64),
            rtol=1e-5,
            atol=0.0,
        )


# runs after the ws=2 group (its pool is still warm), then leaves the ws=3 pool to the ws=3 group
test_resume_under_other_dp_degree.__hp_world_size__ = 3  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def small_manager(
    folder: Path, model: nn.Module | None = None, **options: Any
) -> tuple[nn.Module, CheckpointManager]:
    if model is None:
        torch.manual_seed(0)
        model = Small()
        fully_shard(model)
    cfg = CkptConfig(interval=1, **options)
    return model, CheckpointManager(None, [model], None, None, {}, cfg, base_folder=folder)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


@distributed(world_size=2)
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_keep_latest_k(folder: str, async_mode: str) -> None:
    model, manager = small_manager(Path(folder), keep_latest_k=2, async_mode=async_mode)
    manager.create_seed_checkpoint()
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert manager.save(step)
    manager.close()
    dist.barrier()
    assert manager.list_steps() == [0, 4, 5]  # the seed checkpoint is never purged
    assert not any(p.name.startswith(".") for p in Path(folder, "checkpoint").iterdir())


@pytest.fixture
def folder(tmp_path: Path) -> str:
    return str(tmp_path)


@distributed(world_size=2)
def test_corrupted_latest_falls_back(folder: str) -> None:
    model, manager = small_manager(Path(folder))
    saved = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * step)
        manager.save(step)
        saved[step] = full_params(model)
    dist.barrier()
    victim = ""
    if dist.get_rank() == 0:
        path = Path(folder, "checkpoint", "step-2")
        sums = json.loads((path / ".hp_dcp_checksums.json").read_text())
        name, entry = max(
            ((n, e) for n, e in sums["files"].items() if n.endswith(".distcp")),
            key=lambda ne: max(length for _, length, _ in ne[1]["items"]),
        )
        offset, length, _ = max(entry["items"], key=lambda item: item[1])
        data = bytearray((path / name).read_bytes())
        data[offset + length // 2] ^= 0x10
        (path / name).write_bytes(bytes(data))
        victim = name
    box = [victim]
    dist.broadcast_object_list(box)
    victim = box[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    _, fresh = small_manager(Path(folder), model)  # a new manager loads into the zeroed model
    assert fresh.load()
    assert fresh.loaded_step == 1
    assert [s for s, _ in fresh.skipped] == [2]
    assert victim in fresh.skipped[0][1]  # the error names the corrupted file
    for k, v in full_params(model).items():
        assert torch.equal(v, saved[1][k]), k
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match=victim):
        fresh.load(step=2)  # an explicitly requested step does not fall back


@distributed(world_size=2)
def test_seed_checkpoint_and_bf16_model_only_export(folder: str) -> None:
    model, manager = small_manager(Path(folder))
    seed = full_params(model)
    manager.create_seed_checkpoint()
    # a fresh job (other init) finds only the seed: it loads the model from it, nothing else
    torch.manual_seed(1)
    other = Small()
    fully_shard(other)
    opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    cfg = CkptConfig(interval=1, last_save_model_only=True)
    cfg.export_dtype = "bfloat16"  # type: ignore[attr-defined]
    fresh = CheckpointManager(None, [other], [opt], None, {}, cfg, base_folder=folder)
    assert fresh.load()
    assert fresh.loaded_step == 0
    for k, v in full_params(other).items():
        assert torch.equal(v, seed[k]), k
    with torch.no_grad():  # values that bf16 rounds
        for p in other.parameters():
            p.mul_(1.001)
    trained = full_params(other)
    assert fresh.save(4, last_step=True)
    entries = {e.key: e for e in hp_dcp.describe_checkpoint(Path(folder, "checkpoint", "step-4"))}
    assert set(entries) == {f"model.{k}" for k in trained}  # model only: no optimizer, no RNG
    assert all(e.dtype == torch.bfloat16 for e in entries.values())
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    assert fresh.load()  # the newest is the bf16 model-only export: the model alone
    assert fresh.loaded_step == 4
    for k, v in full_params(other).items():
        assert torch.equal(v, trained[k].to(torch.bfloat16).float()), k


@distributed(world_size=2)
def test_trainer_containers_round_trip(folder: str) -> None:
    """hp-trainer's OptimizersContainer / LRSchedulersContainer / CheckpointConfig plug in."""
    from hp_trainer.components.lr import build_lr_schedulers
    from hp_trainer.components.optimizer import build_optimizers
    from hp_trainer.config import CheckpointConfig, LRSchedulerConfig, OptimizerConfig

    def job(seed: int) -> tuple[nn.Module, Any, Any, CheckpointManager]:
        model, _ = small_manager(Path(folder))
        opts = build_optimizers([model], OptimizerConfig(lr=0.1))
        scheds = build_lr_schedulers(opts, 10, LRSchedulerConfig(warmup_steps=2))
        cfg = CheckpointConfig(enable=True, interval=2)
        manager = CheckpointManager(None, [model], opts, scheds, {}, cfg, base_folder=folder)
        torch.manual_seed(rank_seed(seed))
        return model, opts, scheds, manager

    model, opts, scheds, manager = job(0)
    for step in (1, 2):
        loss = model(torch.randn(4, 8)).square().sum()
        loss.backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
        manager.save(step)
    assert manager.list_steps() == [2]
    assert not manager.save(3)
    assert manager.save(3, force=True)  # e.g. on SIGTERM: off-interval, full, synchronous
    assert manager.list_steps() == [2, 3]
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
    exp_avg = [s["exp_avg"].full_tensor() for s in opts.optimizers[0].state.values()]
    model2, opts2, scheds2, manager2 = job(1)
    assert manager2.load(step=2)
    assert scheds2.schedulers[0].last_epoch == 2
    assert scheds2.get_last_lr() == scheds.get_last_lr()
    for k, v in model2.state_dict().items():
        assert torch.equal(v.full_tensor(), expected[k]), k
    got = [s["exp_avg"].full_tensor() for s in opts2.optimizers[0].state.values()]
    assert all(torch.equal(a, b) for a, b in zip(got, exp_avg, strict=True))


class PerRankLoader:
    """A loader whose position differs by rank (DCP would keep one rank's copy if not split)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])


@distributed(world_size=2)
def test_per_rank_dataloader_state_is_kept_per_rank(folder: str) -> None:
    model, _ = small_manager(Path(folder))
    loader = PerRankLoader()
    manager = CheckpointManager(loader, [model], None, None, {}, CkptConfig(), base_folder=folder)
    loader.pos = 100 + dist.get_rank()
    manager.save(N)
    keys = {e.key for e in hp_dcp.describe_checkpoint(Path(folder, "checkpoint", f"step-{N}"))}
    assert {"dataloader._per_rank.0.pos", "dataloader._per_rank.1.pos"} <= keys
    loader.pos = -1
    assert manager.load()
    assert loader.pos == 100 + dist.get_rank()


def test_rng_state_round_trip_single_process() -> None:
    import random

    from hp_trainer.components.checkpoint import RNGState

    rng = RNGState()
    random.seed(5)
    random.gauss(0.0, 1.0)  # leaves a cached gauss value in Python's state
    torch.manual_seed(5)
    state = copy.deepcopy(rng.state_dict())
    assert set(state) == {"rank_0"}
    expected = (random.random(), random.gauss(0.0, 1.0), torch.rand(3))
    random.seed(6)
    torch.manual_seed(6)
    rng.load_state_dict(state)
    got = (random.random(), random.gauss(0.0, 1.0), torch.rand(3))
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2])
