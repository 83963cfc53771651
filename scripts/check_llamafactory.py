"""Check hp-fsdp under LlamaFactory: a tiny SFT (full and LoRA) with hp-fsdp and with torch's FSDP2.

LlamaFactory 0.9.5 pins transformers <= 5.6, accelerate <= 1.11, peft 0.18, trl <= 0.24,
torchvision and torchaudio, which conflict with the dev environment, so this script builds its
own venv:

1. ``python -m venv VENV``; ``pip install llamafactory==0.9.5`` with ``torch==2.13.0`` as a
   constraint (the CPU wheel of the dev environment satisfies it);
2. wheels of hp-dtensor, hp-kernels and hp-fsdp built from this checkout, installed without
   touching the pins;
   torchvision and torchaudio are then uninstalled when they do not load (no CPU build for torch
   2.13 on the index; the runner puts an empty ``torchaudio`` module in place, which LlamaFactory
   imports but its text SFT never calls);
3. a tiny random ``LlamaForCausalLM`` (hidden 32, 2 layers) with a word-level tokenizer and a
   64-row alpaca dataset, written locally (nothing is downloaded);
4. ``torchrun --nproc-per-node 2`` of LlamaFactory's ``run_exp`` with ``fsdp="full_shard
   auto_wrap"`` and ``fsdp_config={"fsdp_version": 2, ...}``, for ``finetuning_type`` full and
   lora, once with torch's FSDP2 and once with ``hp_fsdp.integrations.use_hp_fsdp`` installed;
5. compares each step's loss (bitwise) and prints a table; exit status 1 on a difference.

On a CPU machine Accelerate keeps ``MULTI_CPU`` and ignores the FSDP plugin; the runner sets
the Trainer's Accelerate state to FSDP after it is built (as Accelerate does on a GPU), in the
runner process only. Usage::

    python scripts/check_llamafactory.py [--venv /tmp/hp-llamafactory] [--steps 5]

It takes minutes (the install dominates) and is not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hp-dtensor", "hp-kernels", "hp-fsdp")
LLAMAFACTORY = "llamafactory==0.9.5"
TORCH = "torch==2.13.0"

RUNNER = textwrap.dedent(
    '''
    """Run LlamaFactory's run_exp on this rank; record each step's exact loss."""
    import json, os, sys

    backend, out = sys.argv[1], sys.argv[2]
    sys.argv = [sys.argv[0], sys.argv[3]]

    try:
        import torchaudio  # noqa: F401
    except (ImportError, OSError):  # no loadable CPU build for torch 2.13 (see the script)
        import importlib.machinery
        import types

        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stub

    import transformers
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    losses = []
    create = transformers.Trainer.create_accelerator_and_postprocess
    step = transformers.Trainer.training_step

    def create_on_cpu(self):
        create(self)
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state = self.accelerator.state
            if state.mixed_precision != "no":
                plugin.set_mixed_precision(state.mixed_precision)
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    def recording_step(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        losses.append(loss.item())
        return loss

    transformers.Trainer.create_accelerator_and_postprocess = create_on_cpu
    transformers.Trainer.training_step = recording_step

    if backend == "hp":
        from hp_fsdp.integrations import use_hp_fsdp

        print("hp_fsdp switch:", use_hp_fsdp().names, flush=True)
    from llamafactory.train.tuner import run_exp

    run_exp()
    import hp_fsdp
    import torch.distributed.fsdp as f

    info = {"losses": losses, "fully_shard": f.fully_shard.__module__}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as fh:
            json.dump(info, fh)
    '''
)


def _run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def make_venv(venv: Path) -> Path:
    """Create ``venv`` with LlamaFactory and this checkout's hp-fsdp; return its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "-c", str(constraints), LLAMAFACTORY])
    for name in ("torchvision", "torchaudio"):
        # The index has no CPU build of either that loads against torch 2.13.0+cpu (torchvision
        # 0.28.0 is a CUDA build: "operator torchvision::nms does not exist"; pip resolves
        # torchaudio 2.11.1, whose _torchaudio.so does not load). LlamaFactory's text SFT needs
        # neither; the runner puts an empty torchaudio module in place (mm_plugin imports it).
        probe = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True)
        if probe.returncode != 0:
            print(f"{name} does not load against torch 2.13.0+cpu here: uninstalled", flush=True)
            _run([str(python), "-m", "pip", "uninstall", "-y", "-q", name])
    wheels = venv / "hp-wheels"
    wheels.mkdir(exist_ok=True)
    for pkg in PACKAGES:
        _run(
            [
                str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                str(ROOT / "packages" / pkg),
            ]
        )  # fmt: skip
    built = sorted(str(p) for p in wheels.glob("hp_*.whl"))
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--force-reinstall",
            "--no-deps",
            *built,
            "-c",
            str(constraints),
        ]
    )
    return python


def make_assets(python: Path, work: Path) -> None:
    """Write the tiny model, tokenizer and dataset under ``work`` (with the venv's transformers)."""
    code = textwrap.dedent(
        f"""
        import json, torch
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        words = [f"w{{i}}" for i in range(120)]
        vocab = {{"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}}
        vocab.update({{w: i + 4 for i, w in enumerate(words)}})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                       bos_token="<s>", eos_token="</s>")
        config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, tie_word_embeddings=False,
                             pad_token_id=0, bos_token_id=2, eos_token_id=3)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained("{work}/model")
        fast.save_pretrained("{work}/model")
        g = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(64):
            ids = torch.randint(0, len(words), (12,), generator=g).tolist()
            rows.append({{"instruction": " ".join(words[i] for i in ids[:6]), "input": "",
                          "output": " ".join(words[i] for i in ids[6:])}})
        (data := __import__("pathlib").Path("{work}/data")).mkdir(exist_ok=True)
        (data / "tiny.json").write_text(json.dumps(rows))
        info = {{"tiny": {{"file_name": "tiny.json"}}}}
        (data / "dataset_info.json").write_text(json.dumps(info))
        """
    )
    _run([str(python), "-c", code])


def run_one(python: Path, work: Path, finetuning: str, backend: str, steps: int) -> list[float]:
    """One SFT on 2 CPU ranks; returns rank 0's per-step losses."""
    out = work / f"{finetuning}-{backend}"
    config = {
        "model_name_or_path": str(work / "model"),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": finetuning,
        "dataset": "tiny",
        "dataset_dir": str(work / "data"),
        "template": "empty",
        "cutoff_len": 32,
        "preprocessing_num_workers": 1,
        "overwrite_cache": True,
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-2,
        "lr_scheduler_type": "constant",
        "max_steps": steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "ddp_timeout": 600,
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        },
    }
    if finetuning == "lora":
        config.update({"lora_rank": 4, "lora_target": "q_proj,v_proj"})
    # JSON is YAML; LlamaFactory 0.9.5 reads .json configs with a bug (json.load of a Path)
    cfg = work / f"{finetuning}-{backend}.yaml"
    cfg.write_text(json.dumps(config))
    runner = work / "runner.py"
    runner.write_text(RUNNER)
    result = work / f"{finetuning}-{backend}.result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("HP_FSDP_BACKEND", None)
    _run(
        [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         "29533", str(runner), backend, str(result), str(cfg)],
        env=env,
    )  # fmt: skip
    info = json.loads(result.read_text())
    expected = "hp_fsdp.api" if backend == "hp" else "torch.distributed.fsdp"
    if not info["fully_shard"].startswith(expected.split(".")[0]):
        raise RuntimeError(f"{backend} run used {info['fully_shard']}.fully_shard")
    return [float(x) for x in info["losses"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/hp-llamafactory"))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    python = args.venv / "bin" / "python" if args.skip_install else make_venv(args.venv)
    work = args.work or Path(tempfile.mkdtemp(prefix="hp-llamafactory-"))
    work.mkdir(parents=True, exist_ok=True)
    make_assets(python, work)
    ok = True
    rows = []
    for finetuning in ("full", "lora"):
        theirs = run_one(python, work, finetuning, "torch", args.steps)
        ours = run_one(python, work, finetuning, "hp", args.steps)
        same = ours == theirs and len(ours) == args.steps
        ok &= same
        rows.append((finetuning, theirs, ours, same))
    print("\n| finetuning | step | torch FSDP2 loss | hp-fsdp loss | equal |")
    print("|---|---|---|---|---|")
    for finetuning, theirs, ours, _ in rows:
        for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
            print(f"| {finetuning} | {i + 1} | {a!r} | {b!r} | {a == b} |")
    print("\nRESULT:", "equal" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
