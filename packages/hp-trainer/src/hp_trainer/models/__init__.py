"""Built-in model families (registered on import): ``llama3`` and ``qwen3``.

See Also:
    ``torchtitan.models``: TorchTitan's model families.
"""

from hp_trainer.models import llama3, qwen3
from hp_trainer.models.decoder import Decoder, DecoderArgs

__all__ = ["Decoder", "DecoderArgs", "llama3", "qwen3"]
