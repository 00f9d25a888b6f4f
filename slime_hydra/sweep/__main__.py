"""``python -m slime_hydra.sweep report DIR``: rebuild a sweep's report (sweep.csv, sweep.md,
sweep_curves.png) from its run directories, and print the table."""

from __future__ import annotations

import argparse
import os
import sys

from slime_hydra.sweep.report import write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.sweep")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="rebuild sweep.csv, sweep.md and sweep_curves.png of a sweep directory")
    rep.add_argument("dir", help="the sweep directory (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"{args.dir}: no such directory", file=sys.stderr)
        return 2
    rows = write_report(args.dir)
    if not rows:
        print(f"{args.dir}: no sweep jobs found (no sweep_job.json under it)", file=sys.stderr)
        return 1
    with open(os.path.join(args.dir, "sweep.md")) as f:
        print(f.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
