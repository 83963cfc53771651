"""Context parallel attention (filled by the context-parallel work)."""

__all__: list[str] = []
