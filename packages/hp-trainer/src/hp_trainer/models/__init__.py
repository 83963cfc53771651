"""Built-in model families (registered on import): ``llama3``, ``qwen3``, ``qwen3_moe`` and
``deepseek_v3``.

See Also:
    :titan:`torchtitan.models`: TorchTitan's model families.
"""

from hp_trainer.models import deepseek_v3, llama3, qwen3, qwen3_moe
from hp_trainer.models.decoder import Decoder, DecoderArgs

__all__ = ["Decoder", "DecoderArgs", "deepseek_v3", "llama3", "qwen3", "qwen3_moe"]
