"""SGLang's JIT kernels built beside the server's start (the kernel prebuild of rollout/engines/sglang/fast_start.py):
which kernels a model gets, that the pinned sglang has each loader so named, what a build reports, what the builder
does where it cannot build (no GPU here), and the engine actor running it beside a server's first start only. The
builds themselves need nvcc and a GPU."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from conftest import resolved
from sglang_parser import pinned_site
from slime_hydra.model.hf import hf_config
from slime_hydra.rollout.engines import ServerSpec
from slime_hydra.rollout.engines.embedded import EmbeddedEngine
from slime_hydra.rollout.engines.sglang.engine import FAST_START, SglangEngine
from slime_hydra.rollout.engines.sglang.fast_start import (
    Kernel,
    build,
    claim,
    kernels_for,
    load_module,
    model_config,
)


def config_of(model: str) -> dict:
    return hf_config(resolved([f"model={model}"]).model.arch).to_dict()


def calls(kernels) -> dict:
    return {k.name: k.args for k in kernels}


def test_qwen3_gets_the_kernels_sglang_built_on_the_h200():
    """The H200's caches after a first start of the Qwen3-0.6B shape named these builds: norm (FlashInfer),
    sgl_kernel_jit_activation_bf16_t_true, clamp_position_int64_t, kvcache_2048_2048_true (8 KV heads x 128 x 2
    bytes), fused_rope_true_128_true_bf16_t_bf16_t, qknorm_128_true_bf16_t (the "true"s after the first are PDL,
    which sglang adds on Hopper)."""
    assert calls(kernels_for(config_of("qwen3_0_6b"), "bfloat16", tp=1)) == {
        "flashinfer norm": (), "activation": ("bfloat16",), "clamp_position": ("int64",), "kvcache": (2048, 2048),
        "fused_rope": (True, 128, "bfloat16", "bfloat16"), "qknorm": (128, "bfloat16")}


def test_tensor_parallel_splits_the_kv_heads_and_replicates_past_them():
    qwen = config_of("qwen3_0_6b")  # 8 KV heads
    assert calls(kernels_for(qwen, "bfloat16", tp=2))["kvcache"] == (1024, 1024)
    assert calls(kernels_for(qwen, "bfloat16", tp=16))["kvcache"] == (256, 256)  # one head a GPU, replicated


def test_other_models_get_what_their_config_says():
    llama = calls(kernels_for(config_of("llama3_8b"), "bfloat16", tp=1))
    assert "qknorm" not in llama and llama["fused_rope"] == (True, 128, "bfloat16", "bfloat16")
    glm = calls(kernels_for(config_of("glm4_9b"), "bfloat16", tp=1))
    assert glm["fused_rope"] == (False, 64, "bfloat16", "bfloat16")  # half the head rotated, pairs interleaved
    assert glm["kvcache"] == (512, 512)  # 2 KV heads
    # a checkpoint's config.json as read from its folder (model_config): GLM-4-9B-0414's, published with the
    # rotary share at the top level, as transformers 4 wrote it
    published = {"model_type": "glm4", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
                 "head_dim": 128, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16"}
    assert calls(kernels_for(published, "auto", 1)) == calls(kernels_for(config_of("glm4_9b"), "bfloat16", 1))
    deepseek = calls(kernels_for(config_of("deepseek_v3"), "bfloat16", tp=8))
    assert sorted(deepseek) == ["activation", "clamp_position", "flashinfer norm"]  # latent attention: other kernels
    # "auto" takes the checkpoint's dtype; a dtype with no kernels here builds nothing
    assert calls(kernels_for({**config_of("qwen3_0_6b"), "torch_dtype": "float16"}, "auto", 1))["activation"] == \
        ("float16",)
    assert kernels_for({**config_of("qwen3_0_6b"), "torch_dtype": "int8"}, "auto", 1) == []
    # float32: SGLang serves a float32 checkpoint under "auto" in float16; a float32 server runs the transformers
    # implementation (rollout/engines/sglang/engine.py), not these kernels; a config without the heads' size keeps
    # the rest
    assert calls(kernels_for({**config_of("qwen3_0_6b"), "torch_dtype": "float32"}, "auto", 1))["kvcache"] == \
        (2048, 2048)
    assert kernels_for(config_of("qwen3_0_6b"), "float32", 1) == []
    assert sorted(calls(kernels_for({"num_attention_heads": 16}, "bfloat16", 1))) == \
        ["activation", "clamp_position", "flashinfer norm"]


def test_the_pinned_sglang_has_each_loader_with_those_arguments():
    """A loader renamed or re-argued in another sglang would make its build fail (the server then builds it
    itself, losing the time); the pinned one must have each, read from its source (it does not import here)."""
    site = pinned_site()
    for model, tp in (("qwen3_0_6b", 1), ("glm4_9b", 2)):
        for k in kernels_for(config_of(model), "bfloat16", tp):
            if not k.module.startswith("sglang."):
                continue  # FlashInfer is not installed on the CPU machines
            source = site.joinpath(*k.module.split(".")).with_suffix(".py")
            tree = ast.parse(source.read_text())
            fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == k.function), None)
            assert fn is not None, f"{source} has no {k.function}"
            positional = [a.arg for a in fn.args.args]
            assert len(positional) == len(k.args), (k, positional)


def test_a_build_reports_what_happened():
    t0 = time.monotonic()
    ok = build(Kernel("finfo", "torch", "finfo", ("bfloat16",)), since=t0)  # a dtype's name reaches it as torch's
    assert ok["status"] == "ok" and ok["args"] == ["bfloat16"]
    assert 0 <= ok["started_s"] <= ok["ended_s"] and ok["seconds"] == pytest.approx(ok["ended_s"] - ok["started_s"],
                                                                                    abs=0.02)
    missing = build(Kernel("gone", "sglang_no_such_module", "loader", (1,)))
    assert missing["status"].startswith("ModuleNotFoundError: No module named 'sglang_no_such_module'")
    # the modules are imported one after another first (threads importing sglang's at once deadlocked on the H200)
    assert load_module(Kernel("finfo", "torch", "finfo")) is None
    assert load_module(Kernel("gone", "sglang_no_such_module", "loader")).startswith("ModuleNotFoundError")


def test_one_prebuild_a_machine_builds_a_set_of_kernels(tmp_path, monkeypatch):
    """The engines of one node share a prebuild: the second to claim the same kernels for the same GPUs is told
    another holds them, until the first ends; other kernels are claimed on their own."""
    monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path / "cache"))
    qwen = kernels_for(config_of("qwen3_0_6b"), "bfloat16", 1)
    first = claim(qwen, [(9, 0)])
    assert first is not None and claim(qwen, [(9, 0)]) is None
    other = claim(kernels_for(config_of("qwen3_0_6b"), "bfloat16", 2), [(9, 0)])  # TP 2: other KV rows
    assert other is not None
    first.close()
    again = claim(qwen, [(9, 0)])
    assert again is not None
    again.close()
    other.close()


def test_a_folder_s_config_is_read_as_it_is(tiny_ckpt):
    with open(f"{tiny_ckpt}/config.json") as f:
        assert model_config(tiny_ckpt) == json.load(f)


def test_the_builder_without_a_gpu_builds_nothing_and_says_why(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config_of("qwen3_0_6b")))
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", FAST_START, "prebuild", "--model-path", str(model),
                          "--dtype", "bfloat16", "--report", str(report)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert json.loads(report.read_text()) == {"kernels": [], "seconds": 0.0, "skipped": "no GPU visible"}
    assert out.stdout == "no kernels built: no GPU visible\n"


def spec(**kw) -> ServerSpec:
    return ServerSpec(engine="sglang", model_path="/ckpt", tokenizer_path="/ckpt", dtype="bfloat16", device="cuda",
                      gpus=2, seed=1, fast_start=True, **kw)


def test_the_sglang_engine_prebuilds_on_gpus_when_asked():
    cmd = SglangEngine(spec()).prebuild_command("/logs/engine_0_prebuild.json")
    assert cmd == [sys.executable, "-m", FAST_START, "prebuild", "--model-path", "/ckpt", "--dtype", "bfloat16",
                   "--tp", "2", "--report", "/logs/engine_0_prebuild.json"]
    assert "--trust-remote-code" in SglangEngine(spec(trust_remote_code=True)).prebuild_command("r")
    assert SglangEngine(replace(spec(), fast_start=False)).prebuild_command("r") is None
    assert SglangEngine(replace(spec(), device="cpu")).prebuild_command("r") is None
    assert SglangEngine(replace(spec(), dtype="float32")).prebuild_command("r") is None  # the transformers model
    assert EmbeddedEngine(replace(spec(), engine="embedded")).prebuild_command("r") is None
    # the run config's switch reaches the engines' specs, on by default
    assert resolved(["rollout=sglang"]).rollout.sglang_fast_start is True


def test_the_engine_actor_runs_the_prebuild_beside_the_first_start_only(tiny_ckpt, tmp_path, monkeypatch):
    """A real embedded server, given a prebuild that writes its report after a moment: it runs beside the first
    start, not beside a restart (what it prepared is there), the start-up report carries its report, and a stop
    ends one still running."""
    from slime_hydra.rollout.engines.actor import EngineActor

    runs = tmp_path / "runs"
    script = (f"import json, os, sys, time; open({str(runs)!r}, 'a').write('x'); time.sleep(float(sys.argv[2])); "
              "json.dump({'kernels': [{'kernel': 'k'}], 'seconds': 0.5}, open(sys.argv[1], 'w'))")
    delay = {"s": "0.5"}
    monkeypatch.setattr(EmbeddedEngine, "prebuild_command",
                        lambda self, report: [sys.executable, "-c", script, report, delay["s"]], raising=False)
    server = ServerSpec(engine="embedded", model_path=tiny_ckpt, tokenizer_path=tiny_ckpt, dtype="float32",
                        device="cpu", gpus=1, seed=1, num_threads=1)
    (tmp_path / "logs").mkdir()
    actor = EngineActor(server, rank=0, log_dir=str(tmp_path / "logs"), startup_timeout=120)
    try:
        actor.start()
        deadline = time.monotonic() + 30
        while actor.prebuild.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert actor.prebuild.poll() == 0, "the prebuild did not end within 30 s"
        assert open(actor.prebuild_log).read().startswith(f"$ {sys.executable} -c ")  # its command, as a server's
        assert actor.startup_report()["prebuild"] == {"kernels": [{"kernel": "k"}], "seconds": 0.5}
        actor.start()  # a restart (fault tolerance): the server again, the prebuild not
        assert runs.read_text() == "x"
    finally:
        actor.stop()
    # a prebuild still running at the stop is ended with the server, and an older run's report in the same folder
    # (a resumed run) is not taken for its own
    delay["s"] = "60"
    actor = EngineActor(server, rank=1, log_dir=str(tmp_path / "logs"), startup_timeout=120)
    with open(actor.prebuild_report, "w") as f:
        json.dump({"kernels": [{"kernel": "an older run's"}], "seconds": 1.0}, f)
    try:
        actor.start()
    finally:
        actor.stop()
    assert actor.prebuild.poll() is not None and "prebuild" not in actor.startup_report()
