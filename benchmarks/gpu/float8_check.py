"""Float8 and MXFP8 training on a GPU: throughput against bf16, numerics, FSDP parity over NCCL.

One script for a machine with at least one GPU (a few minutes, most of it ``torch.compile``):

1. ``float8`` throughput: a stack of SwiGLU feed-forward blocks (Llama-3-8B-like widths, bf16)
   trained with plain linears and with torchao's ``Float8Linear`` (tensorwise and rowwise),
   each compiled (``--no-compile``: eager); steps alternate between the variants after a
   warm-up, the median per variant is reported with ``variant / bf16`` ratios (below 1:
   float8 is faster; TorchTitan reports 0.86 (1.16x) for tensorwise on 8B Llama 3).
2. numerics: the first-step loss of each float8 variant within 5e-2 (relative) of bf16's.
3. MXFP8 (``mx``): where torchao's MXFP8 kernels can run (compute capability >= 10.0 with
   Triton) the ``mxfp8_rceil`` recipe joins the throughput table; elsewhere the script checks
   that :class:`hp_trainer.MXConverter` refuses it naming the requirement, and runs the
   emulated recipe once (numerics only).
4. with two or more GPUs: ``hp_fsdp.fully_shard`` against torch's ``fully_shard`` over NCCL on
   the same torchao model with ``enable_fsdp_float8_all_gather`` and precomputed scales, three
   AdamW steps, losses and parameters bitwise equal (the CPU tests check this on gloo).

Without a GPU it prints a line saying so and exits with status 0. ``--cpu`` runs every part on
CPU at a small size (gloo for part 4): a smoke test of the script itself.

Usage::

    python benchmarks/gpu/float8_check.py [--steps 20] [--no-compile] [--out float8_check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hp_dtensor.device import (
    device_count,
    get_default_backend,
    get_device_type,
    is_accelerator,
    synchronize,
)


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Net(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(dim, hidden) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _convert(model: nn.Module, variant: str) -> None:
    if variant in ("tensorwise", "rowwise"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(variant))
    elif variant.startswith("mxfp8"):
        from torchao.prototype.moe_training.config import (
            MXFP8TrainingOpConfig,
            MXFP8TrainingRecipe,
        )
        from torchao.quantization import quantize_

        config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(variant))
        quantize_(model, config, filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))


def throughput(
    variants: list[str], size: tuple[int, int, int, int], steps: int, compile_: bool
) -> dict[str, Any]:
    """Median step time and first loss per variant, on this process's device."""
    dim, hidden, blocks, tokens = size
    device = torch.device(get_device_type())
    x = torch.randn(tokens // 1024 or 1, min(tokens, 1024), dim, device=device)
    x = x.to(torch.bfloat16)
    built = {}
    for v in variants:
        torch.manual_seed(0)
        model = _Net(dim, hidden, blocks).to(device=device, dtype=torch.bfloat16)
        _convert(model, v)
        fn = torch.compile(model) if compile_ else model
        built[v] = (fn, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False))
    times: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, float] = {}
    for i in range(steps + 3):
        for v in variants:
            fn, opt = built[v]
            synchronize(device)
            start = time.perf_counter()
            loss = fn(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            synchronize(device)
            if i == 0:
                first[v] = loss.item()
            if i >= 3:
                times[v].append(time.perf_counter() - start)
    medians = {v: statistics.median(times[v]) for v in variants}
    return {
        "median_s": medians,
        "ratio_vs_bf16": {v: medians[v] / medians["bf16"] for v in variants},
        "first_loss": first,
    }


def _fsdp_worker(rank: int, world: int, init: str, cpu: bool, out: str) -> None:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    import hp_fsdp
    from hp_dtensor.device import set_device

    device_type = "cpu" if cpu else get_device_type()
    size = (64, 192, 1) if cpu else (256, 768, 2)
    if device_type != "cpu":
        set_device(rank)
    backend = get_default_backend(device_type)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh(device_type, (world,))
    models = []
    for shard in (hp_fsdp.fully_shard, torch_fsdp.fully_shard):
        torch.manual_seed(0)
        model = _Net(*size)
        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        )
        model.to(device_type)
        for layer in model.layers:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        if cpu and shard is torch_fsdp.fully_shard:  # gloo has no float8: send bytes
            from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

            class _Bytes(AllGather):
                def allocate(self, size: Any, *, dtype: Any, device: Any) -> torch.Tensor:
                    return torch.empty(*size, dtype=dtype, device=device)

                def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                             async_op: bool = False) -> Any:  # fmt: skip
                    return dist.all_gather_into_tensor(
                        output_tensor.view(torch.uint8), input_tensor.view(torch.uint8),
                        group=group, async_op=async_op,
                    )  # fmt: skip

            for unit in (*model.layers, model):
                unit.set_custom_all_gather(_Bytes())
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    gen = torch.Generator().manual_seed(rank)
    equal_losses = True
    for _ in range(3):
        x = torch.randn(2, 32, size[0], generator=gen).to(device_type)
        losses = []
        for model, opt in models:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append(loss.detach())
        equal_losses &= bool(torch.equal(losses[0], losses[1]))
    equal_params = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(models[0][0].parameters(), models[1][0].parameters(), strict=True)
    )
    if rank == 0:
        Path(out).write_text(
            json.dumps({"losses_equal": equal_losses, "params_equal": equal_params})
        )
    dist.destroy_process_group()


def fsdp_parity(world: int, cpu: bool) -> dict[str, Any]:
    """hp-fsdp vs torch FSDP2, float8 all-gather, 3 steps: bitwise equal losses and parameters."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        mp.spawn(_fsdp_worker, args=(world, str(Path(tmp) / "init"), cpu, out), nprocs=world)
        return dict(json.loads(Path(out).read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="smoke test on CPU at a small size")
    parser.add_argument("--out", type=Path, default=Path("float8_check.json"))
    args = parser.parse_args()
    if not args.cpu and not is_accelerator(get_device_type()):
        print("float8_check: no GPU here; nothing checked (use --cpu for a smoke test)")
        return 0
    from hp_trainer.components.converters.mx import mxfp8_kernels_available

    size = (64, 192, 1, 64) if args.cpu else (4096, 14336, 4, 8192)
    report: dict[str, Any] = {"device": "cpu" if args.cpu else get_device_type(), "size": size}
    variants = ["bf16", "tensorwise", "rowwise"]
    mx_ok, mx_reason = mxfp8_kernels_available()
    report["mxfp8_kernels"] = {"available": mx_ok, "reason": mx_reason}
    if mx_ok and not args.cpu:
        variants.append("mxfp8_rceil")
    steps = 1 if args.cpu else args.steps
    result = throughput(variants, size, steps, compile_=not (args.cpu or args.no_compile))
    report["throughput"] = result
    failures = []
    for v in variants[1:]:
        rel = abs(result["first_loss"][v] - result["first_loss"]["bf16"]) / abs(
            result["first_loss"]["bf16"]
        )
        if rel > 5e-2:
            failures.append(f"{v}: first loss off bf16 by {rel:.3g}")
    if not mx_ok:  # the converter must refuse the kernel recipe, naming the requirement
        from hp_trainer import JobConfig
        from hp_trainer.components.converters.mx import MXConverter

        try:
            MXConverter(JobConfig(), None)  # type: ignore[arg-type]
            failures.append("MXConverter accepted mxfp8_rceil without MXFP8 kernels")
        except ValueError as error:
            report["mx_refusal"] = str(error)
        emulated = throughput(["bf16", "mxfp8_emulated_rceil"], (64, 192, 1, 64), 1, False)
        report["mxfp8_emulated_first_loss"] = emulated["first_loss"]
    world = 2 if args.cpu else device_count()
    if world >= 2:
        parity = fsdp_parity(min(world, 8), args.cpu)
        report["fsdp_float8_parity"] = parity
        if not (parity["losses_equal"] and parity["params_equal"]):
            failures.append(f"hp-fsdp vs torch FSDP2 float8 all-gather: {parity}")
    report["failures"] = failures
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
