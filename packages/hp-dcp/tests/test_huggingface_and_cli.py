"""HF safetensors round trips, offline HF <-> DCP conversion and the ``hp-dcp`` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from safetensors.torch import load_file, save_file

import hp_dcp
from hp_dcp.cli import main

# Single-process saves and loads: torch says so with a warning each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _hf_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(11, 6, generator=g),
        "layers.0.attn.weight": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(9, 6, generator=g).half(),
        "layers.1.mlp.weight": torch.randn(9, 6, generator=g),
        "norm.scale": torch.arange(6, dtype=torch.int64),
    }


def test_hf_round_trip_exact_and_sharded(tmp_path: Path) -> None:
    sd = _hf_state(0)
    names = hp_dcp.save_hf_safetensors(sd, tmp_path, max_shard_size=300)
    assert len(names) > 1
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / hp_dcp.HF_INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    got = hp_dcp.load_hf_safetensors(tmp_path)
    assert got.keys() == sd.keys()
    for k, v in sd.items():
        assert got[k].dtype == v.dtype
        assert torch.equal(got[k], v), k
    with pytest.raises(ValueError, match="max_shard_size"):
        hp_dcp.save_hf_safetensors(sd, tmp_path, max_shard_size="lots")
    # key_map renames and drops; two tensors mapped to one name is an error, not an overwrite.
    renamed = hp_dcp.load_hf_safetensors(
        tmp_path, key_map=lambda k: None if k == "norm.scale" else "m." + k
    )
    assert set(renamed) == {"m." + k for k in sd if k != "norm.scale"}
    assert torch.equal(renamed["m.embed.weight"], sd["embed.weight"])
    with pytest.raises(ValueError, match=r"to 'w'"):
        hp_dcp.load_hf_safetensors(tmp_path, key_map=lambda k: "w")


def _two_file_hf(root: Path) -> dict[str, torch.Tensor]:
    """A HF checkpoint as published: two files and an index, written with safetensors itself."""
    sd = _hf_state(1)
    first = {k: v for k, v in sd.items() if k.startswith(("embed", "layers.0"))}
    second = {k: v for k, v in sd.items() if k not in first}
    root.mkdir()
    save_file(first, str(root / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(root / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (root / hp_dcp.HF_INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return sd


def test_two_file_hf_to_dcp_to_hf_offline(tmp_path: Path, capsys: Any) -> None:
    sd = _two_file_hf(tmp_path / "hf")
    assert (
        main(
            [
                "convert",
                "hf-to-dcp",
                str(tmp_path / "hf"),
                str(tmp_path / "dcp"),
                "--add-prefix",
                "model.",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "wrote 5 tensors" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert "__0_0_0.distcp" in files
    assert "__0_1_0.distcp" in files
    hp_dcp.verify_checkpoint(tmp_path / "dcp")
    # torch DCP reads the converted checkpoint into a nested state dict.
    target: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}
    tdcp.load(target, checkpoint_id=tmp_path / "dcp", no_dist=True)
    for k, v in sd.items():
        assert torch.equal(target["model"][k], v), k
    # And back, stripping the prefix, with a tiny shard size.
    assert (
        main(
            [
                "convert",
                "dcp-to-hf",
                str(tmp_path / "dcp"),
                str(tmp_path / "back"),
                "--strip-prefix",
                "model.",
                "--max-shard-size",
                "400",
                "--no-progress",
            ]
        )
        == 0
    )
    back = hp_dcp.load_hf_safetensors(tmp_path / "back")
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def rename_mlp(key: str) -> str | None:
    """Key-mapping hook used through ``--key-map``: rename mlp, drop norm."""
    if key.startswith("norm."):
        return None
    return key.replace(".mlp.", ".ffn.")


def test_key_map_hook_and_progress_bar(tmp_path: Path, capsys: Any) -> None:
    sd = _two_file_hf(tmp_path / "hf")
    n = hp_dcp.hf_to_dcp(tmp_path / "hf", tmp_path / "dcp", key_map=rename_mlp, progress=True)
    assert n == 4
    err = capsys.readouterr().err
    assert "hf -> dcp" in err
    keys = {e.key for e in hp_dcp.describe_checkpoint(tmp_path / "dcp")}
    assert keys == {
        "embed.weight",
        "layers.0.attn.weight",
        "layers.0.ffn.weight",
        "layers.1.ffn.weight",
    }
    assert torch.equal(
        hp_dcp.extract_tensor(tmp_path / "dcp", "layers.1.ffn.weight"), sd["layers.1.mlp.weight"]
    )


def test_inspect_lists_and_extracts(tmp_path: Path, capsys: Any) -> None:
    sd: dict[str, Any] = {"w": torch.arange(12.0).reshape(3, 4), "opt": {"lr": 0.5}}
    hp_dcp.save(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["key", "kind", "dtype", "shape", "chunks", "layout"]
    w_line = next(line for line in lines if line.startswith("w "))
    assert w_line.split()[:5] == ["w", "tensor", "float32", "3x4", "1"]
    assert any(line.startswith("opt.lr") and " bytes " in line for line in lines)
    code = main(
        [
            "inspect",
            str(tmp_path / "c"),
            "--tensor",
            "w",
            "--output",
            str(tmp_path / "w.safetensors"),
        ]
    )
    assert code == 0
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], sd["w"])
    assert main(["verify", str(tmp_path / "c")]) == 0
    victim = tmp_path / "c" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "c")]) == 3
    out = capsys.readouterr().out
    assert out.startswith("corrupt: ")
    assert "first bad file: __0_0.distcp" in out
    assert "checksum mismatch" in out
    with pytest.raises(KeyError, match=r"opt\.lr"):
        hp_dcp.extract_tensor(tmp_path / "c", "opt.lr")


def test_plain_progress_without_tqdm(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _two_file_hf(tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    hp_dcp.hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    err = capsys.readouterr().err.splitlines()
    assert err == ["hf -> dcp: 1/2", "hf -> dcp: 2/2"]
