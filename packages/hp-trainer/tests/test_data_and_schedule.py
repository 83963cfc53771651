"""Data sharding by data-parallel rank, tokenizer and LR schedule shapes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from hp_trainer import (
    HuggingFaceTokenizer,
    LRSchedulerConfig,
    ParallelAwareDataloader,
    TokenizedDataset,
    load_documents,
    lr_factor,
)


@pytest.fixture(scope="module")
def dataset() -> TokenizedDataset:
    docs = load_documents("tiny_stories_synth")[:200]
    return TokenizedDataset(docs, HuggingFaceTokenizer("builtin"), seq_len=16)


def test_tokenizer_roundtrip_and_specials() -> None:
    tok = HuggingFaceTokenizer()
    ids = tok.encode("The little fox went to the river.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == "The little fox went to the river."
    assert tok.vocab_size <= 2048


def test_samples_are_shifted_windows(dataset: TokenizedDataset) -> None:
    x, y = dataset.sample(3)
    assert x.shape == y.shape == (16,)
    torch.testing.assert_close(x[1:], y[:-1])


@pytest.mark.parametrize("dp", [2, 3])
def test_ranks_partition_the_single_process_order(dataset: TokenizedDataset, dp: int) -> None:
    single = iter(ParallelAwareDataloader(dataset, 0, 1, 2 * dp, seed=5))
    ranks = [iter(ParallelAwareDataloader(dataset, r, dp, 2, seed=5)) for r in range(dp)]
    n_batches = dataset.num_samples // (2 * dp)
    for _ in range(n_batches + 2):  # crosses an epoch boundary
        x, y = next(single)
        parts = [next(it) for it in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y)
        assert not torch.equal(parts[0][0], parts[1][0])  # different data on each rank


def test_loader_state_resumes(dataset: TokenizedDataset) -> None:
    a = ParallelAwareDataloader(dataset, 1, 2, 2, seed=1)
    it = iter(a)
    for _ in range(3):
        next(it)
    b = ParallelAwareDataloader(dataset, 1, 2, 2, seed=1)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(next(iter(b))[0], next(it)[0])


def test_local_text_and_jsonl_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n")
    (tmp_path / "b.jsonl").write_text('{"body": "third doc"}\n')
    assert load_documents(str(tmp_path / "a.txt")) == ["first doc", "second doc"]
    assert load_documents(str(tmp_path / "b.jsonl"), "body") == ["third doc"]
    with pytest.raises(ValueError, match="no field 'text'"):
        load_documents(str(tmp_path / "b.jsonl"))
    with pytest.raises(ValueError, match="neither a built-in dataset"):
        load_documents(str(tmp_path / "missing.txt"))


def test_too_small_dataset_is_an_error(dataset: TokenizedDataset) -> None:
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        ParallelAwareDataloader(dataset, 0, 4, 10_000)


def test_lr_schedules() -> None:
    steps = 100
    cosine = LRSchedulerConfig(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1)
    f = [lr_factor(s, steps, cosine) for s in range(steps)]
    assert f[0] == pytest.approx(1 / 11)
    assert f[9] == pytest.approx(10 / 11)
    assert all(a <= b for a, b in itertools.pairwise(f[:10]))  # warm-up rises
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))  # then decays
    assert f[-1] > 0.1
    assert f[-1] < 0.12
    wsd = LRSchedulerConfig(warmup_steps=10, decay_type="wsd")
    g = [lr_factor(s, steps, wsd) for s in range(steps)]
    assert g[10:82] == [1.0] * 72  # stable until the last 20% of the post-warm-up steps
    assert g[-1] < 0.1
    lin = LRSchedulerConfig(warmup_steps=0, decay_type="linear")
    h = [lr_factor(s, steps, lin) for s in range(steps)]
    assert h[0] == pytest.approx(1 - 1 / 101)
    assert all(math.isclose(a - b, 1 / 101, rel_tol=1e-6) for a, b in itertools.pairwise(h))
    const = LRSchedulerConfig(warmup_steps=0, decay_type="constant")
    assert {lr_factor(s, steps, const) for s in range(steps)} == {1.0}


def _global_stream(
    dataset: TokenizedDataset, dp: int, state: dict[str, int], n: int
) -> torch.Tensor:
    loaders = [ParallelAwareDataloader(dataset, r, dp, 4 // dp, seed=2) for r in range(dp)]
    for loader in loaders:
        loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    return torch.cat([torch.cat([next(it)[0] for it in its]) for _ in range(n)])


def test_loader_state_resumes_under_another_dp_degree(dataset: TokenizedDataset) -> None:
    saver = ParallelAwareDataloader(dataset, 1, 2, 2, seed=2)
    it = iter(saver)
    for _ in range(dataset.num_samples // 4 - 1):  # the next global batches straddle an epoch
        next(it)
    state = saver.state_dict()
    assert state["samples_consumed"] == (dataset.num_samples // 4 - 1) * 4
    n = 3
    reference = _global_stream(dataset, 2, state, n)
    for dp in (1, 4):  # the same global sample order at other degrees, same global batch
        torch.testing.assert_close(_global_stream(dataset, dp, state, n), reference)
    # a position saved in the old (batch_index) form converts through the samples consumed
    legacy = {"epoch": 0, "batch_index": 5, "batch_size": 2, "dp_world_size": 2}
    loader = ParallelAwareDataloader(dataset, 0, 4, 1, seed=2)
    loader.load_state_dict(legacy)
    assert loader.samples_consumed == 20
    with pytest.raises(ValueError, match="not a multiple of this loader's global micro-batch 8"):
        ParallelAwareDataloader(dataset, 0, 4, 2).load_state_dict({"samples_consumed": 20})
