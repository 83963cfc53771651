"""Model families, one folder each: ``llama3``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``,
``deepseek_v32`` (DeepSeek-V3.2: a lightning indexer and sparse latent attention over its top-k),
``qwen3_5`` (the Gated DeltaNet hybrid, dense and MoE; ``qwen3_5_moe`` names its MoE flavor),
``gpt_oss`` (attention sinks, alternating sliding-window and full layers, biased experts),
``llama4`` (iRoPE, chunked attention, interleaved MoE with a shared expert).

Each folder holds the family's model (or uses :mod:`hp_trainer.models.common`'s decoder),
``flavors`` (its sizes), ``parallelize`` (its TP/EP plan and recipe), ``state_dict_adapter``
(its HuggingFace mapping) and, where it has one, ``hf_config`` (its ``config.json`` reader);
importing the folder registers the family's :class:`~hp_trainer.protocols.model_spec.ModelSpec`.
``common`` holds the building blocks the families share. This package imports no family, so a
building block never pulls in a model (the registry imports them by name on first lookup).

See Also:
    :titan:`torchtitan.models`: TorchTitan's model families.
"""
