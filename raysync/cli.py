"""The `raysync` command. Subcommands: demo (doctor and bench follow)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: raysync demo [--engines N] [--pushes N] [--bucket-mb MB]")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from raysync.demo import main as demo

        return demo(rest)
    print(f"raysync: unknown command {command!r} (try: raysync demo)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
