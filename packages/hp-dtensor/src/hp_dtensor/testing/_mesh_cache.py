"""Device meshes a worker hands out again, as the same object, to a later job's equal request.

DTensor caches its sharding propagation (and redistribution plans) keyed by mesh *equality*, and
a hit hands back the output specs of the first call, holding the first call's mesh object. Within
one program every rank builds its meshes once, so the object is the one it uses. In a pool worker
every job builds its meshes again: a later job's equal mesh would get specs naming an earlier
job's object, which torch's ``fully_shard`` refuses ("different mesh objects"), and whose groups
may be gone. Clearing the caches after every job was safe but a TP job then propagated every
sharding again (about 40% of a TP parity job's CPU).

A worker installs one :class:`MeshCache`: ``DeviceMesh(...)`` (what ``init_device_mesh`` and
``_flatten`` call) with default backend options, in a later job, returns the object an earlier job
built for an equal mesh (a flattened mesh: for an equal mesh of the same root), emptied and
initialized again, so its state is fresh (no flattened meshes, groups from the
:class:`~hp_dtensor.testing._group_cache.GroupCache`) and only its identity is kept. Inside one job
an equal mesh built again (a second trainer) is the same object with its state (torch would make
an equal one, which DTensor's caches would mix up with the first), unless its groups were
destroyed in between. After a job, DTensor's caches are kept unless something could make an
entry stale, and then they are cleared and the meshes forgotten (:meth:`MeshCache.end_job` says
why):

- a process group the job used is gone (the test destroyed it, or it was made with options and
  the harness destroyed it): specs name groups by name;
- the job built meshes with backend options, an equal mesh again after its groups were
  destroyed, or the cache was off for it (``fresh_meshes=True``): entries may name a mesh object
  no later job is given;
- a sharding rule was registered, or the rule tables differ (entries computed by another rule).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

#: The registries of torch's sharding propagator whose change makes cached propagations stale.
_RULE_TABLES = (
    "op_to_rules",
    "op_strategy_funcs",
    "op_single_dim_strategy_funcs",
    "op_to_schema_info",
    "op_to_schema_info_for_single_dim_strategy",
)

#: The propagator's registration methods (a rule registered and restored within one job leaves
#: no trace in the tables, but cached entries computed by it).
_REGISTRATIONS = (
    "register_sharding_prop_rule",
    "register_op_strategy",
    "register_single_dim_op_strategy",
)


def _groups_alive(mesh: Any) -> bool:
    """Whether every group ``mesh`` and its flattened meshes name is still registered."""
    from hp_dtensor._torch_compat import c10d_world

    alive = set(c10d_world.pg_names.values())
    meshes = [mesh, *getattr(mesh, "_flatten_mapping", {}).values()]
    return all(name in alive for m in meshes for name in getattr(m, "_dim_group_names", ()))


def _default_options(backend_override: Any) -> bool:
    return backend_override is None or all(o == (None, None) for o in backend_override)


class MeshCache:
    """Meshes of a worker, kept across jobs as objects (installed once per worker)."""

    def __init__(self) -> None:
        self._meshes: dict[Hashable, Any] = {}
        self._given: set[int] = set()  # ids of kept meshes handed out in the current job
        self._enabled = True
        self._stale = ""
        self._rules: list[dict[Any, Any]] = []
        self._groups: set[Any] = set()
        self._skip_init: Any = None
        #: meshes handed out again in a later job, and again in the same job
        self.reused = 0
        self.shared = 0

    def __len__(self) -> int:
        return len(self._meshes)

    def install(self) -> None:
        """Route ``DeviceMesh`` construction through the cache; watch rule registrations."""
        from torch.distributed.device_mesh import DeviceMesh

        from hp_dtensor._torch_compat import dtensor_sharding_propagator as propagator

        DeviceMesh.__new__ = self._constructing(DeviceMesh)  # type: ignore[method-assign]
        DeviceMesh.__init__ = self._initializing(DeviceMesh.__init__)  # type: ignore[method-assign]
        for name in _REGISTRATIONS:
            if hasattr(propagator, name):
                setattr(propagator, name, self._watching(getattr(propagator, name), name))

    def _watching(self, register: Callable[..., Any], name: str) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._stale = f"a sharding rule registered ({name})"
            return register(*args, **kwargs)

        return watched

    def _constructing(self, mesh_class: type) -> Callable[..., Any]:
        original_init = mesh_class.__init__  # type: ignore[misc]  # before _initializing

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            if cls is not mesh_class or not (args or kwargs):  # subclasses, unpickling, copies
                return object.__new__(cls)
            if (
                not self._enabled
                or not kwargs.get("_init_backend", True)
                or kwargs.get("_rank") is not None
                or not _default_options(kwargs.get("backend_override"))
            ):
                if not _default_options(kwargs.get("backend_override")):
                    self._stale = "a mesh with backend options"
                return object.__new__(cls)
            root = kwargs.get("_root_mesh")
            if root is not None and id(root) not in self._given:
                return object.__new__(cls)  # a flattened mesh of a root that is not kept
            probe: Any = object.__new__(cls)
            original_init(probe, *args, **{**kwargs, "_init_backend": False})
            if probe._thread_id is not None:  # threaded backend: meshes are per thread
                return probe
            key = (probe._hash_key(), id(root))
            mesh = self._meshes.get(key)
            if mesh is None:
                self._meshes[key] = probe
                self._given.add(id(probe))
                return probe
            if id(mesh) in self._given:  # built again in this job: the same object, as it is
                if not _groups_alive(mesh):  # its groups destroyed since: a new object
                    self._stale = "an equal mesh built again after its groups were destroyed"
                    return probe
                self._skip_init = mesh
                self.shared += 1
                return mesh
            mesh.__dict__.clear()  # initialized again by the call that asked for it
            self._given.add(id(mesh))
            self.reused += 1
            return mesh

        return new

    def _initializing(self, original_init: Callable[..., Any]) -> Callable[..., None]:
        def init(mesh: Any, *args: Any, **kwargs: Any) -> None:
            if self._skip_init is mesh:  # handed out again in its job: keep its state
                self._skip_init = None
                return
            original_init(mesh, *args, **kwargs)

        return init

    def begin_job(self, *, enabled: bool = True) -> None:
        """Start of a job: remember the groups and sharding rules it starts with."""
        from hp_dtensor._torch_compat import c10d_world, dtensor_sharding_propagator

        self._given = set()
        self._stale = "" if enabled else "the job asked for fresh meshes"
        self._enabled = enabled
        self._groups = set(c10d_world.pg_map)
        self._rules = [dict(getattr(dtensor_sharding_propagator, t, {})) for t in _RULE_TABLES]

    def end_job(self, destroyed: int) -> str:
        """End of a job, after the harness destroyed the test's own groups (``destroyed``: the
        groups destroyed since the job began, by the test and by the harness).

        Returns why DTensor's caches must be cleared (and the meshes are then forgotten), or
        ``""`` when they stay valid for the next job.
        """
        from hp_dtensor._torch_compat import c10d_world, dtensor_sharding_propagator

        why = self._stale
        if not why and destroyed:
            why = f"{destroyed} process group(s) destroyed in or after the job"
        if not why and not self._groups <= set(c10d_world.pg_map):
            why = "a process group destroyed by the job"
        if not why:
            for table, before in zip(_RULE_TABLES, self._rules, strict=True):
                now = getattr(dtensor_sharding_propagator, table, {})
                if len(now) != len(before) or any(now.get(k) is not v for k, v in before.items()):
                    why = f"sharding rules changed ({table})"
                    break
        if why:
            self._meshes.clear()
        self._given = set()
        self._enabled = True
        self._stale = ""
        self._rules = []
        return why
