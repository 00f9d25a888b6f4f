"""Engine backends (slime_hydra/rollout/engines): the registry names every engine without
importing it, every name is an ``Engine`` subclass and every ``conf/rollout`` preset names one, and
each class sets its server's environment. (Command lines are checked against sglang's own parser in
test_sglang_args.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import CONF, ROOT
from slime_hydra.rollout.engines import ENGINES, Engine, ServerSpec, engine_class, make_engine
from slime_hydra.rollout.engines.sglang.engine import FLOAT32_ENV, SGLANG_ENV


def spec(engine: str, device: str = "cpu") -> ServerSpec:
    return ServerSpec(engine=engine, model_path="/ckpt", tokenizer_path="/ckpt", dtype="float32", device=device,
                      gpus=1, seed=0)


def test_registry_imports_no_engine_until_asked():
    code = ("import sys, json, slime_hydra.rollout.engines as e\n"
            "print(json.dumps([sorted(e.ENGINES), sorted(m for m in sys.modules if m.startswith(e.__name__ + '.'))]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    names, loaded = json.loads(out.stdout)
    assert names == ["embedded", "sglang"] and loaded == ["slime_hydra.rollout.engines.base"]


def test_every_name_is_an_engine_and_every_preset_names_one():
    for name in ENGINES:
        assert issubclass(engine_class(name), Engine) and type(make_engine(spec(name))) is engine_class(name)
    presets = {f.stem: yaml.safe_load(f.read_text()).get("engine") for f in Path(CONF, "rollout").glob("*.yaml")}
    assert presets and all(engine in ENGINES for engine in presets.values()), presets
    with pytest.raises(ValueError, match=r"rollout.engine: 'vllm' is not one of \['embedded', 'sglang'\]"):
        engine_class("vllm")


def test_server_environment(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert make_engine(spec("embedded")).env() == {}
    assert make_engine(spec("embedded", "cuda")).env() == {"NCCL_CUMEM_ENABLE": "0"}
    assert make_engine(spec("embedded")).unset_env == ()
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "true")  # set by the user: wins
    sglang = make_engine(spec("sglang", "cuda"))
    # this spec's float32 adds FLOAT32_ENV (sglang 0.5.17 has no float32 rmsnorm kernel: the engine module says why)
    assert sglang.env() == {**SGLANG_ENV, **FLOAT32_ENV, "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "true"}
    assert sglang.unset_env == ("PYTORCH_CUDA_ALLOC_CONF",)
