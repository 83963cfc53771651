"""Public names of the runtime side: stages, micro-batching, executor, schedule classes, split."""

__all__: list[str] = []
