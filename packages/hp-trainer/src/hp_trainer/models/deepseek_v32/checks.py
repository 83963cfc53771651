"""Parse-time checks of a DeepSeek-V3.2 job (called by :class:`~hp_trainer.config.JobConfig`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig

__all__ = ["dsa_job_error", "index_topk_error"]

MODEL_NAME = "deepseek_v32"


def index_topk_error(args: Any, seq_len: int) -> str | None:
    """Why ``args.index_topk`` cannot be trained at ``seq_len``, or None.

    Args:
        args: DeepSeek-V3.2 model arguments.
        seq_len: The training sequence length.

    Returns:
        A message naming both values when ``index_topk > seq_len`` (no query could ever
        have that many visible tokens: the attention would silently be dense), else None.
    """
    topk = int(args.index_topk)
    if topk > seq_len:
        return (
            f"model index_topk = {topk} is larger than training.seq_len = {seq_len}: no query "
            f"sees more than {seq_len} tokens, so DSA would attend densely; expected "
            f"index_topk <= seq_len (a longer seq_len, or a flavor with a smaller index_topk)"
        )
    return None


def dsa_job_error(config: JobConfig) -> tuple[str, str, object, str] | None:
    """The first ``[dsa]`` / DeepSeek-V3.2 option of ``config`` that cannot work, or None.

    Registered as the spec's ``job_check``, which
    :class:`~hp_trainer.config.JobConfig` calls when a job names ``deepseek_v32``. Checked:
    context parallelism with a rotate method DSA cannot use (``ulysses``, ``hybrid``), the dense
    warm-up, tensor parallelism or document masking; a named
    flavor's ``index_topk`` over ``training.seq_len`` (``auto`` flavors: checked when the model
    is parallelized).

    Args:
        config: The job configuration.

    Returns:
        ``(section, field, value, expected)`` of the first problem, else None.
    """
    dsa = config.dsa
    par = config.parallelism
    cp = par.context_parallel_degree
    if cp > 1:
        from hp_cp_ep.dsa import DSA_ROTATE_METHODS

        why = f"with model.name = '{MODEL_NAME}' and context_parallel_degree = {cp}: "
        if par.context_parallel_rotate_method not in DSA_ROTATE_METHODS:
            methods = ", ".join(repr(m) for m in DSA_ROTATE_METHODS)
            reason = "DSA's context parallelism moves the indexer's keys and selected rows"
            method = par.context_parallel_rotate_method
            return ("parallelism", "context_parallel_rotate_method", method,
                    f"one of {methods} {why}{reason}")  # fmt: skip
        if dsa.indexer_stage != "sparse":
            return ("dsa", "indexer_stage", dsa.indexer_stage, f"'sparse' {why}the dense "
                    "warm-up's loss needs every key's attention probabilities")  # fmt: skip
        if par.tensor_parallel_degree > 1:
            return ("parallelism", "tensor_parallel_degree", par.tensor_parallel_degree,
                    f"1 {why}the indexer loss over heads split by TP has no context-parallel "
                    "path")  # fmt: skip
        if config.model.attn_mask_type != "causal":
            return ("model", "attn_mask_type", config.model.attn_mask_type, f"'causal' {why}"
                    "the context-parallel selection does not get the documents' ids")  # fmt: skip
    from hp_trainer.models.deepseek_v32.flavors import deepseek_v32_flavors

    flavor = config.model.flavor
    if flavor in deepseek_v32_flavors:
        seq_len = config.training.seq_len
        problem = index_topk_error(deepseek_v32_flavors[flavor], seq_len)
        if problem is not None:
            return ("training", "seq_len", seq_len, f"a length the flavor {flavor!r} can take "
                    f"({problem})")  # fmt: skip
    return None
