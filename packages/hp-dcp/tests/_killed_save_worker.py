"""One rank of a 2-rank job that commits a checkpoint, then dies by SIGKILL in the next save.

Run by ``test_crash_safety.py`` in its own subprocesses (never in the warm pool). Usage:
``python _killed_save_worker.py RANK PORT CHECKPOINT_DIR``. Rank 1 kills itself after its files
for the second save are written but before the coordinator can commit.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.futures import Future

import hp_dcp


class _DyingWriter(hp_dcp.FileSystemWriter):
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return fut


def _state(value: float) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((3, 4), value + dist.get_rank())
    return {"w": DTensor.from_local(local, mesh, [Shard(0)]), "step": int(value)}


def main() -> None:
    rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    hp_dcp.save(_state(1.0), checkpoint_id=path)
    dist.barrier()
    print("first save committed", flush=True)
    hp_dcp.save(_state(2.0), storage_writer=_DyingWriter(path))
    print("second save unexpectedly finished", flush=True)


if __name__ == "__main__":
    main()
