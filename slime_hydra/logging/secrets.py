"""Keep secrets out of what a run writes (config.yaml, wandb's config, logs of command lines): a value under
a key named like one (``HF_TOKEN``, ``api_key``, ``*_PASSWORD``), or any string holding the value of such an
environment variable. Pass secrets through the environment (Hydra records command-line overrides).
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterable, List

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"(^|[_-])(api[_-]?key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
MIN_SECRET_LEN = 6  # shorter environment values ("1", "true") would redact ordinary text


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def secret_values(env: Dict[str, str] = None) -> List[str]:
    """The values of this process's environment variables that are named like secrets."""
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LEN}, key=len, reverse=True)


def redact_text(text: str, values: Iterable[str] = None) -> str:
    for v in secret_values() if values is None else values:
        text = text.replace(v, REDACTED)
    return text


def redact(obj: Any, values: Iterable[str] = None) -> Any:
    """A copy of a JSON-like tree with secret-named keys' values and secret strings redacted."""
    values = secret_values() if values is None else list(values)
    if isinstance(obj, dict):
        return {k: (REDACTED if is_secret_name(k) and obj[k] not in (None, "") and not isinstance(obj[k], (dict, list))
                    else redact(obj[k], values)) for k in obj}
    if isinstance(obj, (list, tuple)):
        return [redact(v, values) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, values)
    return obj


def redact_argv(cmd: List[str]) -> List[str]:
    """A command line with the value of a secret-named flag (``--api-key X``) and secret values redacted."""
    out: List[str] = []
    hide_next = False
    for arg in cmd:
        flag, eq, _ = arg.partition("=")
        named = not hide_next and flag.startswith("--") and is_secret_name(flag[2:])
        out.append(REDACTED if hide_next else (f"{flag}={REDACTED}" if eq else arg) if named else redact_text(arg))
        hide_next = named and not eq
    return out


def redacted_config(cfg: Any) -> Dict[str, Any]:
    """The resolved run config as a plain dict, secrets redacted (for config.yaml and wandb)."""
    from omegaconf import OmegaConf

    return redact(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
