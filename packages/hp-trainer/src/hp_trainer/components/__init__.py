"""The trainer's components: checkpointing, data, tokenizer, HuggingFace I/O, metrics, expert
load, validation and profiling. Components import no model family.

See Also:
    :titan:`torchtitan.components`: TorchTitan's components.
"""
