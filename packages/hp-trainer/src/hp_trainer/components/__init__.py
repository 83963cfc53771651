"""The trainer's components: checkpointing, data, tokenizer, HuggingFace I/O, metrics, expert
load, validation and profiling. Components import no model family.

See Also:
    :titan:`torchtitan/components/checkpoint.py`, :titan:`torchtitan/components/dataloader.py`,
    :titan:`torchtitan/components/metrics.py`: TorchTitan's components of the same jobs.
"""
