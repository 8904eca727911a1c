"""``python -m shardopt``: which extension modules serve the kernels (loads or builds them)."""

from shardopt.kernels.loader import describe

if __name__ == "__main__":
    print(describe())
