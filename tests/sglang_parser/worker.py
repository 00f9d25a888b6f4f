"""A process that imports sglang's ServerArgs parser once (from the folder install.py made) and answers
requests, one JSON object a line on stdin -> one on stdout. Started by ``SglangParser`` (__init__.py).

Requests: {"op": "options"} | {"op": "check", "argv": [...]} | {"op": "parse", "argv": [...], "dests": [...]}
| {"op": "validate", "overrides": [...]}.
Replies: {"ok": <result>} or {"error": <traceback>}. The first line says {"ready": {...}} or {"error": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _options() -> dict:
    from sglang.srt.server_args import ServerArgs

    from slime_hydra.rollout.engines.sglang import sglang_parser

    parser = sglang_parser()
    fields = getattr(ServerArgs, "__dataclass_fields__", None)
    if fields is None:  # sglang >= 0.5.2x: msgspec-style records
        from sglang.srt.server_args import record_fields

        fields = [f.name for f in record_fields(ServerArgs)]
    return {"fields": sorted(fields), "dests": sorted({a.dest for a in parser._actions}),
            "flags": sorted(s for a in parser._actions for s in a.option_strings)}


def _parse(argv, dests) -> dict:
    from slime_hydra.rollout.engines.sglang import sglang_parser

    ns = sglang_parser().parse_args(argv)
    return {d: getattr(ns, d) for d in dests}


def _validate(overrides):
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import resolved

    from slime_hydra.launch.validate import validate

    return validate(resolved(overrides))


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever sglang prints stays off the reply channel
    t0 = time.perf_counter()
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs  # noqa: F401

        from slime_hydra.rollout.engines.sglang import sglang_parser

        sglang_parser()
        ready = {"version": sglang.__version__, "import_s": round(time.perf_counter() - t0, 2), "file": sglang.__file__}
        out.write(json.dumps({"ready": ready}) + "\n")
    except BaseException:
        out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        out.flush()
        return
    out.flush()
    from slime_hydra.rollout.engines.sglang import check_with_sglang

    ops = {"options": lambda r: _options(), "check": lambda r: check_with_sglang(r["argv"]),
           "parse": lambda r: _parse(r["argv"], r["dests"]),
           "validate": lambda r: _validate(r["overrides"])}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"ok": ops[req["op"]](req)}
        except BaseException:
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's 1-2 s teardown of torch and sglang


if __name__ == "__main__":
    main()
