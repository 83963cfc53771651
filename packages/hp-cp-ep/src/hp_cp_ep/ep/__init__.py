"""Expert parallelism and MoE building blocks (filled by the expert-parallel work)."""

__all__: list[str] = []
