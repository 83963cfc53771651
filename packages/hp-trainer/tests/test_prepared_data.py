"""hp-train-prepare: parallel tokenization into memory-mapped shards; training reads windows."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_trainer import (
    ConfigManager,
    HuggingFaceTokenizer,
    TokenizedDataset,
    Trainer,
    load_documents,
)
from hp_trainer.components.data.prepare import PrepareOptions, main, prepare_corpus
from hp_trainer.components.data.prepared import PreparedTokenDataset, read_index

DOCS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A .txt file and a .jsonl.gz file (another field name) in one folder, and their docs."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = load_documents("tiny_stories_synth")[:DOCS]
    (folder / "a.txt").write_text("\n".join(docs[: DOCS // 2]) + "\n")
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        for doc in docs[DOCS // 2 :]:
            f.write(json.dumps({"body": doc, "id": 1}) + "\n")
    return folder, docs


@pytest.fixture(scope="module")
def prepared(corpus: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    options = PrepareOptions(
        inputs=(str(corpus[0]),),
        output=str(out),
        text_field="body",
        workers=2,
        batch_documents=64,
        shard_tokens=4000,  # several shards, samples straddle their ends
        progress=False,
    )
    prepare_corpus(options)
    return out


def test_prepared_samples_equal_the_in_memory_packing(
    prepared: Path, corpus: tuple[Path, list[str]]
) -> None:
    tokenizer = HuggingFaceTokenizer()
    reference = TokenizedDataset(corpus[1], tokenizer, seq_len=32)
    dataset = PreparedTokenDataset(prepared, seq_len=32)
    index = read_index(prepared)
    assert len(index["shards"]) > 2
    assert index["num_documents"] == DOCS
    assert (index["dtype"], index["bos_id"], index["eos_id"]) == ("uint16", 0, 1)
    assert len(dataset) == len(reference)
    for i in range(len(dataset)):
        got, want = dataset.sample(i), reference.sample(i)
        assert torch.equal(got[0], want[0]), i
        assert torch.equal(got[1], want[1]), i
    # the document index: every document starts with BOS, at the offsets recorded
    shard = index["shards"][1]
    offsets = torch.frombuffer(
        bytearray((prepared / shard["docs_file"]).read_bytes()), dtype=torch.int64
    )
    start = dataset.shard_starts[1]
    assert len(offsets) == shard["num_documents"]
    assert all(int(dataset.tokens(start + o, start + o + 1)) == 0 for o in offsets.tolist())


def _config(folder: Path, run: str, dataset: Path, checkpoint: dict[str, Any]) -> Any:
    return ConfigManager().from_dict(
        {
            "job": {"run_name": run, "dump_folder": str(folder)},
            "model": {"flavor": "tiny"},
            "training": {"local_batch_size": 2, "seq_len": 32, "steps": 3, "seed": 0,
                         "mixed_precision_param": "float32"},
            "metrics": {"enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(dataset)},
            "checkpoint": checkpoint,
        }
    )  # fmt: skip


def test_train_on_prepared_corpus_resumes_exactly(prepared: Path, tmp_path: Path) -> None:
    def run(name: str, ckpt: dict[str, Any], stop: int | None = None) -> list[float]:
        trainer = Trainer(_config(tmp_path, name, prepared, ckpt))
        assert isinstance(trainer.dataset, PreparedTokenDataset)
        if stop is not None:
            observe = trainer.metrics.observe_loss

            def observe_then_stop(step: int, loss: float) -> None:
                observe(step, loss)
                trainer._stop_requested = step == stop

            trainer.metrics.observe_loss = observe_then_stop  # type: ignore[method-assign]
        try:
            return trainer.train()
        finally:
            trainer.close()

    ckpt = {"enable": True, "interval": 100, "last_save_model_only": False}
    full = run("full", {})
    first = run("stop", ckpt, stop=1)
    rest = run("stop", ckpt)
    assert len(first) == 1
    assert first + rest == full  # bitwise


def test_bad_inputs_are_named(
    corpus: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert main([str(tmp_path / "nope.txt"), "-o", out, "--quiet"]) == 2
    assert "corpus input" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main([str(tmp_path / "empty.txt"), "-o", out, "--quiet", "--workers", "1"]) == 2
    assert "holds no documents" in capsys.readouterr().err
    # the default text field "text" is absent from b.jsonl.gz
    assert main([str(corpus[0] / "b.jsonl.gz"), "-o", out, "--quiet", "--workers", "1"]) == 2
    assert "b.jsonl.gz:1: JSON record has no field 'text'" in capsys.readouterr().err


def test_a_damaged_prepared_corpus_is_refused_at_start_up(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hp_trainer.cli import main as hp_train

    damaged = tmp_path / "damaged"
    shutil.copytree(prepared, damaged)
    shard = damaged / "tokens-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    args = ["--model.flavor", "tiny", "--training.seq_len", "32", "--data.dataset", str(damaged)]
    assert hp_train(args) == 2
    assert "tokens-00001.bin is missing or not" in capsys.readouterr().err


def test_parquet_through_datasets_and_hub_names_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = load_documents("tiny_stories_synth")[:60]
    with monkeypatch.context() as without:  # restores an imported datasets (no re-import)
        without.setitem(sys.modules, "datasets", None)  # as without the extra
        (tmp_path / "x.parquet").write_bytes(b"")
        assert main([str(tmp_path / "x.parquet"), "-o", str(tmp_path / "no"), "--quiet"]) == 2
        assert "pip install 'hp-trainer[datasets]'" in capsys.readouterr().err
    pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": docs, "n": list(range(60))}), tmp_path / "x.parquet")
    out = tmp_path / "from-parquet"
    args = [str(tmp_path / "x.parquet"), "-o", str(out), "--text-field", "body", "--quiet"]
    assert main([*args, "--workers", "1"]) == 0
    reference = TokenizedDataset(docs, HuggingFaceTokenizer(), seq_len=32)
    dataset = PreparedTokenDataset(out, seq_len=32)
    assert len(dataset) == len(reference)
    assert torch.equal(dataset.tokens(0, dataset.num_tokens), reference.tokens)
    # an absent field is named with the fields there are
    assert main([str(tmp_path / "x.parquet"), "-o", str(tmp_path / "f"), "--quiet"]) == 2
    assert "record 1 has no field 'text' (fields: body, n)" in capsys.readouterr().err
    # hub names need a network: offline they fail with a clear message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # datasets reads the variable when imported: an earlier import would keep trying the network
    monkeypatch.setattr(sys.modules["datasets"].config, "HF_HUB_OFFLINE", True)
    assert main(["someone/no-such-dataset", "-o", str(tmp_path / "h"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "could not read the dataset 'someone/no-such-dataset' from the HuggingFace hub" in err
