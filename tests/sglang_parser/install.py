"""Install sglang's server argument parser, not the server, into a cache folder.

    python tests/sglang_parser/install.py [--dir DIR]      # prints the folder to put on PYTHONPATH

sglang pins torch, transformers and GPU kernels that cannot run on CPU machines, so it goes in with
``--no-deps`` into ``<dir>/site`` (git-ignored, default ``.cache/sglang-parser``), with the packages its
``server_args`` imports (``PINS``; sglang 0.5.17 imports far more at module level than 0.5.23 did) and
stand-ins for triton and torchvision (``stubs/``). torch and the rest come from the project's environment.
With ``<dir>/site`` on the path, ``from sglang.srt.server_args import ServerArgs`` works and
``ServerArgs.add_cli_args`` builds the real parser. Use it in a separate process: importing sglang
patches transformers and sets environment variables, and ``<dir>/site`` holds its own transformers.

Exact versions, binary wheels only; a stamp file makes a second run a no-op. Measured on the 2-core CPU
machines (shared with other jobs): install 10-21 s from PyPI, 288 MB on disk; the import takes 13-22 s.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_DIR = ROOT / ".cache" / "sglang-parser"
STUBS = HERE / "stubs"

SGLANG_VERSION = "0.5.17"
PINS = [
    f"sglang=={SGLANG_VERSION}",
    # imported by sglang at module level (sglang/utils.py, sglang/srt/utils/common.py, server_args.py)
    "msgspec==0.23.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "ipython==9.18.1",  # sglang/utils.py: from IPython.display import HTML, display
    "traitlets==5.16.1",  # IPython's
    "pygments==2.21.0",  # IPython's (pytest brings one too)
    # sglang 0.5.17 registers configs (qwen3_asr) that transformers >= 5.17 already has: it takes the
    # transformers of the GPU bundle (../shared/tools/sglang-bundle.sh), with the tokenizers and hub it accepts
    "transformers==5.12.1",
    "tokenizers==0.22.2",
    "huggingface-hub==1.33.0",
    "openai==2.6.1",  # sglang 0.5.17's server_args imports its OpenAI protocol types
    "jiter==0.19.0",  # openai's
    "partial-json-parser==0.2.1.1.post7",  # sglang 0.5.17: its function-call parsers, imported by server_args
    "xgrammar==0.2.1",  # sglang 0.5.17: a function-call parser imports its StructuralTag
    "apache-tvm-ffi==0.1.11",  # xgrammar's
    "sentencepiece==0.2.1",  # sglang 0.5.17: its InternVL config, imported by server_args
    # transformers 5.12.1 imports `kernels` when it finds one; without one here it would find the project's
    # (transformers >= 5.25 requires kernels 0.19, whose LayerRepository refuses 5.12.1's mapping)
    "kernels==0.12.3",
]


def _fingerprint() -> dict:
    stub = hashlib.sha256()
    for f in sorted(STUBS.rglob("*.py")):
        stub.update(f.relative_to(STUBS).as_posix().encode() + b"\0" + f.read_bytes())
    return {"pins": PINS, "stubs": stub.hexdigest()[:16], "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def installed(dir: Path = DEFAULT_DIR) -> Optional[Path]:
    """``<dir>/site`` when it holds this exact installation, else None."""
    site = Path(dir) / "site"
    try:
        return site if json.loads((site / ".installed.json").read_text()) == _fingerprint() else None
    except (OSError, ValueError):
        return None


def index_url() -> str:
    """The package index pip uses (PIP_INDEX_URL, pip's configuration, else PyPI)."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = out.stdout.strip() if out.returncode == 0 else ""
    return url or "https://pypi.org/simple"


def index_reachable(timeout: float = 5.0) -> Tuple[bool, str]:
    """(reachable, what was tried): a TCP connection to the index's host, or its folder for file: URLs."""
    url = index_url()
    parts = urllib.parse.urlparse(url)
    if parts.scheme == "file":
        return os.path.isdir(parts.path), url
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
        return True, url
    except OSError as e:
        return False, f"{url} ({type(e).__name__}: {e})"


@contextlib.contextmanager
def _lock(dir: Path):
    import fcntl

    dir.mkdir(parents=True, exist_ok=True)
    with open(dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def install(dir: Path = DEFAULT_DIR, quiet: bool = True) -> Path:
    """Install (once) and return ``<dir>/site``. Raises CalledProcessError when pip fails."""
    dir = Path(dir)
    site = installed(dir)
    if site is not None:
        return site
    with _lock(dir):
        site = installed(dir)  # another process may have finished meanwhile
        if site is not None:
            return site
        site = dir / "site"
        tmp = dir / f"site.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        reachable, _ = index_reachable()
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--no-compile",
               "--disable-pip-version-check", "--target", str(tmp), *PINS]
        if not reachable:  # maybe a local mirror (find-links) has them: fail fast if not
            cmd[4:4] = ["--retries", "0", "--timeout", "10"]
        if quiet:
            cmd.insert(4, "--quiet")
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, check=True, capture_output=quiet, text=True)
        except subprocess.CalledProcessError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for stub in sorted(d for d in STUBS.iterdir() if d.is_dir()):
            shutil.copytree(stub, tmp / stub.name)
        (tmp / ".installed.json").write_text(json.dumps(_fingerprint(), indent=1))
        shutil.rmtree(site, ignore_errors=True)
        os.replace(tmp, site)
        if not quiet:
            print(f"installed in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return site


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"cache folder (default {DEFAULT_DIR})")
    args = ap.parse_args()
    print(install(args.dir, quiet=False))


if __name__ == "__main__":
    main()
