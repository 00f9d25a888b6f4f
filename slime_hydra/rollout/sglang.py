"""Where the engine command lines used to live; they moved to ``slime_hydra.rollout.engines`` (one
class per engine kind). These names stay importable from here for existing callers (config
validation reads ``MANAGED_SERVER_ARGS`` and ``check_server_args``)."""

from slime_hydra.rollout.engines import ServerSpec, server_command, to_flags
from slime_hydra.rollout.engines.sglang import (MANAGED_SERVER_ARGS, SGLANG_ENV, check_server_args, check_with_sglang,
                                                sglang_parser, sglang_version)

__all__ = ["MANAGED_SERVER_ARGS", "SGLANG_ENV", "ServerSpec", "check_server_args", "check_with_sglang",
           "server_command", "sglang_parser", "sglang_version", "to_flags"]
