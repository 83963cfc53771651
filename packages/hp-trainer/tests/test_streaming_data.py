"""Training straight from a streamed ``datasets`` source: same samples as the in-memory packing,
a partition of the corpus over data-parallel ranks, exact resume, bad input named up front."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import (
    ConfigManager,
    HuggingFaceTokenizer,
    StreamingTextLoader,
    TokenizedDataset,
    Trainer,
    load_documents,
)
from hp_trainer.components.data.streaming import StreamingSource, check_streaming_source
from hp_trainer.preflight import preflight

# imported in the tests, not when pytest collects every file (datasets takes seconds to import)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs the datasets extra"
)

DOCS = 90
SEQ = 32


@contextmanager
def _datasets_cache(folder: Path) -> Iterator[None]:
    """``datasets`` writes lock files into its cache even when streaming: keep them in tmp."""
    import datasets

    before = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = folder / "hf-datasets-cache"
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = before


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path) -> Iterator[None]:
    with _datasets_cache(tmp_path):
        yield


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _documents() -> list[str]:
    return load_documents("tiny_stories_synth")[:DOCS]


def _write_jsonl(path: Path, docs: list[str], field: str = "body") -> None:
    with open(path, "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({field: doc, "id": i}) + "\n")


def _write_corpus(folder: Path) -> dict[str, Path]:
    """The same documents as one .jsonl, one .parquet (row groups of 16) and three .jsonl files."""
    docs = _documents()
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "one.jsonl", docs)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"body": docs, "n": list(range(DOCS))}), folder / "one.parquet", row_group_size=16
    )
    (folder / "three").mkdir(exist_ok=True)
    for i in range(3):
        _write_jsonl(folder / "three" / f"part-{i}.jsonl", docs[i * 30 : (i + 1) * 30])
    return {"jsonl": folder / "one.jsonl", "parquet": folder / "one.parquet"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stream")
    _write_corpus(folder)
    return folder


def _samples(loader: StreamingTextLoader, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(batches)]


def _assert_same_samples(
    got: list[tuple[torch.Tensor, torch.Tensor]], reference: TokenizedDataset, batch: int
) -> None:
    for b, (inputs, labels) in enumerate(got):
        for j in range(batch):
            ref_inputs, ref_labels = reference.sample(b * batch + j)
            assert torch.equal(inputs[j], ref_inputs), (b, j)
            assert torch.equal(labels[j], ref_labels), (b, j)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_streamed_samples_equal_the_in_memory_packing(corpus: Path, fmt: str) -> None:
    tokenizer = HuggingFaceTokenizer()
    reference = TokenizedDataset(_documents(), tokenizer, SEQ)
    path = corpus / f"one.{fmt}"
    loader = StreamingTextLoader(str(path), tokenizer, SEQ, 0, 1, 3, text_field="body")
    batches = len(reference) // 3
    got = _samples(loader, 5)
    loader.close()  # closes the files; reading again continues where it stopped
    got += _samples(loader, batches - 5)
    _assert_same_samples(got, reference, 3)
    assert loader.epoch == 0
    # the ids left over are the corpus tail: the next sample wraps into the next epoch
    next(iter(loader))
    assert loader.epoch == 1


@pytest.mark.parametrize(("dp", "by_file"), [(2, False), (3, True)])
def test_ranks_partition_the_corpus(corpus: Path, dp: int, by_file: bool) -> None:
    """Three files over dp 3: a file per rank; over dp 2: every other record of each file.

    Each rank's samples are the packing of exactly its documents, and the documents of the
    ranks are disjoint and together the corpus.
    """
    tokenizer = HuggingFaceTokenizer()
    docs = _documents()
    owned: list[list[int]] = []
    for rank in range(dp):
        if by_file:  # file r (30 documents) to rank r
            mine = list(range(rank * 30, (rank + 1) * 30))
        else:  # record k of each file to rank k % dp
            mine = [f * 30 + k for f in range(3) for k in range(30) if k % dp == rank]
        owned.append(mine)
        # two epochs of exactly its documents, packed on across the epoch boundary
        reference = TokenizedDataset([docs[i] for i in mine + mine], tokenizer, SEQ)
        loader = StreamingTextLoader(
            str(corpus / "three"), tokenizer, SEQ, rank, dp, 2, text_field="body"
        )
        batches = len(reference) // 2
        _assert_same_samples(_samples(loader, batches), reference, 2)
        assert loader.epoch == 1
    flat = sorted(i for mine in owned for i in mine)
    assert flat == list(range(DOCS))  # disjoint, and together every document


def _resume_on_ranks(folder: str, cache: str) -> tuple[dict[str, Any], bool]:
    """dp = world: read 7 batches, save, read 30 more (past the end of the rank's part); a fresh
    loader loaded from the state reads the same 30."""
    with _datasets_cache(Path(cache) / f"rank{dist.get_rank()}"):
        return _resume(folder)


def _resume(folder: str) -> tuple[dict[str, Any], bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = HuggingFaceTokenizer()

    def loader() -> StreamingTextLoader:
        return StreamingTextLoader(
            str(Path(folder) / "one.parquet"), tokenizer, SEQ, rank, world, 2, text_field="body"
        )

    first = loader()
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    expected = [next(it) for _ in range(30)]
    assert first.epoch >= 1  # the rank's part (about 1/world of ~100 samples) wrapped
    resumed = loader()
    resumed.load_state_dict(state)
    got = _samples(resumed, 30)
    same = all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(expected, got, strict=True)
    )
    return state, same


def test_resume_continues_at_the_next_token_on_three_ranks(corpus: Path, tmp_path: Path) -> None:
    results = run_distributed(_resume_on_ranks, 3, str(corpus), str(tmp_path), timeout=120)
    states = [state for state, _ in results]
    assert all(same for _, same in results)
    assert all(s == states[0] for s in states)  # one copy in the checkpoint
    assert len(json.loads(states[0]["ranks"])) == 3
    # another data-parallel degree is refused, naming both
    other = StreamingTextLoader(
        str(corpus / "one.parquet"), HuggingFaceTokenizer(), SEQ, 0, 2, 2, text_field="body"
    )
    with pytest.raises(ValueError, match=r"saved at data-parallel degree 3, this run has .* 2"):
        other.load_state_dict(states[0])
    with pytest.raises(ValueError, match="not a streamed loader's"):
        other.load_state_dict({"samples_consumed": 8})


_CKPT = {"enable": True, "interval": 2, "last_save_model_only": False}


def _job(
    folder: Path,
    run: str,
    *,
    streaming: bool,
    steps: int,
    ckpt: bool = False,
    par: dict[str, int] | None = None,
) -> Any:
    checkpoint = _CKPT if ckpt else {}
    cfg = _helpers().job(folder, par or {}, run=run, steps=steps, checkpoint=checkpoint)
    cfg.data.dataset = str(folder / "one.jsonl")
    cfg.data.jsonl_text_field = "body"
    cfg.data.shuffle = False
    cfg.data.streaming = streaming
    return cfg


def _train(cfg: Any, stop_after: int | None = None) -> list[float]:
    trainer = Trainer(cfg)
    if stop_after is not None:
        _helpers().stop_at(trainer, stop_after)
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_three_steps_streamed_equal_the_in_memory_run(
    corpus: Path, tmp_path: Path, mask: str
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(corpus, folder)
    runs = []
    for streaming in (True, False):
        cfg = _job(folder, f"streamed-{streaming}", streaming=streaming, steps=3)
        cfg.model.attn_mask_type = mask  # document masking: ids from the packed tokens
        runs.append(_train(cfg))
    streamed, in_memory = runs
    assert len(streamed) == 3
    assert streamed == in_memory  # the same samples in the same order: bitwise


def _stop_resume_on_ranks(
    folder: str, par: dict[str, int]
) -> tuple[list[float], list[float], list[float]]:
    root = Path(folder) / "x".join(f"{k[0]}{v}" for k, v in par.items())
    with _datasets_cache(root / f"rank{dist.get_rank()}"):
        return _stop_resume(Path(folder), root.name, par)


def _stop_resume(
    root: Path, tag: str, par: dict[str, int]
) -> tuple[list[float], list[float], list[float]]:
    def job(run: str, ckpt: bool) -> Any:
        return _job(root, f"{tag}-{run}", streaming=True, steps=4, ckpt=ckpt, par=par)

    full = _train(job("full", False))
    stopped = _train(job("stop", True), stop_after=2)
    resumed = _train(job("stop", True))
    return full, stopped, resumed


def test_stop_and_resume_on_dp2_continue_the_stream(corpus: Path, tmp_path: Path) -> None:
    """dp 2, then dp 2 x tp 2 (the same data per dp rank; tp peers read the same part)."""
    shutil.copytree(corpus, tmp_path / "run")
    dp2 = {"data_parallel_shard_degree": 2}
    results = run_distributed(_stop_resume_on_ranks, 2, str(tmp_path / "run"), dp2, timeout=180)
    full, stopped, resumed = results[0]
    assert stopped == full[:2]
    assert resumed == full[2:]  # the checkpointed stream position: the next batches exactly
    dp2tp2 = {**dp2, "tensor_parallel_degree": 2}
    tp = run_distributed(_stop_resume_on_ranks, 4, str(tmp_path / "run"), dp2tp2, timeout=180)
    tp_full, tp_stopped, tp_resumed = tp[0]
    torch.testing.assert_close(torch.tensor(tp_full), torch.tensor(full), rtol=1e-5, atol=1e-5)
    assert tp_stopped + tp_resumed == tp_full
    # the dp-2 checkpoint in one process (dp 1): refused through the checkpoint load, both named
    longer = _job(tmp_path / "run", "d2-stop", streaming=True, steps=6, ckpt=True)
    with pytest.raises(ValueError, match="degree 2, this run has data-parallel degree 1"):
        _train(longer)


def _cfg(dataset: str, *extra: str) -> Any:
    args = ["--model.flavor", "tiny", "--training.seq_len", str(SEQ), "--data.dataset", dataset]
    return ConfigManager().parse_args(
        [*args, "--data.streaming", "true", "--data.shuffle", "false", *extra]
    )


def test_bad_input_fails_before_any_process_starts(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"data.shuffle = True: expected false with data.stre"):
        ConfigManager().parse_args(["--data.streaming", "true"])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=f"data.dataset '{missing}' does not exist"):
        preflight(_cfg(str(missing)), 1)
    with pytest.raises(ValueError, match=r"one.jsonl: its records have no field 'text' \(fie"):
        preflight(_cfg(str(corpus / "one.jsonl")), 1)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        preflight(_cfg(str(tmp_path / "empty.jsonl")), 1)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(corpus / "one.jsonl", mixed)
    shutil.copy(corpus / "one.parquet", mixed)
    with pytest.raises(ValueError, match="mixes file formats"):
        StreamingSource.resolve(str(mixed))
    # a field absent in a later file only is found too
    parts = tmp_path / "parts"
    shutil.copytree(corpus / "three", parts)
    _write_jsonl(parts / "part-2.jsonl", _documents()[:3], field="content")
    with pytest.raises(ValueError, match=r"part-2.jsonl: its records have no field 'body'"):
        check_streaming_source(str(parts), "body")
    # a rank whose part holds no document: a clear error at its first batch, not a hang
    _write_jsonl(tmp_path / "two.jsonl", _documents()[:2])
    tokenizer = HuggingFaceTokenizer()
    starved = StreamingTextLoader(str(tmp_path / "two.jsonl"), tokenizer, SEQ, 2, 3, 1)
    with pytest.raises(ValueError, match="gave data-parallel rank 2 of 3 no documents"):
        next(iter(starved))
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    blank = StreamingTextLoader(str(tmp_path / "blank.txt"), tokenizer, SEQ, 0, 1, 1)
    with pytest.raises(ValueError, match="gave data-parallel rank 0 of 1 no documents"):
        next(iter(blank))
    # fine: the built-in corpus and a parquet file with the field
    assert check_streaming_source("tiny_stories_synth").builder == "text"
    preflight(_cfg(str(corpus / "one.parquet"), "--data.jsonl_text_field", "body"), 1)
    # without the extra: one error with the pip command, before anything is read
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'hp-trainer\[datasets\]'"):
        preflight(_cfg(str(corpus / "one.jsonl")), 1)


def test_hub_names_fail_offline_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="'someone/no-such-dataset' from the HuggingFace hub"):
        check_streaming_source("someone/no-such-dataset")
