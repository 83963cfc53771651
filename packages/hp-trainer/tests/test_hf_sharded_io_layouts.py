"""HF import/export in the layouts the trainer builds: TP, HSDP, FSDP x TP, PP x FSDP, PP x TP, EP.

Each layout is built as the trainer builds it (the model spec's parallelize and pipelining
functions on the job's meshes, 4 ranks). Oracles: the full-load path (every tensor read whole,
``set_model_state_dict`` with the full state dict) gives bitwise the same local shards as the
sliced import; a spy on the slice reads shows that each rank read only its own rows (whole heads
where rotary rows are permuted) of only its own tensors (a pipeline stage: its stage's); the
export from each layout writes bitwise the same files as the export from one process (same
index: weight map and sizes; same headers; bitwise the same tensors).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

import hp_dcp
from hp_dtensor._torch_compat import compute_local_shape_and_global_offset
from hp_dtensor.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from hp_dtensor.testing import distributed
from hp_trainer import ConfigManager
from hp_trainer.components.hf_io.sharded_io import HFShardedReader, HFShardedWriter
from hp_trainer.distributed.parallel_dims import parallel_dims_from_config
from hp_trainer.protocols.model_spec import get_model_spec

_SHARD_BYTES = 60_000  # files of two or three tensors; some span both pipeline stages

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2 x dp_replicate2": {
        "tensor_parallel_degree": 2,
        "data_parallel_replicate_degree": 2,
        "data_parallel_shard_degree": 1,
    },
    "hsdp 2x2": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2},
    "fsdp2 x tp2": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    "pp2 x fsdp2": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2},
    "pp2 x tp2": {
        "pipeline_parallel_degree": 2,
        "tensor_parallel_degree": 2,
        "data_parallel_shard_degree": 1,
    },
    # Qwen 3 MoE: experts split over 2 EP ranks (stacked HF experts read per expert)
    "qwen3_moe ep2 x fsdp4": {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2},
}


def _model_name(layout: str) -> str:
    return layout.split(" ")[0] if layout.startswith("qwen3_moe") else "llama3"


def _args(model: str = "llama3") -> Any:
    args = copy.deepcopy(get_model_spec(model).model_args("tiny"))
    args.vocab_size = 96
    args.max_seq_len = 32
    return args


def _adapter(model: str) -> Any:
    return get_model_spec(model).state_dict_adapter(_args(model))  # type: ignore[misc]


def _source(args: Any, seed: int, model_name: str = "llama3") -> nn.Module:
    torch.manual_seed(seed)
    model = get_model_spec(model_name).model_cls(args)
    model.init_weights()  # type: ignore[operator]
    with torch.no_grad():  # non-trivial norm scales
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _parts(model_name: str, par: dict[str, int], seed: int) -> list[nn.Module]:
    """This rank's model parts of ``par``, built as the trainer builds them."""
    cfg = ConfigManager().from_dict(
        {
            "model": {"name": model_name, "flavor": "tiny"},
            "training": {
                "local_batch_size": 2,
                "seq_len": 32,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": par,
        }
    )
    dims = parallel_dims_from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    spec = get_model_spec(model_name)
    model = _source(_args(model_name), seed, model_name)
    if dims.pp_enabled:
        assert spec.pipelining_fn is not None
        pipelined = spec.pipelining_fn(
            model, dims, cfg, torch.device("cpu"), spec.parallelize_fn, lambda out, y: out.sum()
        )
        return list(pipelined.model_parts)
    return [spec.parallelize_fn(model, dims, cfg)]


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _local_offset(value: Any) -> int:
    """Where this rank's shard starts along dim 0 of the global tensor."""
    if not isinstance(value, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return int(offset[0])


def _assert_same_files(out: Path, oracle: Path, name: str) -> None:
    """Same index (weight map, total size, file sizes), headers and tensors, bitwise.

    The checksums differ: safetensors writes the header's metadata in hash order, which
    varies between processes.
    """
    index, expected = (json.loads((p / hp_dcp.HF_INDEX_FILE).read_text()) for p in (out, oracle))
    assert index["weight_map"] == expected["weight_map"], name
    assert index["metadata"]["total_size"] == expected["metadata"]["total_size"], name
    sizes, expected_sizes = (
        {f: e["size"] for f, e in i["metadata"]["hp_dcp_checksums"]["files"].items()}
        for i in (index, expected)
    )
    assert sizes == expected_sizes, name
    for file in sorted(sizes):
        with safe_open(str(out / file), "pt") as f, safe_open(str(oracle / file), "pt") as g:
            assert f.metadata() == g.metadata(), (name, file)
            assert list(f.keys()) == list(g.keys()), (name, file)
            for key in list(f.keys()):
                assert torch.equal(f.get_tensor(key), g.get_tensor(key)), (name, file, key)


def _check_layout(folder: str, name: str) -> None:
    model_name = _model_name(name)
    hf_in = f"{folder}/{model_name}-in"
    adapter = _adapter(model_name)
    source = _source(_args(model_name), 0, model_name).state_dict()
    par = LAYOUTS[name]

    # import: this rank's slices only, bitwise the full-load path (run first, into the same parts)
    parts = _parts(model_name, par, 1)
    full_sd = adapter.from_hf(hp_dcp.load_hf_safetensors(hf_in))
    opts = StateDictOptions(full_state_dict=True, strict=False)
    full_load = []
    for part in parts:
        set_model_state_dict(part, full_sd, options=opts)
        full_load.append({k: _local(v).clone() for k, v in get_model_state_dict(part).items()})
        with torch.no_grad():
            for p in part.parameters():
                _local(p).fill_(-1.0)
    reader = HFShardedReader(adapter)
    reader.load(parts, hf_in)
    reads = dict(reader.reads)
    assert len(reads) == len(reader.reads)  # every tensor read once
    own: set[str] = set()
    for part, theirs in zip(parts, full_load, strict=True):
        ours = get_model_state_dict(part)
        assert list(ours) == list(theirs)
        for key, value in ours.items():
            local = _local(value)
            assert torch.equal(local, theirs[key]), (name, key)
            full = value.full_tensor() if isinstance(value, DTensor) else value
            assert torch.equal(full, source[key]), (name, key)
            stacked = getattr(adapter, "hf_stacked_sources", lambda _: None)(key)
            if stacked is not None:  # this rank's experts, each read in this rank's box
                start = _local_offset(value)
                mine = stacked[start : start + local.shape[0]]
                own.update(mine)
                assert all(reads[n] == tuple(local.shape[1:]) for n in mine), (name, key)
                continue
            hf_name, heads = adapter.hf_source(key)
            own.add(hf_name)
            if heads is None:
                assert reads[hf_name] == tuple(local.shape), (name, key, reads[hf_name])
            else:  # whole heads around this rank's rows
                head_dim = value.shape[0] // heads
                assert reads[hf_name][0] % head_dim == 0, (name, key)
                assert local.shape[0] <= reads[hf_name][0] <= local.shape[0] + 2 * head_dim
    assert set(reads) == own  # a pipeline stage reads its stage's tensors only
    if "pp2" in name or "ep2" in name:  # a stage or expert-parallel rank: not every tensor
        assert len(own) < len(adapter.to_hf(source))

    # export: bitwise the files one process writes
    with torch.no_grad():
        for part in parts:
            for p in part.parameters():
                _local(p).add_(0.01)  # the same change in every layout and in the oracle
    out = Path(folder) / name.replace(" ", "")
    writer = HFShardedWriter(adapter, max_shard_size=_SHARD_BYTES)
    writer.save(parts, out)
    dist.barrier()
    _assert_same_files(out, Path(folder) / f"{model_name}-one-process", name)
    assert writer.plan is not None
    if "pp" in name:  # a file spans both stages: its writer received the other stage's tensors
        mine = sorted(k for part in parts for k in get_model_state_dict(part))
        stages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)
        spans = [f for f in writer.plan.files if not any(set(f.keys) <= set(s) for s in stages)]
        assert spans, [f.keys for f in writer.plan.files]


@distributed(world_size=4)
def test_sharded_hf_io_in_every_layout(folder: str) -> None:
    solo = dist.new_group([0])
    for model_name in ("llama3", "qwen3_moe"):
        args, adapter = _args(model_name), _adapter(model_name)
        oracle_out = Path(folder) / f"{model_name}-one-process"
        if dist.get_rank() == 0:  # a "downloaded" checkpoint, and the export of one process
            hp_dcp.save_hf_safetensors(
                adapter.to_hf(_source(args, 0, model_name).state_dict()),
                f"{folder}/{model_name}-in",
                max_shard_size=_SHARD_BYTES,
            )
            trained = _source(args, 0, model_name)
            with torch.no_grad():
                for p in trained.parameters():
                    p.add_(0.01)
            writer = HFShardedWriter(adapter, solo, max_shard_size=_SHARD_BYTES)
            writer.save([trained], oracle_out)
        dist.barrier()
        oracle_index = json.loads((oracle_out / hp_dcp.HF_INDEX_FILE).read_text())
        assert len(oracle_index["metadata"]["hp_dcp_checksums"]["files"]) > 3
    for name in LAYOUTS:
        _check_layout(folder, name)


@pytest.fixture
def folder(tmp_path: Path) -> str:
    return str(tmp_path)
