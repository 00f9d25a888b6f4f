"""``rollout.server_args`` checked against the installed sglang: the fields slime_hydra sets itself
(``MANAGED_SERVER_ARGS``) are refused with the config key to use instead, the rest goes through sglang's own
ServerArgs parser (``check_server_args``). ``python -m slime_hydra.rollout.engines.sglang.args`` is that check
in a child process (JSON server_args on stdin, ``[[key, problem]]`` on stdout; ``fast_start.ServerArgsCheck``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from slime_hydra.config.deferred import defer as defer_check
from slime_hydra.rollout.engines.base import to_flags
from slime_hydra.rollout.engines.sglang.fast_start import ServerArgsCheck

if TYPE_CHECKING:
    import argparse

# ServerArgs fields set from the run config or the resource plan -> where they come from
MANAGED_SERVER_ARGS: Dict[str, str] = {
    "model_path": "model.path",
    "tokenizer_path": "model.tokenizer",
    "trust_remote_code": "model.trust_remote_code",
    "host": "the engine's node address",
    "port": "a free port on the engine's node",
    "tp_size": "parallelism.gpus_per_engine",
    "base_gpu_id": "the placement group",
    "random_seed": "rollout.seed",
    "enable_memory_saver": "parallelism.offload_rollout",
    "nnodes": "parallelism.gpus_per_engine / gpus_per_node",
    "node_rank": "the placement group",
    "dist_init_addr": "the placement group",
    "nccl_port": "a free port on the engine's node",
    "skip_server_warmup": "slime_hydra (always on)",
}


@functools.lru_cache(maxsize=1)
def sglang_parser() -> "argparse.ArgumentParser":
    """The installed sglang's server argument parser (``ServerArgs.add_cli_args``); ImportError without sglang."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def check_with_sglang(argv: List[str]) -> Optional[str]:
    """A server command line (without ``python -m sglang.launch_server``) parsed by sglang's own parser: None, or
    its error; ImportError without sglang. The ServerArgs constructor's cross-field rules are left to the server."""
    import argparse
    import io

    parser = sglang_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:  # unrecognized or missing arguments: argparse prints, then exits
        lines = err.getvalue().strip().splitlines()
        return lines[-1].split("error: ", 1)[-1] if lines else "rejected by sglang"
    except argparse.ArgumentError as e:  # bad type or choice (exit_on_error=False)
        return str(e)
    return None


def check_server_args(server_args: Dict[str, Any]) -> List[Tuple[str, str]]:
    """``rollout.server_args`` checked key by key by sglang's parser, as ``to_flags`` passes it: [(key, problem)];
    ImportError without sglang. Without sglang imported, in a child process (its import sets inherited variables)."""
    if "sglang.srt.server_args" in sys.modules:
        return _check_server_args_here(server_args)
    return ServerArgsCheck(server_args).result()


def server_args_problems(server_args: Dict[str, Any], defer: bool = False) -> List[str]:
    """Validation's problems with ``rollout.server_args``: keys slime_hydra sets, and what sglang's parser refuses
    (with ``defer``, inside ``config.deferred.deferred_checks``, answered later from a child process)."""
    import importlib.util
    import logging

    errs = [f"rollout.server_args.{key}: set by slime_hydra from {MANAGED_SERVER_ARGS[key]}; remove it"
            for key in server_args if key in MANAGED_SERVER_ARGS]
    if not server_args or importlib.util.find_spec("sglang") is None:
        return errs
    if defer and "sglang.srt.server_args" not in sys.modules and defer_check(lambda: ServerArgsCheck(server_args)):
        return errs
    try:
        errs += [f"rollout.server_args.{key}: {problem}" for key, problem in check_server_args(server_args)]
    except Exception as e:  # noqa: BLE001 - an sglang that does not import: the server will say more
        logging.getLogger(__name__).warning("rollout.server_args not checked: sglang's ServerArgs did not "
                                            "import (%s: %s)", type(e).__name__, e)
    return errs


def _check_server_args_here(server_args: Dict[str, Any]) -> List[Tuple[str, str]]:
    import argparse
    import difflib

    import sglang

    parser = sglang_parser()
    actions = {s: a for a in parser._actions for s in a.option_strings}
    version = str(getattr(sglang, "__version__", "?"))
    problems: List[Tuple[str, str]] = []
    for key, value in server_args.items():
        if key in MANAGED_SERVER_ARGS:
            continue
        flag = "--" + key.replace("_", "-")
        action = actions.get(flag)
        if action is None:
            names = sorted({a.dest for a in parser._actions if a.dest != "help"})
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.75)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            problems.append((key, f"not a ServerArgs option of sglang {version} (no {flag}){hint}"))
        elif action.dest in MANAGED_SERVER_ARGS:
            problems.append((key, f"{flag} is sglang's alias of {action.dest}, set by slime_hydra from "
                                  f"{MANAGED_SERVER_ARGS[action.dest]}; remove it"))
        elif value is False and action.nargs != 0:
            problems.append((key, f"false is left off the command line, and {flag} takes a value; "
                                  "give one or remove the key"))
        elif value is False and isinstance(action, argparse.BooleanOptionalAction) and action.default is not False:
            problems.append((key, "false is left off the command line, which keeps sglang's default "
                                  f"({action.default}); write no_{key}: true for --no-{flag[2:]}"))
        elif (err := check_with_sglang(["--model-path", "model", *to_flags({key: value})])) is not None:
            problems.append((key, f"{err} (sglang {version})"))
    return problems


if __name__ == "__main__":  # check_server_args in a child process: JSON server_args on stdin -> [[key, problem]]
    import json

    _reply, sys.stdout = sys.stdout, sys.stderr  # whatever sglang prints stays off the reply
    _reply.write(json.dumps(_check_server_args_here(json.load(sys.stdin))) + "\n")
