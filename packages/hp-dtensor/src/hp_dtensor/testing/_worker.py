"""The loop each worker process of a pool runs: one rank of a gloo process group."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import pickle
import random
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

from hp_dtensor.testing._expansion_memo import ExpansionMemo
from hp_dtensor.testing._group_cache import GroupCache
from hp_dtensor.testing._mesh_cache import MeshCache
from hp_dtensor.testing._meta_memo import MetaMemo

#: Set in worker processes so that decorated tests called inside a worker run directly.
IN_WORKER_ENV = "HP_DTENSOR_TESTING_WORKER"
#: Set to ``1`` to run DTensor's strategy expansion unmemoized in the workers (see
#: :mod:`hp_dtensor.testing._expansion_memo`).
NO_EXPANSION_MEMO_ENV = "HP_TESTING_NO_EXPANSION_MEMO"
#: Set to ``1`` to run DTensor's output-metadata propagation unmemoized in the workers (see
#: :mod:`hp_dtensor.testing._meta_memo`).
NO_META_MEMO_ENV = "HP_TESTING_NO_META_MEMO"
#: Threads a worker may gain over its start before a garbage collection. Every gloo group a test
#: leaves referenced keeps three threads alive after ``destroy_process_group``, and their loops
#: wake up while idle: a ws-4 pool that ran every 4-rank test of the suite reached about 1000
#: threads per worker, a load of 10-70 on two cores, and jobs 4-25x slower than alone. Most of
#: those groups are held by reference cycles (modules with hooks), which a collection frees.
COLLECT_THREADS = 96
#: Threads a worker may keep over its start after that collection before the pool is replaced.
SPARE_THREADS = 384


class WorkerCaches:
    """What this worker keeps between jobs, and why DTensor's caches were last cleared."""

    def __init__(self) -> None:
        self.groups = GroupCache()
        self.meshes = MeshCache()
        self.expansions = ExpansionMemo()
        self.metas = MetaMemo()
        #: jobs after which DTensor's caches were kept, and cleared
        self.kept = 0
        self.cleared = 0
        self.last_reason = ""
        #: sharding propagations DTensor computed (what none of its caches answered)
        self.propagations = 0

    def count_propagations(self) -> None:
        """Count the calls DTensor makes when its caches miss (they go through this attribute)."""
        from hp_dtensor._torch_compat import dtensor_sharding_propagator as propagator

        compute = propagator.propagate_op_sharding_non_cached

        def counted(op_schema: Any) -> Any:
            self.propagations += 1
            return compute(op_schema)

        propagator.propagate_op_sharding_non_cached = counted


#: This worker's caches (set in :func:`worker_main`; tests read their counters through a job).
CACHES: WorkerCaches | None = None


def _load_module(name: str, file: str | None) -> ModuleType:
    module = sys.modules.get(name)
    if module is not None:
        return module
    if file is None:
        return importlib.import_module(name)
    try:
        module = importlib.import_module(name)
        if os.path.realpath(getattr(module, "__file__", "") or "") == os.path.realpath(file):
            return module
    except Exception:
        pass  # not importable by name (pytest importlib-mode names): load by path
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test module {name!r} from {file!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(module: ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _clear_dtensor_caches() -> None:
    """Forget DTensor's sharding and redistribution caches.

    torch keys them by mesh equality, which ignores process-group names and object identity: an
    entry names the mesh object (and, by name, the groups) of the call that filled it.
    """
    from hp_dtensor._torch_compat import clear_sharding_prop_cache, redistribute_transform_infos

    clear_sharding_prop_cache()
    redistribute_transform_infos.cache_clear()
    if CACHES is not None:
        CACHES.expansions.clear()
        CACHES.metas.clear()


class _StateGuard:
    """Snapshot of process-wide state a test may change, restored after every job."""

    def __init__(self, caches: WorkerCaches) -> None:
        import torch

        from hp_dtensor._torch_compat import c10d_world

        self._caches = caches
        self._cache = caches.groups
        self._torch_rng = torch.random.get_rng_state()
        self._py_rng = random.getstate()
        self._dtype = torch.get_default_dtype()
        self._groups = set(c10d_world.pg_map)
        self._threads = set(_threads())
        self._destroyed = 0

    def begin(self, *, fresh_meshes: bool = False) -> None:
        """Before a job: a job that wants fresh meshes starts with empty DTensor caches."""
        if fresh_meshes:
            _clear_dtensor_caches()
        self._caches.meshes.begin_job(enabled=not fresh_meshes)
        self._destroyed = self._cache.destroyed

    def restore(self) -> None:
        import torch
        import torch.distributed as dist

        from hp_dtensor._torch_compat import c10d_world

        # Groups created by the test (meshes, new_group) are destroyed; the default group and the
        # groups the cache keeps for the next job stay. DTensor's caches key meshes by equality
        # and hand back the mesh *object* of the first call: they are kept for the next job only
        # while its equal meshes are the same objects with the same live groups (MeshCache).
        kept = self._cache.kept()
        for group in list(c10d_world.pg_map):
            if group not in self._groups and group not in kept:
                dist.destroy_process_group(group)
        why = self._caches.meshes.end_job(self._cache.destroyed - self._destroyed)
        if why:
            _clear_dtensor_caches()
            self._caches.cleared += 1
            self._caches.last_reason = why
        else:
            self._caches.kept += 1
        torch.random.set_rng_state(self._torch_rng)
        random.setstate(self._py_rng)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(0)
        torch.set_default_dtype(self._dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()

    def worn(self) -> str:
        """Why this worker should be replaced (threads of leaked gloo groups), or ``""``.

        Called after the test's groups are destroyed: a gloo thread alive then belongs to a group
        something still references. Past :data:`COLLECT_THREADS` extra threads the garbage
        cycles are collected (which frees most); past :data:`SPARE_THREADS` the worker is worn.
        """
        extra = len(_threads()) - len(self._threads)
        if extra > COLLECT_THREADS:
            gc.collect()
            extra = len(_threads()) - len(self._threads)
        if extra > SPARE_THREADS:
            return f"{extra} threads more than at start after a garbage collection"
        return ""


def _threads() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:  # not Linux: no thread accounting, pools are never replaced
        return []


def worker_main(
    rank: int, world_size: int, port: int, conn: Connection, sys_path: list[str]
) -> None:
    """Join the process group as ``rank`` and run jobs sent over ``conn`` until told to stop."""
    os.environ[IN_WORKER_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch
    import torch.distributed as dist

    # What the fork server imported (torch, the stack) lives as long as the worker: frozen, a
    # garbage collection in a test (a tool's gc.collect(), an automatic full one) no longer
    # walks it (a full collection: ~0.17 s -> a few ms).
    gc.freeze()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    global CACHES
    CACHES = caches = WorkerCaches()
    caches.groups.install()
    caches.meshes.install()
    if os.environ.get(NO_EXPANSION_MEMO_ENV) != "1":
        caches.expansions.install()
    if os.environ.get(NO_META_MEMO_ENV) != "1":
        caches.metas.install()
    caches.count_propagations()
    guard = _StateGuard(caches)
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            break
        module_name, module_file, qualname, payload, options = job
        started = time.process_time()
        cleared_before = caches.cleared
        misses_before = caches.propagations
        try:
            guard.begin(fresh_meshes=bool(options.get("fresh_meshes")))
            fn = _resolve(_load_module(module_name, module_file), qualname)
            args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            reply: tuple[str, Any] = ("ok", pickle.dumps(result))
        except BaseException as exc:  # report everything, including KeyboardInterrupt-like exits
            reply = ("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        misses = caches.propagations - misses_before
        worn = ""
        try:
            guard.restore()
            worn = guard.worn()
        except Exception:
            reply = ("err", f"state reset failed after the test:\n{traceback.format_exc()}")
        cleared = caches.last_reason if caches.cleared > cleared_before else ""
        conn.send((*reply, worn, time.process_time() - started, cleared, misses))
    dist.destroy_process_group()
