"""``python -m slime_hydra.data convert IN OUT ...`` (see ``convert``) and ``python -m slime_hydra.data check
FILE[@[a:b]] [--input-key K --label-key K]`` (validate a dataset as training reads it)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from slime_hydra.data import convert


def check(argv: Sequence[str]) -> int:
    from slime_hydra.data.dataset import DataError, read_rows

    p = argparse.ArgumentParser(prog="python -m slime_hydra.data check",
                                description="Validate a prompt dataset (JSONL / JSON / parquet).")
    p.add_argument("path", help="the file, optionally with a row slice: data.jsonl@[0:100]")
    p.add_argument("--input-key", default="prompt")
    p.add_argument("--label-key", default="label", help="'' for a dataset without labels")
    args = p.parse_args(argv)
    try:
        rows = read_rows(args.path, input_key=args.input_key, label_key=args.label_key or None)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    chat = sum(not isinstance(r.prompt, str) for r in rows)
    print(f"{args.path}: {len(rows)} rows ok ({chat} chat prompts, {len(rows) - chat} text prompts)")
    return 0


COMMANDS = {"convert": lambda argv: convert.main(argv, prog="python -m slime_hydra.data convert"), "check": check}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m slime_hydra.data {{{','.join(COMMANDS)}}} ...  (-h after a command for help)",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
