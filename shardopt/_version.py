"""The one place the version lives (pyproject.toml reads it; shardopt.__version__ re-exports it)."""

__version__ = "0.1.0"
