"""A process that imports sglang's ServerArgs parser once (from the folder install.py made) and answers
requests, one JSON object a line on stdin -> one on stdout. Started by ``SglangParser`` (__init__.py).

Requests: {"op": "options"} | {"op": "check", "argv": [...]} | {"op": "parse", "argv": [...], "dests": [...]}
| {"op": "validate", "overrides": [...]} | {"op": "decode_graph_sizes", "max_bs": int}
| {"op": "read_tensor_payload", "payload": str, "load_format": ...}
| {"op": "bucket_layout", "names": [...], "dtypes": [...], "shapes": [...]}
| {"op": "tool_calls", "name": str, "tools": [...], "texts": [...]}.
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

    from slime_hydra.rollout.engines.sglang.args import sglang_parser

    parser = sglang_parser()
    fields = getattr(ServerArgs, "__dataclass_fields__", None)
    if fields is None:  # sglang >= 0.5.2x: msgspec-style records
        from sglang.srt.server_args import record_fields

        fields = [f.name for f in record_fields(ServerArgs)]
    return {"fields": sorted(fields), "dests": sorted({a.dest for a in parser._actions}),
            "flags": sorted(s for a in parser._actions for s in a.option_strings)}


def _parse(argv, dests) -> dict:
    from slime_hydra.rollout.engines.sglang.args import sglang_parser

    ns = sglang_parser().parse_args(argv)
    return {d: getattr(ns, d) for d in dests}


def _read_tensor_payload(payload: str, load_format):
    """What SGLang's TP worker makes of one ``update_weights_from_tensor`` payload (tp_worker.py
    ``_deserialize_own_rank``, weight_updater.py ``update_weights_from_tensor``), up to the model's
    load_weights: [[name, shape, dtype, sum]] of the tensors it would load."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    data = MultiprocessingSerializer.deserialize(payload)
    if load_format == "flattened_bucket":
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
        named = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta).reconstruct_tensors()
    else:
        named = list(data)
    return [[n, list(t.shape), str(t.dtype), float(t.double().sum())] for n, t in named]


def _bucket_layout(names, dtypes, shapes):
    """The flattened buffer SGLang receives over ``update_weights_from_distributed(load_format=
    "flattened_bucket")`` (weight_updater.py ``_update_bucketed_weights_from_distributed``)."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=[(n, torch.empty(s, dtype=getattr(torch, d)))
                                                  for n, d, s in zip(names, dtypes, shapes)])
    flat = bucket.get_flattened_tensor()
    return {"numel": flat.numel(), "dtype": str(flat.dtype),
            "entries": [[m.name, m.start_idx, m.end_idx] for m in bucket.get_metadata()]}


def _tool_calls(name, tools, texts):
    """[content, [[name, arguments]]] of each text, by ``tool_calls.sglang_parser`` (SGLang's FunctionCallParser)."""
    from slime_hydra.rollout.tool_calls import sglang_parser

    parse = sglang_parser(name, tools)
    return [[content, [[n, a] for n, a in calls]] for content, calls in map(parse, texts)]


def _decode_graph_sizes(max_bs):
    """The decode batch sizes sglang captures for ``cuda_graph_max_bs_decode=max_bs`` (its own generator,
    no speculative decoding, padding on)."""
    from types import SimpleNamespace

    from sglang.srt.server_args import ServerArgs

    return ServerArgs._generate_decode_cuda_graph_batch_sizes(
        SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None), max_bs)


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

        from slime_hydra.rollout.engines.sglang.args import sglang_parser

        sglang_parser()
        ready = {"version": sglang.__version__, "import_s": round(time.perf_counter() - t0, 2), "file": sglang.__file__}
        out.write(json.dumps({"ready": ready}) + "\n")
    except BaseException:
        out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        out.flush()
        return
    out.flush()
    from slime_hydra.rollout.engines.sglang.args import check_with_sglang

    ops = {"options": lambda r: _options(), "check": lambda r: check_with_sglang(r["argv"]),
           "parse": lambda r: _parse(r["argv"], r["dests"]),
           "validate": lambda r: _validate(r["overrides"]),
           "decode_graph_sizes": lambda r: _decode_graph_sizes(r["max_bs"]),
           "read_tensor_payload": lambda r: _read_tensor_payload(r["payload"], r.get("load_format")),
           "bucket_layout": lambda r: _bucket_layout(r["names"], r["dtypes"], r["shapes"]),
           "tool_calls": lambda r: _tool_calls(r["name"], r["tools"], r["texts"])}
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
