"""Document masking (``model.attn_mask_type = "block_causal"``): packed documents attend only
within themselves.

Oracles: each document run on its own (same logits and gradients as the packed sequence), plain
causal attention (one document: bitwise equal), one process (the trainer under FSDP)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import (
    ConfigManager,
    HuggingFaceTokenizer,
    TokenizedDataset,
    Trainer,
    ValidationConfig,
    load_documents,
)
from hp_trainer.components.validation import Validator
from hp_trainer.models.common.decoder import Decoder
from hp_trainer.models.common.document_mask import DocumentBoundaries, block_causal_mask
from hp_trainer.models.deepseek_v3 import DeepSeekV3, deepseek_v3_flavors
from hp_trainer.models.llama3 import llama3_flavors
from hp_trainer.models.qwen3 import qwen3_flavors
from hp_trainer.models.qwen3_moe import Qwen3MoE, qwen3_moe_flavors

BOS, EOS = 0, 1


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


# -- document ids --------------------------------------------------------------------------------


def test_document_ids_start_at_bos_and_after_eos() -> None:
    tokens = torch.tensor([[7, EOS, BOS, 5, 6, EOS, BOS, 8], [BOS, 4, 4, 4, EOS, 9, 9, 9]])
    both = DocumentBoundaries(BOS, EOS).document_ids(tokens)
    assert both.dtype == torch.int64
    assert both.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]]
    # BOS only: a document starts at each BOS
    assert DocumentBoundaries(BOS, None).document_ids(tokens).tolist() == [
        [0, 0, 1, 1, 1, 1, 2, 2],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    # EOS only: a document starts after each EOS
    assert DocumentBoundaries(None, EOS).document_ids(tokens).tolist() == [
        [0, 0, 1, 1, 1, 1, 2, 2],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]


def test_bad_document_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="BOS or an EOS"):
        DocumentBoundaries(None, None)
    with pytest.raises(TypeError, match="integer tensor"):
        DocumentBoundaries(BOS, EOS).document_ids(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        block_causal_mask(torch.zeros(4, dtype=torch.long))


def test_block_causal_mask_is_causal_within_documents() -> None:
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    assert mask.shape == (1, 1, 5, 5)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


# -- the attention of every model family ------------------------------------------------------


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module
    if family == "llama3":
        model = Decoder(llama3_flavors["tiny"])
    elif family == "qwen3":  # QK-norm, grouped-query attention
        model = Decoder(qwen3_flavors["tiny"])
    elif family == "qwen3_moe":
        model = Qwen3MoE(qwen3_moe_flavors["tiny"])
    else:  # latent attention
        model = DeepSeekV3(deepseek_v3_flavors["tiny"])
    model.init_weights()  # type: ignore[operator]
    return model


def _loss_and_grads(
    model: nn.Module, logits: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_packed_documents_equal_each_document_alone(family: str) -> None:
    model = _model(family)
    gen = torch.Generator().manual_seed(1)
    lengths = (7, 12, 9)  # three documents, each ending in EOS but the last (cut by the window)
    docs = [torch.randint(2, 2000, (n,), generator=gen) for n in lengths]
    for doc in docs[:-1]:
        doc[-1] = EOS
    packed = torch.cat(docs)[None]
    labels = torch.randint(2, 2000, packed.shape, generator=gen)
    ids = DocumentBoundaries(BOS, EOS).document_ids(packed)
    assert ids[0].tolist() == [0] * 7 + [1] * 12 + [2] * 9

    logits = model(packed, document_ids=ids)
    grads = _loss_and_grads(model, logits, labels)

    # oracle: every document on its own, at the RoPE positions it has in the packed sequence
    table = model.get_buffer("rope_cache")
    alone, start = [], 0
    for doc in docs:
        model.rope_cache = table[start:]
        alone.append(model(doc[None]))
        start += doc.numel()
    model.rope_cache = table
    separate = torch.cat(alone, dim=1)
    separate_grads = _loss_and_grads(model, separate, labels)

    torch.testing.assert_close(logits, separate, rtol=0, atol=1e-6)
    # positions restarted per document: RoPE scores depend on the query-key offset only,
    # the same inside a document either way (so only rounding differs)
    restarted = torch.cat([model(doc[None]) for doc in docs], dim=1)
    torch.testing.assert_close(logits, restarted, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, separate_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # the mask matters: causal attention over the packed sequence is something else
    causal = model(packed)
    assert (causal[0, 7:] - logits[0, 7:]).abs().max() > 1e-2
    torch.testing.assert_close(causal[0, :7], logits[0, :7], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_one_document_is_causal_bitwise(family: str) -> None:
    model = _model(family)
    tokens = torch.randint(2, 2000, (2, 32), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(tokens, -1, dims=1)
    ids = DocumentBoundaries(BOS, EOS).document_ids(tokens)
    assert int(ids.max()) == 0
    block = model(tokens, document_ids=ids)
    block_grads = _loss_and_grads(model, block, labels)
    causal = model(tokens)
    causal_grads = _loss_and_grads(model, causal, labels)
    assert torch.equal(block, causal)
    for name, grad in block_grads.items():
        assert torch.equal(grad, causal_grads[name]), name


def test_validation_masks_documents_too() -> None:
    model = _model("llama3")
    tokenizer = HuggingFaceTokenizer()
    data = TokenizedDataset(load_documents("tiny_stories_synth")[:20], tokenizer, 32)
    boundaries = DocumentBoundaries(tokenizer.bos_id, tokenizer.eos_id)
    config = ValidationConfig(enable=True, dataset="held-out", local_batch_size=3, steps=2)
    loss, _ = Validator(config, data, 0, 1, document_boundaries=boundaries).validate(model)
    inputs = torch.stack([data.sample(i)[0] for i in range(6)])
    labels = torch.stack([data.sample(i)[1] for i in range(6)])
    with torch.no_grad():
        logits = model(inputs, document_ids=boundaries.document_ids(inputs))
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        causal = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    assert loss == pytest.approx(float(expected), rel=1e-6)
    assert abs(float(causal) - loss) > 1e-4


# -- configuration -----------------------------------------------------------------------------


def _parse(*args: str) -> Any:
    return ConfigManager().parse_args(list(args))


def test_config_option_and_its_refusals() -> None:
    assert _parse().model.attn_mask_type == "causal"
    assert _parse("--model.attn_mask_type", "block_causal").model.attn_mask_type == "block_causal"
    with pytest.raises(ValueError, match=r"model.attn_mask_type = 'sliding'.*'block_causal'"):
        _parse("--model.attn_mask_type", "sliding")
    pp = ("--parallelism.pipeline_parallel_degree", "2")
    assert _parse("--model.attn_mask_type", "block_causal", *pp).model.attn_mask_type == (
        "block_causal"
    )
    cp = ("--model.attn_mask_type", "block_causal", "--parallelism.context_parallel_degree", "2")
    assert _parse(*cp).parallelism.context_parallel_rotate_method == "allgather"
    with pytest.raises(ValueError, match="both pipeline_parallel_degree and context_parallel"):
        _parse(*cp, *pp)
    # every rotate method carries the document ids to the attention (the ring gathers them)
    for method in ("ulysses", "ring", "alltoall", "hybrid"):
        parsed = _parse(*cp, "--parallelism.context_parallel_rotate_method", method)
        assert parsed.parallelism.context_parallel_rotate_method == method


# -- the trainer -------------------------------------------------------------------------------


def _train(folder: str, par: dict[str, Any], local_bs: int, mask: str, seq_len: int = 32) -> Any:
    h = _helpers()
    rank = dist.get_rank() if dist.is_initialized() else "ref"
    cfg = h.job(Path(folder), par, run=f"{mask}-{rank}", local_bs=local_bs)
    cfg.model.attn_mask_type = mask
    cfg.training.seq_len = seq_len
    trainer = Trainer(cfg)
    try:
        losses = trainer.train()
        return losses, trainer.grad_norms, h.full_state(trainer.model_parts)
    finally:
        trainer.close()


def test_trainer_block_causal_under_fsdp_and_tp_matches_one_process(tmp_path: Path) -> None:
    folder = str(tmp_path)
    fsdp = run_distributed(
        _train, 2, folder, {"data_parallel_shard_degree": 2}, 2, "block_causal", timeout=120
    )
    # TP shards the heads; every rank applies the whole (batch, seq, seq) mask to its heads
    tp = run_distributed(
        _train, 2, folder, {"tensor_parallel_degree": 2}, 4, "block_causal", timeout=120
    )
    ref = _train(folder, {}, 4, "block_causal")
    _helpers().assert_matches_reference(fsdp, ref, each_rank_whole=True)
    _helpers().assert_matches_reference(tp, ref, each_rank_whole=True)
    causal_losses = _train(str(tmp_path), {}, 4, "causal")[0]
    # the option reaches the attention: the first step's loss already differs
    assert abs(causal_losses[0] - ref[0][0]) > 1e-4


def test_trainer_block_causal_under_pipeline_parallel_matches_one_process(tmp_path: Path) -> None:
    folder = str(tmp_path)
    # the ids are split into micro-batches with the inputs and reach both stages
    pp = run_distributed(
        _train, 2, folder, {"pipeline_parallel_degree": 2}, 2, "block_causal", timeout=120
    )
    ref = _train(folder, {}, 2, "block_causal")
    _helpers().assert_matches_reference(pp, ref)


def test_trainer_block_causal_under_context_parallel_matches_one_process(tmp_path: Path) -> None:
    folder = str(tmp_path)
    # the load-balanced shards of the document ids reach the engine with every attention call
    allgather = run_distributed(
        _train, 2, folder, {"context_parallel_degree": 2}, 2, "block_causal", timeout=120
    )
    ulysses = run_distributed(
        _train, 2, folder,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ulysses"},
        2, "block_causal", timeout=120,
    )  # fmt: skip
    # the ring masks each step's K/V block with the gathered ids of its positions
    ring = run_distributed(
        _train, 2, folder,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ring"},
        2, "block_causal", timeout=120,
    )  # fmt: skip
    ref = _train(folder, {}, 2, "block_causal")
    _helpers().assert_matches_reference(allgather, ref, each_rank_whole=True)
    _helpers().assert_matches_reference(ulysses, ref, each_rank_whole=True)
    _helpers().assert_matches_reference(ring, ref, each_rank_whole=True)


def test_trainer_block_causal_under_context_parallel_3_matches_one_process(tmp_path: Path) -> None:
    folder = str(tmp_path)
    # 3 ranks: 6 load-balanced chunks of 4 positions
    cp3 = run_distributed(
        _train, 3, folder, {"context_parallel_degree": 3}, 2, "block_causal", 24, timeout=120
    )
    ref = _train(folder, {}, 2, "block_causal", 24)
    _helpers().assert_matches_reference(cp3, ref, each_rank_whole=True)


def test_block_causal_with_activation_checkpointing_is_bitwise(tmp_path: Path) -> None:
    # the mask reaches the recomputed attention too (a keyword input of every block)
    h = _helpers()
    losses = []
    for mode in ("none", "full"):
        cfg = h.job(tmp_path, {}, run=f"ac-{mode}", local_bs=2, steps=2)
        cfg.model.attn_mask_type = "block_causal"
        cfg.activation_checkpoint.mode = mode
        trainer = Trainer(cfg)
        try:
            losses.append(trainer.train())
        finally:
            trainer.close()
    assert losses[0] == losses[1]


def test_block_causal_stop_and_resume_is_exact(tmp_path: Path) -> None:
    # the ids are recomputed from the resumed loader's samples: nothing new in its state
    h = _helpers()
    ckpt = {"enable": True, "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}

    def run(name: str, stop: int | None = None, checkpoint: dict[str, Any] | None = None) -> Any:
        cfg = h.job(tmp_path, {}, run=name, local_bs=2, steps=4, checkpoint=checkpoint)
        cfg.model.attn_mask_type = "block_causal"
        trainer = Trainer(cfg)
        if stop is not None:
            h.stop_at(trainer, stop)
        try:
            return trainer.train(), trainer.checkpointer.loaded_step
        finally:
            trainer.close()

    full, _ = run("full")
    stopped, _ = run("stop", stop=2, checkpoint=ckpt)
    resumed, loaded = run("stop", checkpoint=ckpt)
    assert loaded == 2
    assert stopped == full[:2]
    assert resumed == full[2:]
