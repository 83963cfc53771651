"""The contracts between the trainer and a model family: :class:`ModelSpec` and its registry.

See Also:
    :titan:`torchtitan.protocols`: TorchTitan's protocols.
"""
