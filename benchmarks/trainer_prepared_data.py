"""Peak RSS and start-up of hp-trainer on a prepared corpus of 5 MB vs 50 MB of text.

For each size, a corpus is generated (the shipped synthetic documents, cycled, each made unique
by a number), tokenized once with ``hp-train-prepare`` (2 workers), and then one training
process (a fresh interpreter, the tiny Llama 3, seq_len 128, 5 steps) is started on it. The
figures are its start-up time (``Trainer(config)``: model, tokenizer, data; imports excluded),
the time to open the prepared corpus alone, and its peak RSS (``ru_maxrss``). The same is done
for the in-memory path (``--data.dataset corpus.txt``, which tokenizes the whole text in every
rank before step 1) at the smallest size, as the reference the prepared format replaces. With
the prepared format neither figure should grow with the corpus.

Usage::

    python benchmarks/trainer_prepared_data.py [--sizes 5,50] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TRAIN = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
start = time.perf_counter()
from hp_trainer import ConfigManager, Trainer
imported = time.perf_counter()
cfg = ConfigManager().from_dict({
    "job": {"dump_folder": sys.argv[2]},
    "model": {"flavor": "tiny"},
    "training": {"local_batch_size": 4, "seq_len": 128, "steps": 5,
                 "mixed_precision_param": "float32"},
    "metrics": {"enable_plot": False, "enable_progress_bar": False, "log_freq": 100},
    "data": {"dataset": sys.argv[1]},
})
trainer = Trainer(cfg)
startup = time.perf_counter() - imported
data_open = None
if hasattr(trainer.dataset, "index"):  # a prepared corpus: time opening it alone
    opened = time.perf_counter()
    type(trainer.dataset)(sys.argv[1], 128)
    data_open = time.perf_counter() - opened
trainer.train()
trainer.close()
print(json.dumps({"import_s": imported - start, "startup_s": startup, "data_open_s": data_open,
    "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "samples": len(trainer.dataset)}))
"""


def _corpus(path: Path, megabytes: int) -> None:
    from hp_trainer import load_documents

    docs = load_documents("tiny_stories_synth")
    target = megabytes * 1024 * 1024
    written = 0
    with open(path, "w") as f:
        i = 0
        while written < target:
            line = f"{docs[i % len(docs)]} (story {i})\n"
            f.write(line)
            written += len(line)
            i += 1


def _train(dataset: Path, folder: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _TRAIN, str(dataset), str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="5,50")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hp-prepared-bench-") as tmp:
        root = Path(tmp)
        for mb in (int(s) for s in args.sizes.split(",")):
            text = root / f"corpus-{mb}mb.txt"
            _corpus(text, mb)
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "hp_trainer.components.data.prepare", str(text), "-o",
                 str(root / f"prepared-{mb}"), "--workers", "2", "--quiet"],
                check=True,
            )  # fmt: skip
            prepare_s = time.perf_counter() - start
            result = _train(root / f"prepared-{mb}", root / "runs")
            rows.append({"format": "prepared", "corpus_mb": mb, "prepare_s": prepare_s, **result})
            print(rows[-1], flush=True)
        smallest = min(int(s) for s in args.sizes.split(","))
        result = _train(root / f"corpus-{smallest}mb.txt", root / "runs")
        rows.append({"format": "in-memory text", "corpus_mb": smallest, **result})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trainer_prepared_data.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "# hp-trainer: prepared corpus, peak RSS and start-up vs corpus size",
        "",
        "One training process (tiny Llama 3, seq_len 128, 5 steps, CPU, on a shared 2-core "
        "machine: start-up times are noisy). Start-up is `Trainer(config)` without imports; "
        "open data is `PreparedTokenDataset(...)`; peak RSS is `ru_maxrss` of the process.",
        "",
        "| format | corpus MB | samples | prepare s | start-up s | open data s | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prep = f"{r['prepare_s']:.1f}" if "prepare_s" in r else "-"
        opened = f"{r['data_open_s']:.4f}" if r.get("data_open_s") is not None else "-"
        lines.append(
            f"| {r['format']} | {r['corpus_mb']} | {r['samples']:,} | {prep} | "
            f"{r['startup_s']:.2f} | {opened} | {r['peak_rss_mib']:.0f} |"
        )
    (args.out / "trainer_prepared_data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
