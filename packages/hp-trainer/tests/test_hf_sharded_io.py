"""HF import/export without a whole model on one rank (FSDP-sharded tiny decoders, 3 ranks).

Oracles: the full-load path (every tensor read whole, ``from_hf``, ``set_model_state_dict``
with a full state dict) gives bitwise the same shards as the sliced import; a spy on the slice
reads shows what each rank read; a spy on ``DTensor.full_tensor`` counts the gathered tensors
alive at once during export; the export loads back through hp-dcp's verified reader and in
``transformers`` (if installed) with the same logits.
"""

from __future__ import annotations

import copy
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import hp_dcp
import hp_fsdp
from hp_dtensor.state_dict import StateDictOptions, set_model_state_dict
from hp_dtensor.testing import distributed
from hp_trainer.checkpoint import CheckpointManager
from hp_trainer.hf_adapters import Llama3StateDictAdapter, Qwen3StateDictAdapter
from hp_trainer.hf_sharded_io import HFShardedReader, HFShardedWriter
from hp_trainer.models.decoder import Decoder, DecoderArgs
from hp_trainer.models.llama3 import llama3_flavors
from hp_trainer.models.qwen3 import qwen3_flavors

CASES = {
    "llama3": (llama3_flavors, Llama3StateDictAdapter),
    "qwen3": (qwen3_flavors, Qwen3StateDictAdapter),
}


def _args(name: str) -> DecoderArgs:
    args = copy.deepcopy(CASES[name][0]["tiny"])
    args.vocab_size = 96
    args.max_seq_len = 32
    args.enable_weight_tying = name == "qwen3"
    return args


def _build(args: DecoderArgs, seed: int, shard: bool) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(args)
    model.init_weights()
    with torch.no_grad():  # non-trivial norm scales, so their permutation matters
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    if shard:
        for block in model.layers.values():
            hp_fsdp.fully_shard(block)
        hp_fsdp.fully_shard(model)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


class _Cfg:
    enable = True
    folder = "checkpoint"


class _FullTensorSpy:
    """Counts the gathered full tensors alive at once (freed ones are finalized)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.calls = 0
        self.original = DTensor.full_tensor

    def __enter__(self) -> _FullTensorSpy:
        spy = self

        def full_tensor(self: DTensor, **kwargs: Any) -> torch.Tensor:
            out = spy.original(self, **kwargs)
            spy.calls += 1
            spy.live += 1
            spy.peak = max(spy.peak, spy.live)
            weakref.finalize(out, spy._freed)
            return out

        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
        return self

    def _freed(self) -> None:
        self.live -= 1

    def __exit__(self, *exc: object) -> None:
        DTensor.full_tensor = self.original  # type: ignore[method-assign]


def _check_case(folder: str, name: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    args = _args(name)
    adapter = CASES[name][1](args)
    source = _build(args, 0, shard=False)  # a "downloaded" HF checkpoint, written by rank 0
    hf_in = f"{folder}/{name}-in"
    if rank == 0:
        hp_dcp.save_hf_safetensors(adapter.to_hf(source.state_dict()), hf_in)
    dist.barrier()

    # import: sliced reads vs the full-load path, bitwise
    model = _build(args, 1, shard=True)
    reader = HFShardedReader(adapter)
    reader.load([model], hf_in)
    oracle = _build(args, 2, shard=True)
    full_sd = adapter.from_hf(hp_dcp.load_hf_safetensors(hf_in))
    set_model_state_dict(oracle, full_sd, options=StateDictOptions(full_state_dict=True))
    for (key, ours), theirs in zip(
        model.state_dict().items(), oracle.state_dict().values(), strict=True
    ):
        assert torch.equal(ours.to_local(), theirs.to_local()), key
        assert torch.equal(ours.full_tensor(), source.state_dict()[key]), key

    # what this rank read: its own rows (whole heads for rotary-permuted rows), never more
    file_bytes = sum(t.nbytes for t in adapter.to_hf(source.state_dict()).values())
    reads = dict(reader.reads)
    for key, value in model.state_dict().items():
        hf_name, heads = adapter.hf_source(key)
        local = tuple(value.to_local().shape)
        if heads is None:
            assert reads[hf_name] == local, key
        else:
            head_dim = value.shape[0] // heads
            assert reads[hf_name][0] % head_dim == 0, key
            assert reads[hf_name][0] >= local[0], key
            assert reads[hf_name][0] <= local[0] + 2 * head_dim, key
    assert 0 < reader.bytes_read < file_bytes / ws * 1.6
    totals = [0] * ws
    dist.all_gather_object(totals, reader.bytes_read)
    assert sum(totals) >= file_bytes - (args.vocab_size * args.dim * 4 if name == "qwen3" else 0)

    # export: round-robin owners, one gathered tensor alive at a time, nothing gathered twice
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.01 * (rank + 1))  # a trained model differs from the source
    trained = _full(model)
    hf_out = f"{folder}/{name}-out"
    writer = HFShardedWriter(adapter)
    with _FullTensorSpy() as spy:
        writer.save([model], hf_out)
    assert spy.peak == 1
    assert spy.calls == len(model.state_dict())
    assert writer.peak_full_tensors == 1
    written: list[list[str]] = [[] for _ in range(ws)]
    dist.all_gather_object(written, writer.written)
    assert all(written), written  # every rank wrote a share
    names = [n for w in written for n in w]
    assert sorted(names) == sorted(adapter.to_hf(trained))
    dist.barrier()

    # the export loads back: verified full reader, sliced reader, and as CheckpointManager does
    back = adapter.from_hf(hp_dcp.load_hf_safetensors(hf_out))
    for key, value in trained.items():
        assert torch.equal(back[key], value), key
    again = _build(args, 3, shard=True)
    CheckpointManager(None, [again], None, None, {}, _Cfg(), adapter, base_folder=folder).load_hf(
        hf_out
    )
    for key, value in _full(again).items():
        assert torch.equal(value, trained[key]), key

    # a corrupted file is found by the one rank that checksums it, and refused on every rank
    bad = Path(f"{folder}/{name}-bad")
    if rank == 0:
        shutil.copytree(hf_out, bad)
        victim = bad / sorted(bad.glob("*.safetensors"))[-1].name
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    with pytest.raises(hp_dcp.CheckpointCorruptionError, match="checksum mismatch"):
        HFShardedReader(adapter).load([again], bad)


@distributed(world_size=3)
def test_sharded_hf_import_reads_own_slices_and_export_gathers_one_tensor(folder: str) -> None:
    for name in CASES:
        _check_case(folder, name)


def test_sharded_export_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    args = _args("llama3")
    model = _build(args, 4, shard=False)
    manager = CheckpointManager(
        None, [model], None, None, {}, _Cfg(), Llama3StateDictAdapter(args), base_folder=tmp_path
    )
    manager.export_hf(tmp_path / "out")
    index = json.loads((tmp_path / "out" / hp_dcp.HF_INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == len(index["weight_map"])  # file per tensor
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_sharded_import_refuses_a_checkpoint_of_another_shape(tmp_path: Path) -> None:
    args = _args("llama3")
    adapter = Llama3StateDictAdapter(args)
    HFShardedWriter(adapter).save([_build(args, 5, shard=False)], tmp_path / "hf")
    wider = _args("llama3")
    wider.vocab_size = 128
    shapes = r"lm_head\.weight has shape \[96, 64\], the model's lm_head\.weight has \[128, 64\]"
    with pytest.raises(ValueError, match=shapes):
        HFShardedReader(Llama3StateDictAdapter(wider)).load([Decoder(wider)], tmp_path / "hf")


@pytest.fixture
def folder(tmp_path: Path) -> str:
    return str(tmp_path)
