"""HuggingFace interop shared by the families: ``config.json`` <-> model arguments (``config``),
the state-dict adapter bases (``adapters``, ``moe_adapters``) and sharded safetensors import and
export (``sharded_io``). Each family's own adapter and config reader live in its folder."""
