"""Mutation testing with a list of targeted mutations (tests/mutation/mutations.yaml): each one is applied
alone to a copy of the tree, its group's fast tests run against that copy, and the file is restored
whatever happens. A mutation that no test notices survives: a bug the suite would let through.

    python tests/mutation/mutate.py                       # every mutation
    python tests/mutation/mutate.py --group algorithms    # one group
    python tests/mutation/mutate.py --only kl_loss_sign,std_biased --timeout 120
    python tests/mutation/mutate.py --list

Verdicts: killed (a test failed), timeout (counted as killed: the mutation hung a test), survived
(every test passed), error (the snippet is not in the file exactly once, or pytest could not run
the tests: exit codes 2-5). The tests of each group first run on the unmutated copy and must pass.
Exit status: 0 when nothing survived and nothing errored, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "__pycache__", ".pytest_cache", "results",
                                "*.egg-info", ".cache", ".sglang-bundle", ".device-bundle", ".gpu-extra", ".gpu-stage")


@dataclass
class Mutation:
    id: str
    group: str
    file: str
    original: str
    replacement: str
    why: str = ""
    tests: Optional[List[str]] = None


@dataclass
class Result:
    id: str
    verdict: str  # killed | timeout | survived | error
    seconds: float
    detail: str  # the first failing test, or what went wrong


def load(path: Path) -> tuple:
    spec = yaml.safe_load(path.read_text())
    groups: Dict[str, List[str]] = spec["groups"]
    muts = [Mutation(**m) for m in spec["mutations"]]
    seen = set()
    for m in muts:
        if m.id in seen:
            raise SystemExit(f"{path}: mutation id {m.id!r} appears twice")
        seen.add(m.id)
        if m.tests is None and m.group not in groups:
            raise SystemExit(f"{path}: mutation {m.id!r} is in group {m.group!r}, not one of {sorted(groups)}")
    return groups, muts


def run_tests(tree: Path, args: List[str], timeout: float) -> tuple:
    """(pytest exit code or 124 on timeout, its output)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "offline", "RAY_AUTH_MODE": "disabled",
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *args]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out
    return p.returncode, p.stdout + p.stderr


def first_failure(output: str) -> str:
    m = re.search(r"^(FAILED|ERROR) (\S+)", output, re.M)
    return m.group(2) if m else output.strip().splitlines()[-1] if output.strip() else ""


def mutate_one(tree: Path, m: Mutation, args: List[str], timeout: float) -> Result:
    path = tree / m.file
    t0 = time.perf_counter()
    if not path.is_file():
        return Result(m.id, "error", 0.0, f"{m.file} does not exist: update tests/mutation/mutations.yaml")
    source = path.read_text()
    count = source.count(m.original)
    if count != 1:
        return Result(m.id, "error", 0.0, f"the original snippet occurs {count} times in {m.file}: update "
                                          "tests/mutation/mutations.yaml")
    try:
        path.write_text(source.replace(m.original, m.replacement))
        code, out = run_tests(tree, args, timeout)
    finally:
        path.write_text(source)
    seconds = time.perf_counter() - t0
    if code == 0:
        return Result(m.id, "survived", seconds, "every test passed")
    if code == 1:
        return Result(m.id, "killed", seconds, first_failure(out))
    if code == 124:
        return Result(m.id, "timeout", seconds, f"the tests ran over {timeout:g}s")
    return Result(m.id, "error", seconds, f"pytest exit code {code}: {first_failure(out)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutations", default=str(Path(__file__).with_name("mutations.yaml")))
    ap.add_argument("--group", help="only this group's mutations")
    ap.add_argument("--only", help="comma-separated mutation ids")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    a = ap.parse_args()
    groups, muts = load(Path(a.mutations))
    if a.group:
        muts = [m for m in muts if m.group == a.group]
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {m.id for m in muts}
        if unknown:
            raise SystemExit(f"unknown mutation id(s): {', '.join(sorted(unknown))}")
        muts = [m for m in muts if m.id in wanted]
    if a.list:
        for m in muts:
            print(f"{m.id:<36} {m.group:<12} {m.file}: {m.why}")
        return 0

    results: List[Result] = []
    with tempfile.TemporaryDirectory(prefix="mutate_") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=IGNORE)
        baseline: Dict[tuple, bool] = {}
        for m in muts:
            args = m.tests or groups[m.group]
            if tuple(args) not in baseline:
                print(f"baseline: pytest {' '.join(args)}", flush=True)
                code, out = run_tests(tree, args, a.timeout)
                baseline[tuple(args)] = code == 0
                if code != 0:
                    print(f"  the unmutated tree fails (exit {code}: {first_failure(out)}); its mutations are "
                          "reported as errors", flush=True)
            if not baseline[tuple(args)]:
                results.append(Result(m.id, "error", 0.0, "its tests fail on the unmutated tree"))
                continue
            r = mutate_one(tree, m, args, a.timeout)
            results.append(r)
            print(f"{r.verdict:<9} {r.id:<36} {r.seconds:6.1f}s  {r.detail}", flush=True)

    survived = [r for r in results if r.verdict == "survived"]
    errors = [r for r in results if r.verdict == "error"]
    killed = len(results) - len(survived) - len(errors)
    print(f"\n{len(results)} mutations: {killed} killed, {len(survived)} survived, {len(errors)} errors")
    for r in survived:
        m = next(x for x in muts if x.id == r.id)
        print(f"  SURVIVED {r.id} ({m.file}): {m.why}")
    for r in errors:
        print(f"  ERROR {r.id}: {r.detail}")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
