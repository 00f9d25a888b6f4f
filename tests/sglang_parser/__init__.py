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

from .install import ROOT


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
        else its error message (``slime_hydra.rollout.engines.sglang.check_with_sglang``)."""
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
