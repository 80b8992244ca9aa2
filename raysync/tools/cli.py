"""The `raysync` command: demo, doctor, bench (each takes --help)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": (
        "raysync.tools.demo",
        "a local Ray, a trainer and engines (vLLM when installed), pushes, a check",
    ),
    "doctor": (
        "raysync.tools.doctor",
        "what this machine / cluster supports and which transport each pair gets",
    ),
    "bench": (
        "raysync.tools.bench",
        "every transport here x bucket sizes x model layouts, next to copy floors; --ray: through WeightSync",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: raysync {demo,doctor,bench} [--help]\n")
        print("\n".join(f"  {name:<8}{text}" for name, (_, text) in COMMANDS.items()))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"raysync: unknown command {command!r} (try: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
