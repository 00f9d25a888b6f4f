"""sglang's own ServerArgs parser for tests, on machines where SGLang cannot run.

``install.py`` puts sglang (``--no-deps``), a few small packages and a triton stand-in into
``.cache/sglang-parser/site``; ``SglangParser`` runs ``worker.py`` with that folder on its path, so that
importing sglang (which patches transformers and sets environment variables) stays out of the test
process, and the 4-9 s import is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from .install import PINS, ROOT, index_reachable, install


class SglangParser:
    def __init__(self, site: Path):
        self.site = Path(site)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-parser-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.site), str(ROOT)])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("worker.py"))], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        first = self._read()
        if "ready" not in first:
            self.close()
            raise RuntimeError(f"sglang's parser did not import:\n{first.get('error')}")
        self.info: Dict[str, Any] = first["ready"]  # version, import_s, file
        self._options: Optional[dict] = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            return {"error": f"worker exited (rc={self.proc.poll()}); its log:\n{self.log.read()[-5000:]}"}
        return json.loads(line)

    def request(self, op: str, **kw) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["ok"]

    def check(self, argv: List[str]) -> Optional[str]:
        """None when sglang's parser accepts the command line (without ``python -m sglang.launch_server``),
        else its error message (``slime_hydra.rollout.engines.sglang.args.check_with_sglang``)."""
        return self.request("check", argv=list(argv))

    def parse(self, argv: List[str], dests: List[str]) -> Dict[str, Any]:
        """The parsed values of ``dests``."""
        return self.request("parse", argv=list(argv), dests=list(dests))

    def options(self) -> dict:
        """{"fields": ServerArgs field names, "dests": parser destinations, "flags": option strings}."""
        if self._options is None:
            self._options = self.request("options")
        return self._options

    def validate(self, overrides: List[str]) -> List[str]:
        """``slime_hydra.launch.validate.validate`` of the composed config, with sglang importable."""
        return self.request("validate", overrides=list(overrides))

    def decode_graph_sizes(self, max_bs: int) -> List[int]:
        """The decode batch sizes sglang captures for ``cuda_graph_max_bs_decode=max_bs``."""
        return self.request("decode_graph_sizes", max_bs=max_bs)

    def read_tensor_payload(self, payload: str, load_format: Optional[str] = None) -> List[list]:
        """[[name, shape, dtype, sum]] of what SGLang's TP worker would load from one
        ``serialized_named_tensors`` entry of ``/update_weights_from_tensor``."""
        return self.request("read_tensor_payload", payload=payload, load_format=load_format)

    def bucket_layout(self, names: List[str], dtypes: List[str], shapes: List[List[int]]) -> Dict[str, Any]:
        """{"numel", "dtype", "entries": [[name, start, end]]} of the buffer SGLang receives for one
        flattened ``/update_weights_from_distributed`` bucket."""
        return self.request("bucket_layout", names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes])

    def tool_calls(self, name: str, tools: List[dict], texts: List[str]) -> List[list]:
        """[content, [[name, arguments]]] of each text, by ``slime_hydra.rollout.tool_calls.sglang_parser(name,
        tools)``: SGLang's own FunctionCallParser, as the agent endpoint uses it on the SGLang engine."""
        return self.request("tool_calls", name=name, tools=list(tools), texts=list(texts))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def start_parser() -> SglangParser:
    """The pinned sglang's parser in a worker process, installed first if need be: what the ``sglang``
    fixtures of the tests yield. Skips the test only when the package index cannot be reached; any
    other installation failure fails it."""
    parser = SglangParser(pinned_site())
    assert parser.info["version"] == PINS[0].split("==")[1], parser.info
    return parser


def pinned_site() -> Path:
    """The folder that holds the pinned sglang, installed first if need be (its source, for tests that read it
    without importing it). Skips the test only when the package index cannot be reached."""
    import warnings

    import pytest

    try:
        return install()
    except subprocess.CalledProcessError as e:
        reachable, where = index_reachable()
        if not reachable:
            reason = f"sglang's parser is not installed and the package index is unreachable: {where}"
            warnings.warn(reason, stacklevel=2)
            pytest.skip(reason)
        pytest.fail(f"pip install {' '.join(PINS)} failed although {where} is reachable:\n{(e.stderr or '')[-4000:]}")
