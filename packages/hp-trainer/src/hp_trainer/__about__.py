"""Version of this distribution (the single source read by the build backend)."""

__version__ = "0.1.10"
