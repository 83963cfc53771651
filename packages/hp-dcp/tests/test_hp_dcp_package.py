"""Package-level checks for hp-dcp."""

import importlib.metadata

import hp_dcp
import hp_dcp.cli


def test_version_matches_metadata() -> None:
    assert hp_dcp.__version__ == importlib.metadata.version("hp-dcp")


def test_all_names_resolve() -> None:
    for name in hp_dcp.__all__:
        assert hasattr(hp_dcp, name), name


def test_console_script_declared() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (entry,) = [e for e in scripts if e.name == "hp-dcp"]
    assert entry.value == "hp_dcp.cli:main"
    assert entry.load() is hp_dcp.cli.main


def test_state_dict_helpers_are_hp_dtensors() -> None:
    import hp_dtensor.state_dict as sd

    for name in sd.__all__:
        assert getattr(hp_dcp, name) is getattr(sd, name), name


def test_drop_in_signatures_match_torch() -> None:
    import inspect

    import torch.distributed.checkpoint as tdcp

    pairs = [
        (hp_dcp.save, tdcp.save),
        (hp_dcp.async_save, tdcp.async_save),
        (hp_dcp.load, tdcp.load),
        (hp_dcp.FileSystemWriter, tdcp.FileSystemWriter),
        (hp_dcp.FileSystemReader, tdcp.FileSystemReader),
    ]
    for ours, theirs in pairs:
        mine = inspect.signature(ours).parameters
        ref = inspect.signature(theirs).parameters
        for name, p in ref.items():
            assert name in mine, f"{ours.__name__} lacks {name}"
            assert mine[name].kind == p.kind, f"{ours.__name__}.{name}"
            assert mine[name].default == p.default, f"{ours.__name__}.{name}"
        extra = [n for n in mine if n not in ref]
        assert all(mine[n].kind == inspect.Parameter.KEYWORD_ONLY for n in extra), extra


def test_checksum_backend_matches_zlib() -> None:
    import os
    import zlib

    from hp_dcp._checksum import crc32

    data = os.urandom(1 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(memoryview(data)[5:77]) == zlib.crc32(data[5:77])
