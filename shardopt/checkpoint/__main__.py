"""``python -m shardopt.checkpoint {consolidate,inspect}``: offline checkpoint tools.

Exit status: 0 done (``inspect``: every file intact), 1 ``inspect`` found a damaged file, 2 bad
input (a checkpoint that cannot be read, an output path that cannot be written): one
``error: ...`` line on stderr.
"""

import argparse
import sys

from shardopt._version import __version__
from shardopt.checkpoint import CheckpointError, consolidate, inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardopt.checkpoint")
    parser.add_argument("--version", action="version", version=f"shardopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a plain torch.optim state dict (and model)")
    c.add_argument("checkpoint")
    c.add_argument("out")
    i = sub.add_parser("inspect", help="summarise a checkpoint and check its files")
    i.add_argument("checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            for path in consolidate(args.checkpoint, args.out):
                print(f"wrote {path}")
        else:
            report = inspect(args.checkpoint)
            print(report)
            return 0 if report.rstrip().endswith("OK") else 1
    except (CheckpointError, OSError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
