"""Servers listen on 127.0.0.1 on a one-machine cluster, and secrets from the environment (API keys,
tokens) are written nowhere in the run directory: config.yaml, logs, wandb's files, checkpoints."""

from __future__ import annotations

import pytest

from runs import ENV, run
from slime_hydra.logging.secrets import REDACTED, redact, redact_argv, secret_values

SECRETS = {"HF_TOKEN": "hf_not_a_real_token_9f8e7d", "MY_SERVICE_API_KEY": "sk-not-a-real-key-123456",
           "DB_PASSWORD": "pw-not-real-0042"}


def test_secret_names_values_and_flags_are_redacted(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set(secret_values()) >= set(SECRETS.values()) and "1" not in secret_values()
    tree = {"cluster": {"env_vars": {"HF_TOKEN": "x-literal", "PATH": "/usr/bin"}},
            "rollout": {"server_args": {"api_key": "abc", "mem_fraction_static": 0.7, "max_new_tokens": 5}},
            "note": f"token is {SECRETS['HF_TOKEN']}", "list": [SECRETS["DB_PASSWORD"], 3]}
    assert redact(tree) == {"cluster": {"env_vars": {"HF_TOKEN": REDACTED, "PATH": "/usr/bin"}},
                            "rollout": {"server_args": {"api_key": REDACTED, "mem_fraction_static": 0.7,
                                                        "max_new_tokens": 5}},
                            "note": f"token is {REDACTED}", "list": [REDACTED, 3]}
    cmd = ["python", "-m", "sglang.launch_server", "--api-key", "abc", "--admin-api-key=def", "--port", "3000",
           f"--served-model-name={SECRETS['MY_SERVICE_API_KEY']}"]
    assert redact_argv(cmd) == ["python", "-m", "sglang.launch_server", "--api-key", REDACTED,
                                f"--admin-api-key={REDACTED}", "--port", "3000", f"--served-model-name={REDACTED}"]


@pytest.mark.integration
def test_a_run_writes_no_secret_and_binds_loopback(tmp_path, monkeypatch):
    d = tmp_path / "run"
    env = {**ENV, **SECRETS}
    monkeypatch.setattr("runs.ENV", env)
    run(d, "trainer.num_rollout=1", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "eval.interval=0",
        "eval.before_train=false", "logging.progress=false", "logging.wandb_mode=offline",
        "+cluster.env_vars.HF_TOKEN=${oc.env:HF_TOKEN}",
        "+cluster.env_vars.MY_SERVICE_API_KEY=${oc.env:MY_SERVICE_API_KEY}")
    files = [p for p in d.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name == "trainer.pt" for p in files) and any(".wandb" in p.name for p in files)
    for p in files:
        data = p.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name}'s value is in {p}"
    assert "HF_TOKEN: " + REDACTED in (d / "config.yaml").read_text()
    engine_cmd = (d / "logs" / "engine_0.log").read_text().splitlines()[0]
    assert "--host 127.0.0.1 " in engine_cmd, engine_cmd
