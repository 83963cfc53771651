"""Shared pieces of the Accelerate / Trainer integration tests (tiny Llama, tiny tokenizer).

Accelerate 1.16 keeps ``DistributedType.MULTI_CPU`` on a CPU machine and ignores the FSDP plugin
(its state enables FSDP only for accelerator device types). :func:`force_fsdp_on_cpu` sets the
state to ``DistributedType.FSDP`` after construction, as Accelerate's own state would on a GPU,
so ``Accelerator.prepare`` / ``backward`` / ``clip_grad_norm_`` / ``get_state_dict`` /
``save_state`` / ``load_state`` and the Trainer run their unchanged FSDP2 branches.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 96
SEQ = 16
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w91`` plus pad/unk/bos/eos (built in memory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def texts(seed: int, n: int) -> list[str]:
    """``n`` random sentences of ``SEQ`` words (seeded: different on each rank)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (n, SEQ), generator=g)
    return [" ".join(WORDS[i] for i in row.tolist()) for row in idx]


def tiny_llama(seed: int = 0) -> Any:
    """A randomly initialised 2-layer ``LlamaForCausalLM`` (hidden 32, vocab 96)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@contextlib.contextmanager
def accelerate_env() -> Iterator[None]:
    """Rank environment Accelerate reads, and a clean Accelerate state on entry and exit."""
    from accelerate.state import (  # type: ignore[import-untyped]
        AcceleratorState,
        GradientState,
        PartialState,
    )

    saved = dict(os.environ)
    os.environ.update(
        {
            "RANK": str(dist.get_rank()),
            "LOCAL_RANK": str(dist.get_rank()),
            "WORLD_SIZE": str(dist.get_world_size()),
            "LOCAL_WORLD_SIZE": str(dist.get_world_size()),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
            "OMP_NUM_THREADS": "1",
        }
    )
    threads = torch.get_num_threads()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
        gc.collect()


def force_fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Turn the CPU state's ``MULTI_CPU`` into ``FSDP`` as Accelerate does on a GPU machine."""
    from accelerate.state import PartialState  # type: ignore[import-untyped,unused-ignore]
    from accelerate.utils import DistributedType  # type: ignore[import-untyped,unused-ignore]

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's fields whenever it is constructed again; Accelerate
    # keeps the two in step the same way for FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def hp_units(model: torch.nn.Module) -> tuple[int, int]:
    """(modules sharded by hp-fsdp, modules sharded by torch's FSDP2) in ``model``."""
    import torch.distributed.fsdp as torch_fsdp

    from hp_fsdp import FSDPModule
    from hp_fsdp.integrations import _switch

    torch_cls = (_switch._saved or {}).get("FSDPModule", torch_fsdp.FSDPModule)
    ours = sum(isinstance(m, FSDPModule) for m in model.modules())
    theirs = sum(isinstance(m, torch_cls) for m in model.modules())  # type: ignore[arg-type]
    return ours, theirs
