"""The switch behind :func:`hp_fsdp.integrations.use_hp_fsdp` (private module).

Clients such as HF Accelerate and the ``transformers`` Trainer reach torch's FSDP2 by looking a
name up in ``torch.distributed.fsdp`` *when they call it* (``from torch.distributed.fsdp import
fully_shard`` inside a function, ``dist.fsdp.register_fsdp_forward_method(...)``). Rebinding those
module attributes therefore redirects exactly their FSDP2 path and nothing else; restoring the
saved objects puts torch's back. The client sources are read (``ast``, never executed or patched)
to find the names they use, so a client that calls an FSDP2 name hp-fsdp lacks, or binds one at
import time where a rebinding cannot reach it, is refused when the switch is installed, not
mid-training.
"""

from __future__ import annotations

import ast
import functools
import gc
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch.distributed.fsdp as _torch_fsdp_module  # interop: the namespace the switch rebinds

import hp_fsdp

__all__ = [
    "CLIENT_MODULES",
    "ENV_VAR",
    "TORCH_FSDP_MODULE",
    "ClientUse",
    "HpFsdpSwitch",
    "client_fsdp_uses",
    "fsdp2_names",
    "hp_fsdp_active",
    "install_from_env",
    "restore_torch_fsdp",
    "use_hp_fsdp",
]

#: The environment variable :func:`install_from_env` reads.
ENV_VAR = "HP_FSDP_BACKEND"
#: The module whose FSDP2 attributes the switch rebinds.
TORCH_FSDP_MODULE = "torch.distributed.fsdp"
#: Client modules whose FSDP2 path the switch serves; their sources are checked at switch time
#: (those not installed are skipped). ``transformers.distributed`` (sharding at load time with
#: ``from_pretrained(distributed_config=...)``) binds ``fully_shard`` at import and is not one of
#: them: that path keeps torch's FSDP2.
CLIENT_MODULES: tuple[str, ...] = (
    "accelerate.accelerator",
    "accelerate.utils.fsdp_utils",
    "accelerate.utils.dataclasses",
    "accelerate.utils.other",
    "accelerate.utils.modeling",
    "transformers.trainer",
)
_VALUES = {"hp": True, "torch": False, "": False}

#: torch's objects saved while the switch is installed (None when it is not): process state by
#: nature, since the switch rebinds attributes of a torch module.
_saved: dict[str, object] | None = None


def fsdp2_names() -> tuple[str, ...]:
    """The FSDP2 names of the installed torch's ``torch.distributed.fsdp`` (FSDP1 excluded).

    torch tags its FSDP2 exports with ``__module__ == "torch.distributed.fsdp"``; the FSDP1
    classes keep the module that defines them.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: one of them.
    """
    saved = _saved or {}
    names = []
    for name in _torch_fsdp_module.__all__:
        obj = saved.get(name, getattr(_torch_fsdp_module, name))  # torch's, even while switched
        if getattr(obj, "__module__", None) == TORCH_FSDP_MODULE:
            names.append(name)
    return tuple(sorted(names))


@dataclass(frozen=True)
class ClientUse:
    """One FSDP name a client module uses.

    Fields: ``module`` (the client module, ``accelerate.utils.fsdp_utils``), ``line`` (the line
    of the use), ``name`` (the dotted torch name, ``torch.distributed.fsdp.fully_shard``) and
    ``at_import`` (True when the name is bound at module level, at import time).

    See Also:
        :func:`client_fsdp_uses`.
    """

    module: str
    line: int
    name: str
    at_import: bool


def _source_path(module: str) -> Path | None:
    """The file of ``module`` without importing it (None when its package is not installed)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)))
    parts = rest.split(".") if rest else []
    candidate = base.joinpath(*parts).with_suffix(".py") if parts else base / "__init__.py"
    if candidate.is_file():
        return candidate
    package = base.joinpath(*parts) / "__init__.py"
    return package if package.is_file() else None


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _Scanner(ast.NodeVisitor):
    """Collects the ``torch.distributed.fsdp`` names a module imports or reaches by attribute."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.depth = 0  # > 0 inside a function body
        self.aliases: dict[str, str] = {}
        self.uses: list[ClientUse] = []

    def _add(self, node: ast.AST, name: str) -> None:
        self.uses.append(ClientUse(self.module, node.lineno, name, self.depth == 0))  # type: ignore[attr-defined]

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname is not None:
                self.aliases[alias.asname] = alias.name
            if alias.name.startswith(TORCH_FSDP_MODULE + "._fully_shard"):
                self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = node.module or ""
        internals = (TORCH_FSDP_MODULE + "._fully_shard", "torch.distributed._composable.fsdp")
        if source == TORCH_FSDP_MODULE or source.startswith(internals):
            for alias in node.names:
                self._add(node, f"{source}.{alias.name}")
        elif source == "torch.distributed":
            for alias in node.names:
                if alias.name == "fsdp":
                    self.aliases[alias.asname or alias.name] = TORCH_FSDP_MODULE

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is not None:
            head, _, tail = dotted.partition(".")
            full = f"{self.aliases.get(head, head)}.{tail}" if tail else dotted
            prefix = TORCH_FSDP_MODULE + "."
            if full.startswith(prefix):
                first = full[len(prefix) :].split(".")[0]
                self._add(node, prefix + first)
                return  # the chain's inner nodes name the same thing
        self.generic_visit(node)


def client_fsdp_uses(modules: tuple[str, ...] = CLIENT_MODULES) -> list[ClientUse]:
    """Every ``torch.distributed.fsdp`` name the installed client modules use (read, not run).

    Args:
        modules: dotted module names; those whose package is not installed are skipped.

    Returns:
        The uses, in module and line order.

    Raises:
        TypeError: when ``modules`` is not a tuple of strings.

    See Also:
        :func:`use_hp_fsdp`: refuses the uses it cannot serve.
    """
    if not isinstance(modules, tuple) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"modules must be a tuple of module names, got {modules!r}")
    uses: list[ClientUse] = []
    for module in modules:
        path = _source_path(module)
        if path is not None:
            uses.extend(_scan_file(module, str(path), path.stat().st_mtime_ns))
    return uses


@functools.lru_cache(maxsize=64)
def _scan_file(module: str, path: str, mtime_ns: int) -> tuple[ClientUse, ...]:
    """The uses in one source file (cached per file version: parsing takes ~0.1 s a file)."""
    del mtime_ns  # part of the cache key only
    scanner = _Scanner(module)
    scanner.visit(ast.parse(Path(path).read_text(encoding="utf-8"), filename=path))
    return tuple(scanner.uses)


def _plan(uses: list[ClientUse]) -> dict[str, object]:
    """The FSDP2 names to rebind (name -> hp-fsdp object); raises for what cannot be served."""
    fsdp2 = set(fsdp2_names())
    prefix = TORCH_FSDP_MODULE + "."
    plan: dict[str, object] = {}
    problems: list[str] = []
    for use in uses:
        where = f"{use.module}:{use.line}"
        short = use.name[len(prefix) :] if use.name.startswith(prefix) else None
        if short is None or "." in short or short.startswith("_"):
            if short in ("fully_sharded_data_parallel", "wrap", "sharded_grad_scaler", "api"):
                continue  # FSDP1 modules and the shared wrap policies: torch's, untouched
            problems.append(f"{where} uses {use.name}, an FSDP2 internal hp-fsdp does not replace")
            continue
        if short not in fsdp2:
            continue  # an FSDP1 name (FullyShardedDataParallel, StateDictType, ...): torch's
        if not hasattr(hp_fsdp, short):
            problems.append(f"{where} uses {use.name}, which hp_fsdp does not provide")
            continue
        if use.at_import:
            problems.append(
                f"{where} binds {use.name} at import time, where the switch cannot reach it"
            )
            continue
        plan[short] = getattr(hp_fsdp, short)
    if problems:
        raise RuntimeError(
            "hp_fsdp.integrations.use_hp_fsdp: the installed FSDP2 clients use torch names the "
            "switch cannot serve:\n  " + "\n  ".join(problems)
        )
    return plan


def _torch_sharded_roots(torch_fsdp_module_cls: type) -> list[str]:
    """Descriptions of live modules sharded by torch's own ``fully_shard``.

    Garbage is collected first: a dropped model whose modules and FSDP state reference each
    other stays in ``gc.get_objects()`` until the next collection, and is not alive.
    """
    gc.collect()
    found = []
    for obj in gc.get_objects():
        cls = type(obj)  # not isinstance: some lazy objects warn when asked for __class__
        if issubclass(cls, torch_fsdp_module_cls) and not issubclass(cls, hp_fsdp.FSDPModule):
            found.append(cls.__name__)
    return found


def hp_fsdp_active() -> bool:
    """Whether the switch is installed (``torch.distributed.fsdp`` names resolve to hp-fsdp's).

    See Also:
        :func:`use_hp_fsdp`, :func:`restore_torch_fsdp`.
    """
    return _saved is not None


class HpFsdpSwitch:
    """The installed switch, as returned by :func:`use_hp_fsdp`; a context manager.

    Leaving a ``with`` block restores torch's objects when this handle installed the switch (a
    nested :func:`use_hp_fsdp` leaves it to the outer one).

    Attributes:
        names: the ``torch.distributed.fsdp`` names rebound to hp-fsdp's objects.

    See Also:
        :func:`use_hp_fsdp`, :func:`restore_torch_fsdp`.
    """

    def __init__(self, names: tuple[str, ...], owner: bool) -> None:
        self.names = names
        self._owner = owner

    def __enter__(self) -> HpFsdpSwitch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owner:
            restore_torch_fsdp()

    def __repr__(self) -> str:
        return f"HpFsdpSwitch(names={self.names!r})"


def use_hp_fsdp(*, allow_torch_sharded: bool = False) -> HpFsdpSwitch:
    """Route HF Accelerate's and the transformers Trainer's FSDP2 path to hp-fsdp.

    Rebinds, in ``torch.distributed.fsdp``, the FSDP2 names the installed clients use (those
    in ``hp_fsdp.integrations.CLIENT_MODULES``; ``fully_shard``, ``FSDPModule``,
    ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy`` and
    ``register_fsdp_forward_method`` with Accelerate 1.16 and transformers 5.25) to hp-fsdp's
    objects, until :func:`restore_torch_fsdp` or the end of the ``with`` block. Nothing on disk
    changes and no other name is touched. Keep the switch on for the whole job: a model sharded
    by hp-fsdp is not an instance of torch's ``FSDPModule``, so a client that checks it after the
    switch is gone takes its non-FSDP path.

    Args:
        allow_torch_sharded: keyword-only: do not refuse when modules sharded by torch's
            ``fully_shard`` are alive (an older model still referenced somewhere). They keep
            running on torch's FSDP2 runtime, but a client that checks one of them with
            ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` while the switch is on does not
            see it as FSDP2: do not hand them to Accelerate or the Trainer until
            :func:`restore_torch_fsdp`.

    Returns:
        A :class:`HpFsdpSwitch` (use it in a ``with`` statement, or ignore it).

    Raises:
        TypeError: when ``allow_torch_sharded`` is not a bool.
        RuntimeError: when a live module is already sharded by torch's ``fully_shard`` (mixing
            the two runtimes in one process is refused unless ``allow_torch_sharded``), or when
            an installed client uses an FSDP2 name hp-fsdp lacks or binds one at import time
            (the message names each use).

    Example:
        .. code-block:: python

            from hp_fsdp.integrations import use_hp_fsdp

            with use_hp_fsdp():
                trainer.train()  # Accelerate's fsdp2_prepare_model calls hp_fsdp.fully_shard

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: the function the clients call (replaced).
    """
    global _saved
    if _saved is not None:
        return HpFsdpSwitch(tuple(sorted(_saved)), owner=False)
    if not isinstance(allow_torch_sharded, bool):
        raise TypeError(
            f"allow_torch_sharded must be a bool, got {type(allow_torch_sharded).__name__}"
        )
    roots = [] if allow_torch_sharded else _torch_sharded_roots(_torch_fsdp_module.FSDPModule)
    if roots:
        more = f" and {len(roots) - 3} more" if len(roots) > 3 else ""
        raise RuntimeError(
            "hp_fsdp.integrations.use_hp_fsdp: modules already sharded by torch's fully_shard "
            f"are alive ({', '.join(roots[:3])}{more}); switch before sharding (hp-fsdp and "
            "torch's FSDP2 cannot share a model), drop those modules first, or pass "
            "allow_torch_sharded=True if they are never handed to a client while switched"
        )
    plan = _plan(client_fsdp_uses(CLIENT_MODULES))  # read at call time: extendable
    saved = {name: getattr(_torch_fsdp_module, name) for name in plan}
    for name, obj in plan.items():
        setattr(_torch_fsdp_module, name, obj)
    _saved = saved
    return HpFsdpSwitch(tuple(sorted(plan)), owner=True)


def restore_torch_fsdp() -> bool:
    """Put torch's FSDP2 objects back into ``torch.distributed.fsdp``.

    Returns:
        True when the switch was installed (and is now removed), False when it was not.

    See Also:
        :func:`use_hp_fsdp`.
    """
    global _saved
    if _saved is None:
        return False
    saved, _saved = _saved, None
    for name, obj in saved.items():
        setattr(_torch_fsdp_module, name, obj)
    return True


def install_from_env(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Install the switch when ``HP_FSDP_BACKEND=hp`` (``torch`` or unset: leave torch's).

    Importing ``hp_fsdp`` calls this once, so ``HP_FSDP_BACKEND=hp`` plus ``import hp_fsdp``
    (in the training script or a ``sitecustomize``) is enough; ``python -m hp_fsdp.integrations``
    installs the switch whatever the variable says.

    Args:
        environ: the environment to read (default: ``os.environ``).

    Returns:
        Whether the switch is installed afterwards.

    Raises:
        ValueError: for a value other than ``hp``, ``torch`` or empty.
        RuntimeError: as :func:`use_hp_fsdp`.

    See Also:
        :func:`use_hp_fsdp`.
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip().lower()
    if value not in _VALUES:
        raise ValueError(f"{ENV_VAR} must be 'hp' or 'torch' (or unset), got {env.get(ENV_VAR)!r}")
    if _VALUES[value]:
        use_hp_fsdp()
    return hp_fsdp_active()
