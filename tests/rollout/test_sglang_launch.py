"""The SGLang launcher's process model (slime_hydra/rollout/engines/sglang_launch.py), run with a server
module of the same shape as sglang.launch_server (sglang itself does not install on the CPU machines):
it forces the spawn start method, changes its environment, then starts a worker with multiprocessing.Process."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = """
import os
import sys
import time

IMPORTED_IN = os.getpid()
time.sleep(1.0)  # a slow import, as SGLang's scheduler's (about 20 s on an H200)


def run(pipe):
    pipe.send({"pid": os.getpid(), "imported_in": IMPORTED_IN, "late": os.environ.get("SET_LATE"),
               "server_argv": os.environ.get("SERVER_ARGV")})
"""

SERVER = """
import json
import multiprocessing as mp
import os
import sys
import time

if __name__ == "__main__":
    started = time.monotonic()
    mp.set_start_method("spawn", force=True)  # as sglang's _set_envs_and_config
    os.environ["SET_LATE"] = "set just before the worker starts"
    os.environ["SERVER_ARGV"] = " ".join(sys.argv[1:])
    from worker import run

    reader, writer = mp.Pipe(duplex=False)
    proc = mp.Process(target=run, args=(writer,))
    proc.start()
    got = reader.recv()
    proc.join()
    print(json.dumps({**got, "server_pid": os.getpid(), "exitcode": proc.exitcode,
                      "process_class": type(proc).__name__, "worker_s": time.monotonic() - started}))
"""


def test_workers_fork_from_a_preloaded_server_in_the_servers_environment(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    (tmp_path / "server.py").write_text(textwrap.dedent(SERVER))
    code = ("import sys; from slime_hydra.rollout.engines.sglang_launch import main; "
            "main(sys.argv[1:], server_module='server', worker_modules=('worker',))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, "--port", "30000"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["exitcode"] == 0 and got["process_class"] == "WorkerProcess"
    # the worker's module was imported in the forkserver, not in the worker (nor in the server)
    assert got["imported_in"] not in (got["pid"], got["server_pid"])
    # what the server set in its environment just before the worker started reached the worker
    assert got["late"] == "set just before the worker starts"
    assert got["server_argv"] == "--port 30000"
