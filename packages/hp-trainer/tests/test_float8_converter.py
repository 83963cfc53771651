"""The ``float8`` and ``mx`` model converters (torchao) in the trainer.

- ``float8`` swaps every linear layer except the filtered head for torchao's ``Float8Linear``;
  a layer whose dimensions are not divisible by 16 is refused, naming it, unless the filter
  skips it (the skipped layers are logged once).
- Under FSDP 2 with ``enable_fsdp_float8_all_gather`` and precomputed scales, the sharded
  weights are torchao's float8 all-gather wrapper, the post-optimizer hook leaves every
  weight's scale equal to ``finfo.max / amax`` of the whole trained weight, and the losses stay
  within float8's error of the same job in float32 (and differ from it: float8 is in use).
  Bitwise parity of float8 training with torch's FSDP2 / TP is tested in hp-fsdp and hp-tp.
- ``mx`` refuses torchao's MXFP8-kernel recipe on CPU, naming the requirement; the emulated
  recipe converts the linear layers and trains.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer, build_model_converters
from hp_trainer.distributed.parallel_dims import ParallelDims

float8 = pytest.importorskip("torchao.float8", reason="torchao (hp-trainer[float8]) not installed")

_h = load_test_module(
    Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
)


def _dims(world_size: int = 1, **kw: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=1, dp_shard=kw.get("dp_shard", -1), cp=1, tp=1, pp=1, ep=1,
        world_size=world_size,
    )  # fmt: skip


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 48)
        self.proj = nn.Linear(48, 20)  # 20 is not divisible by 16
        self.lm_head = nn.Linear(20, 32)


def test_float8_converts_all_but_the_head_and_refuses_odd_layers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from torchao.float8.float8_linear import Float8Linear

    cfg = _h.job(tmp_path, {}, run="f8unit")
    cfg.model.converters = ["float8"]
    dims = _dims()
    converters = build_model_converters(cfg, dims)
    (converter,) = converters.converters
    model = _Odd()
    with pytest.raises(ValueError, match=r"'proj' has in_features=48, out_features=20.*16"):
        converters.convert(model)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # refused before
    cfg.float8.filter_fqns = ["lm_head", "proj"]
    converters = build_model_converters(cfg, dims)
    with caplog.at_level(logging.INFO):
        converters.convert(model)
    assert isinstance(model.body, Float8Linear)
    assert type(model.proj) is nn.Linear
    assert type(model.lm_head) is nn.Linear
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float8:")]
    assert said == [
        "float8: 1 linear layers converted (tensorwise), 2 kept in high precision by "
        "float8.filter_fqns: proj, lm_head"
    ]
    assert converter is not None
    cfg.float8.filter_fqns = ["lm_head", "proj", "body"]
    with pytest.raises(ValueError, match="no linear layer left to convert"):
        build_model_converters(cfg, dims).convert(_Odd())


def test_float8_all_gather_refuses_rows_not_dividing_over_the_shards(tmp_path: Path) -> None:
    # torchao's wrapper gathers its unpadded shard: with 48 rows over 3 x 2 = 6 ranks fine,
    # over 5 FSDP ranks the short rank alone would fail at the first all-gather (others hang)
    cfg = _h.job(tmp_path, {}, run="f8rows")
    cfg.model.converters = ["float8"]
    cfg.float8.enable_fsdp_float8_all_gather = True
    cfg.float8.filter_fqns = ["lm_head", "proj"]
    dims = ParallelDims(dp_replicate=1, dp_shard=5, cp=1, tp=1, pp=1, ep=1, world_size=5)
    with pytest.raises(ValueError, match=r"'body' has out_features=48, not divisible by .* \(5\)"):
        build_model_converters(cfg, dims).convert(_Odd())
    dims = ParallelDims(dp_replicate=1, dp_shard=3, cp=1, tp=2, pp=1, ep=1, world_size=6)
    build_model_converters(cfg, dims).convert(_Odd())  # 48 rows over 3 x 2 ranks
    cfg.float8.enable_fsdp_float8_all_gather = False  # no float8 all-gather: no constraint
    dims = ParallelDims(dp_replicate=1, dp_shard=5, cp=1, tp=1, pp=1, ep=1, world_size=5)
    build_model_converters(cfg, dims).convert(_Odd())


def test_float8_config_refusals(tmp_path: Path) -> None:
    from hp_trainer.config import Float8Config

    with pytest.raises(ValueError, match=r"float8.enable_fsdp_float8_all_gather.*tensorwise"):
        Float8Config(recipe_name="rowwise", enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="precompute_float8_dynamic_scale_for_fsdp"):
        Float8Config(precompute_float8_dynamic_scale_for_fsdp=True)
    with pytest.raises(ValueError, match=r"float8\.recipe_name = 'blockwise'"):
        Float8Config(recipe_name="blockwise")  # type: ignore[arg-type]


def test_mx_kernel_recipe_refused_on_cpu_and_emulated_recipe_trains(tmp_path: Path) -> None:
    cfg = _h.job(tmp_path, {}, run="mx", steps=2)
    cfg.model.converters = ["mx"]
    with pytest.raises(ValueError, match=r"compute capability >= 10.0.*'cpu'.*emulated"):
        build_model_converters(cfg, _dims())
    cfg.mx.recipe_name = "mxfp8_emulated_rceil"
    trainer = Trainer(cfg)
    (converter,) = trainer.model_converters.converters
    assert len(converter.converted) == 2 * 7
    assert converter.skipped == ["lm_head"]
    wq = trainer.model.layers["0"].attention.wq.weight  # type: ignore[index,union-attr]
    assert type(wq).__name__ == "MXFP8TrainingWeightWrapperTensor"
    losses = trainer.train()
    trainer.close()
    assert len(losses) == 2
    assert all(torch.isfinite(torch.tensor(losses)))


def _float8_fsdp(folder: str) -> tuple[list[float], list[float], int]:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    path = Path(folder)
    ws = dist.get_world_size()
    runs = []
    for converters in ([], ["float8"]):
        cfg = _h.job(path, {"data_parallel_shard_degree": ws}, run=f"f8{len(converters)}")
        cfg.model.converters = converters
        cfg.float8.enable_fsdp_float8_all_gather = True
        cfg.float8.precompute_float8_dynamic_scale_for_fsdp = True
        trainer = Trainer(cfg)
        runs.append(trainer.train())
        if converters:
            weights = [
                m.weight for m in trainer.model.modules() if type(m).__name__ == "Float8Linear"
            ]
            assert len(weights) == 2 * 7  # wq wk wv wo w1 w2 w3 of both blocks, not lm_head
            fmax = torch.finfo(torch.float8_e4m3fn).max
            for w in weights:
                local = w._local_tensor
                assert isinstance(local, WeightWithDynamicFloat8CastTensor)
                amax = w.full_tensor().abs().max().clamp(min=1e-12).double()
                assert torch.equal(local._precomputed_scale, (fmax / amax).float())
        trainer.close()
    return runs[0], runs[1], len(runs)


def test_float8_fsdp2_trains_close_to_float32(tmp_path: Path) -> None:
    results = run_distributed(_float8_fsdp, 2, str(tmp_path), timeout=300)
    for fp32, fp8, _ in results:
        assert fp32 != fp8  # float8 matmuls are in use
        torch.testing.assert_close(torch.tensor(fp8), torch.tensor(fp32), rtol=3e-2, atol=0)
    assert results[0][:2] == results[1][:2]  # the loss is averaged over the ranks
