"""hp-dcp's one allow-list unpickler: reading a checkpoint never runs code from it.

Pickle is a small stack machine; the opcodes that can run code are ``GLOBAL``/``STACK_GLOBAL``
(look up any object by name), ``REDUCE``/``NEWOBJ``/``INST``/``OBJ`` (call it), ``BUILD`` (set
attributes, on a class too: that is how a crafted file rewrites ``pathlib.Path.exists`` for the
whole process), ``PERSID``/``BINPERSID`` and ``EXT*``. :class:`SafeUnpickler` runs the Python
unpickler with exactly those opcodes replaced:

* a global must be on an explicit :class:`AllowList` (or added by the user with
  ``torch.serialization.safe_globals``);
* ``REDUCE`` may call only the allow-list's constructors, ``NEWOBJ`` create only its classes;
* ``BUILD`` applies only to an *instance* of an allowed class, and only to its dataclass fields;
* ``INST``, ``OBJ``, ``EXT*`` and persistent ids (unless the caller handles them) are refused;
* items are appended or set only into plain lists, dicts and sets.

Torch's own ``weights_only`` unpickler follows the same rules but reads only protocol 2, while
DCP writes ``.metadata`` with protocol 4; hence this class for ``.metadata`` and for the tensor
pickles decoded in place, and ``torch.load(weights_only=True)`` (torch's equivalent) for byte
items, which are ``torch.save`` archives.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import dataclasses
import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import metadata as _dcp_md

from hp_dcp._torch_compat import MEM_FORMAT_ENCODING, HFStorageInfo, StorageInfo, get_layout
from hp_dcp.errors import CheckpointCorruptionError, UnsafeCheckpointError

__all__ = [
    "AllowList",
    "SafeUnpickler",
    "load_byte_item",
    "load_metadata",
    "weights_only_error",
    "weights_only_reason",
]

_PyUnpickler: type[Any] = pickle._Unpickler  # the pure-Python unpickler (opcode table)


@dataclasses.dataclass(frozen=True)
class AllowList:
    """What a pickle may reference.

    Attributes:
        globals: ``"module.name"`` -> the object a ``GLOBAL`` of that name yields.
        constructors: the objects ``REDUCE`` may call (each also in ``globals``).
        classes: the classes ``NEWOBJ`` may create and ``BUILD`` may fill (dataclasses, or
            classes with their own ``__setstate__``).
    """

    globals: Mapping[str, Any]
    constructors: frozenset[Any]
    classes: frozenset[type]


def _torch_values() -> dict[str, Any]:
    out: dict[str, Any] = {"torch.Size": torch.Size}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            out[f"torch.{name}"] = value
    return out


def _metadata_allow_list() -> AllowList:
    classes: list[type] = [
        _dcp_md.Metadata,
        _dcp_md.TensorStorageMetadata,
        _dcp_md.TensorProperties,
        _dcp_md.ChunkStorageMetadata,
        _dcp_md.BytesStorageMetadata,
        _dcp_md.MetadataIndex,
        _dcp_md.StorageMeta,
        StorageInfo,
        HFStorageInfo,
    ]
    constructors: list[Any] = [
        torch.Size,
        MEM_FORMAT_ENCODING,
        Path,
        PosixPath,
        PurePosixPath,
        OrderedDict,
        set,
        frozenset,
        bytearray,
        codecs.encode,
        *classes,
    ]
    names: dict[str, Any] = _torch_values()
    for obj in constructors:
        names[f"{obj.__module__}.{obj.__qualname__}"] = obj
    names["_codecs.encode"] = codecs.encode
    # torch.layout pickles as a call of this lookup by name (KeyError for unknown names).
    names["torch.serialization._get_layout"] = get_layout
    constructors.append(get_layout)
    return AllowList(names, frozenset(constructors), frozenset(classes))


METADATA_ALLOW_LIST = _metadata_allow_list()
"""The globals DCP ``.metadata`` may reference: DCP's metadata classes, torch dtypes, paths."""

_HOW_TO = (
    "hp-dcp never unpickles with the full unpickler; if you trust the file, allow the specific "
    "classes with torch.serialization.safe_globals([...])."
)


def _user_globals() -> dict[str, Any]:
    """Globals the user allowed with ``torch.serialization.safe_globals``/``add_safe_globals``."""
    out: dict[str, Any] = {}
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            obj, name = entry
            out[name] = obj
        else:
            out[f"{entry.__module__}.{entry.__qualname__}"] = entry
    return out


def _opcode(name: str) -> int:
    return int(getattr(pickle, name)[0])


class SafeUnpickler(_PyUnpickler):  # type: ignore[misc]
    """The Python unpickler with every code-running opcode restricted to an allow-list.

    Args:
        data: the pickle bytes.
        source: the file (and item) the bytes came from, named in errors.
        allow: what the pickle may reference.
        persistent_load: handles ``BINPERSID``; ``None`` refuses persistent ids.
    """

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_PyUnpickler.dispatch)

    def __init__(
        self,
        data: bytes,
        source: str,
        allow: AllowList,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source
        self._allow = allow
        self._user = _user_globals()
        self._persistent = persistent_load
        # Instances NEWOBJ made without running __init__: each must end with every field set.
        self._created: list[Any] = []

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{self._source}: refused {what}. {_HOW_TO}")

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # protocol 2 names Python 3 modules the Python 2 way
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full in self._allow.globals:
            return self._allow.globals[full]
        if full in self._user:
            return self._user[full]
        raise self._refuse(f"the global {full} (not on hp-dcp's allow-list)")

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._refuse(f"opcode BINPERSID (persistent id {pid!r:.60})")
        return self._persistent(pid)

    def _callable_ok(self, func: Any) -> bool:
        return func in self._allow.constructors or func in self._user.values()

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(args, tuple) or not self._callable_ok(func):
            raise self._refuse(f"opcode REDUCE calling {func!r:.80}")
        if func is codecs.encode and (
            len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1")
        ):
            raise self._refuse(
                "opcode REDUCE calling _codecs.encode with arguments other than (str, 'latin1')"
            )
        self.stack[-1] = func(*args)

    def _newobj(self, cls: Any, args: Any, kwargs: Any) -> None:
        if not (isinstance(cls, type) and cls in self._allow.classes):
            raise self._refuse(f"opcode NEWOBJ creating {cls!r:.80}")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise self._refuse("opcode NEWOBJ with non-tuple arguments")
        inst: Any = cls.__new__(cls, *args, **kwargs)
        if dataclasses.is_dataclass(inst):
            self._created.append(inst)
        self.append(inst)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._newobj(cls, args, {})

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._newobj(cls, args, kwargs)

    def _check_fields_set(self) -> None:
        # A dataclass built by NEWOBJ + BUILD skips __init__: a field BUILD never set would only
        # surface later as an AttributeError deep inside a load.
        for inst in self._created:
            missing = [f.name for f in dataclasses.fields(inst) if not hasattr(inst, f.name)]
            if missing:
                raise CheckpointCorruptionError(
                    f"{self._source} is not a valid pickle: a {type(inst).__name__} lacks its "
                    f"fields {missing[:4]}"
                )

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if isinstance(inst, type) or cls not in self._allow.classes:
            raise self._refuse(f"opcode BUILD on {inst!r:.80} (only instances of allowed classes)")
        if "__setstate__" in vars(cls):
            inst.__setstate__(state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        fields = {f.name for f in dataclasses.fields(inst)}
        for part in (state, slots):
            if not part:
                continue
            if not isinstance(part, dict) or not set(part) <= fields:
                raise self._refuse(
                    f"opcode BUILD setting {sorted(map(str, part))[:4]} on {cls.__name__} "
                    f"(only its fields {sorted(fields)})"
                    if isinstance(part, dict)
                    else f"opcode BUILD with a {type(part).__name__} state on {cls.__name__}"
                )
            for key, value in part.items():
                object.__setattr__(inst, key, value)

    def _container(self, kinds: tuple[type, ...], opcode: str, depth: int = -1) -> Any:
        target = self.stack[depth]
        if type(target) not in kinds:
            raise self._refuse(f"opcode {opcode} on a {type(target).__name__}")
        return target

    def _load_append(self) -> None:
        value = self.stack.pop()
        self._container((list,), "APPEND").append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._container((list,), "APPENDS").extend(items)

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._container((dict, OrderedDict), "SETITEM")[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._container((dict, OrderedDict), "SETITEMS")
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._container((set,), "ADDITEMS").update(items)

    def _refused_opcode(self, name: str) -> Callable[[Any], None]:
        raise self._refuse(f"opcode {name}")

    for _name, _fn in (
        ("REDUCE", _load_reduce),
        ("NEWOBJ", _load_newobj),
        ("NEWOBJ_EX", _load_newobj_ex),
        ("BUILD", _load_build),
        ("APPEND", _load_append),
        ("APPENDS", _load_appends),
        ("SETITEM", _load_setitem),
        ("SETITEMS", _load_setitems),
        ("ADDITEMS", _load_additems),
    ):
        dispatch[_opcode(_name)] = _fn
    for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID"):
        dispatch[_opcode(_name)] = (lambda n: lambda self: self._refused_opcode(n))(_name)
    del _name, _fn

    def load(self) -> Any:
        """Unpickle the bytes.

        Returns:
            The unpickled object.

        Raises:
            UnsafeCheckpointError: the pickle uses a refused opcode or global (named).
            CheckpointCorruptionError: the bytes are not a valid pickle.
        """
        try:
            result = super().load()
            self._check_fields_set()
            return result
        except UnsafeCheckpointError:
            raise
        except (
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            KeyError,
            IndexError,
            TypeError,
            AttributeError,
            struct.error,
            OverflowError,
            MemoryError,
            RecursionError,
        ) as exc:
            raise CheckpointCorruptionError(
                f"{self._source} is not a valid pickle ({type(exc).__name__}: {exc!s:.120})"
            ) from exc


_TORCH_BOILERPLATE = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
_UNSAFE_WORDS = ("global", "reduce", "build", "can only", "persistent", "allowlist")


def weights_only_reason(exc: BaseException) -> str:
    """The line of a ``weights_only`` refusal that names the opcode or global."""
    for line in (raw.strip() for raw in str(exc).splitlines()):
        if "WeightsUnpickler error:" in line:
            line = line.split("WeightsUnpickler error:", 1)[1].strip()
        if line and not line.startswith(_TORCH_BOILERPLATE):
            return line.split(". Please")[0]
    return type(exc).__name__


def weights_only_error(
    exc: BaseException, what: str, unsafe: str
) -> UnsafeCheckpointError | CheckpointCorruptionError:
    """The hp-dcp error for a ``weights_only`` load failure: unsafe content, or garbage."""
    reason = weights_only_reason(exc)
    if any(word in reason.lower() for word in _UNSAFE_WORDS):
        return UnsafeCheckpointError(f"{what} {unsafe} ({reason}). {_HOW_TO}")
    return CheckpointCorruptionError(f"{what} is not a readable torch.save archive ({reason})")


def load_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP ``.metadata`` bytes with :data:`METADATA_ALLOW_LIST`."""
    return SafeUnpickler(data, source, METADATA_ALLOW_LIST).load()


def load_byte_item(data: bytes, key: str, source: str) -> Any:
    """Load a byte item (a ``torch.save`` archive) with torch's ``weights_only`` unpickler.

    It honours ``torch.serialization.safe_globals``. Never the full unpickler.

    Raises:
        UnsafeCheckpointError: the item references an object off the allow-list.
        CheckpointCorruptionError: the item is not a readable ``torch.save`` archive.
    """
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise weights_only_error(
            exc,
            f"checkpoint item {key!r} in {source}",
            "holds a Python object that PyTorch's weights_only unpickler refuses",
        ) from exc
    except (RuntimeError, EOFError, ValueError, KeyError, OSError) as exc:
        raise CheckpointCorruptionError(
            f"checkpoint item {key!r} in {source} is not a readable torch.save archive "
            f"({type(exc).__name__}: {exc!s:.120})"
        ) from exc
