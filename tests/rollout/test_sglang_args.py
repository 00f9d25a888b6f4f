"""SGLang server command lines, checked by sglang's own ServerArgs parser.

SGLang cannot run on the CPU machines, but its argument parser can: the ``sglang`` fixture installs it once
into ``.cache/sglang-parser`` (tests/sglang_parser/install.py: sglang 0.5.17, the version the project pins
for GPUs, with --no-deps, the small packages its server_args imports, stand-ins for triton and torchvision)
and imports it in a worker process. The tests are skipped only when the package index cannot be reached;
any other installation failure fails them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

import pytest
import yaml

from conftest import CONF, resolved
from sglang_parser import start_parser
from slime_hydra.plan.resources import make_plan
from slime_hydra.rollout.engines import ServerSpec, server_command, to_flags
from slime_hydra.rollout.engines.sglang.args import MANAGED_SERVER_ARGS
from slime_hydra.rollout.engines.sglang.engine import SglangEngine
from slime_hydra.rollout.engines.sglang.launch import (
    CAPPED_MEM_FRACTION,
    DECODE_GRAPH_KEYS,
    PREFILL_GRAPH_KEYS,
    SGLANG_DEFAULT_DECODE_MAX_BS,
    decode_graph_max_bs,
    decode_graph_sizes,
)
from slime_hydra.rollout.fleet import engine_specs


@pytest.fixture(scope="module")
def sglang():
    parser = start_parser()
    yield parser
    parser.close()


# ------------------------------------------------------------------------ the shipped combinations
def _yaml(group: str):
    for f in sorted(Path(CONF, group).glob("*.yaml")):
        yield f.stem, yaml.safe_load(f.read_text()) or {}


CUDA_PARALLELISM = [name for name, y in _yaml("parallelism") if y.get("device") == "cuda"]
HUB_MODELS = [name for name, y in _yaml("model") if y.get("path")]
SGLANG_EXPERIMENTS = [name for name, y in _yaml("experiment")
                      if any(isinstance(d, dict) and d.get("override /rollout") == "sglang"
                             for d in y.get("defaults", []))
                      or (y.get("rollout") or {}).get("engine") == "sglang"]
COMBOS = ([["rollout=sglang", f"parallelism={p}", "model=qwen3_4b"] for p in CUDA_PARALLELISM]
          + [["rollout=sglang", "parallelism=colocate_8gpu", f"model={m}"] for m in HUB_MODELS if m != "qwen3_4b"]
          + [[f"experiment={e}"] for e in SGLANG_EXPERIMENTS])


def test_shipped_combinations_are_found():
    assert {"1gpu", "colocate_8gpu", "split_4_4"} <= set(CUDA_PARALLELISM)
    assert "qwen3_4b_grpo_math" in SGLANG_EXPERIMENTS


def engine_commands(overrides: List[str]) -> List[List[str]]:
    """Every engine's command line, built as EngineFleet.start and EngineActor.start build it."""
    cfg = resolved(overrides)
    plan = make_plan(cfg)
    assert cfg.rollout.engine == "sglang" and plan.device == "cuda"
    model_path = cfg.model.path  # model.hf.initial_checkpoint, for a hub id or a local checkpoint
    cmds = []
    for slot, node_specs in zip(plan.engines, engine_specs(cfg, plan, model_path)):
        cmds.append(server_command(node_specs[0], "10.0.0.1", 30000 + slot.rank, slot.lead % plan.gpus_per_node,
                                   nccl_port=31000 + slot.rank))
    assert cmds, overrides
    return cmds


@pytest.mark.parametrize("overrides", COMBOS, ids=[" ".join(c) for c in COMBOS])
def test_shipped_engine_command_lines_parse(sglang, overrides):
    cfg = resolved(overrides)
    for cmd in engine_commands(overrides):
        # SGLang's launch_server, its workers forked (rollout.sglang_fast_start): its flags, unchanged
        assert cmd[:3] == [sys.executable, "-m", "slime_hydra.rollout.engines.sglang.fast_start"]
        assert sglang.check(cmd[3:]) is None, cmd
        got = sglang.parse(cmd[3:], ["model_path", "tp_size", "enable_memory_saver", "trust_remote_code", "dtype",
                                     "skip_server_warmup", "max_total_tokens", *cfg.rollout.server_args])
        assert got["model_path"] == cfg.model.path
        assert got["tp_size"] == cfg.parallelism.gpus_per_engine
        assert got["enable_memory_saver"] == bool(cfg.parallelism.offload_rollout)
        assert got["trust_remote_code"] == cfg.model.trust_remote_code
        assert got["skip_server_warmup"] is True
        assert got["dtype"] == cfg.model.dtype  # float32 included: "auto" would serve a bf16 checkpoint in bf16
        for key, value in cfg.rollout.server_args.items():
            # colocated, the KV pool held to the plan's count, SGLang starts with a fraction that reaches it
            raised = key == "mem_fraction_static" and got["max_total_tokens"] is not None \
                and not got["enable_memory_saver"]
            assert got[key] == (max(float(value), CAPPED_MEM_FRACTION) if raised else value), key
    # and the config's own validation, with the parser importable, finds nothing in rollout.server_args
    assert [e for e in sglang.validate(overrides) if e.startswith("rollout.server_args")] == []


def test_multi_node_engine_command_parses(sglang):
    spec = ServerSpec(engine="sglang", model_path="deepseek-ai/DeepSeek-V3", tokenizer_path="deepseek-ai/DeepSeek-V3",
                      dtype="bfloat16", device="cuda", gpus=16, seed=1, trust_remote_code=True, nnodes=2, node_rank=1,
                      dist_init_addr="10.0.0.1:20000")
    argv = server_command(spec, "10.0.0.2", 30000, 0, nccl_port=31000)[3:]
    assert sglang.check(argv) is None
    assert sglang.parse(argv, ["tp_size", "nnodes", "node_rank", "dist_init_addr"]) == {
        "tp_size": 16, "nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:20000"}


def test_a_float32_server_runs_the_transformers_implementation_in_ieee_float32(sglang):
    """sglang 0.5.17's native kernels have no float32 RMSNorm: a float32 server gets ``--model-impl transformers``
    and Triton's IEEE float32, and parses; ``rollout.server_args`` and the environment keep the last word."""
    from slime_hydra.rollout.engines import make_engine

    def engine(dtype, **server_args):
        return make_engine(ServerSpec(engine="sglang", model_path="/ckpt", tokenizer_path="/ckpt", dtype=dtype,
                                      device="cuda", gpus=1, seed=0, server_args=server_args))

    fp32 = engine("float32")
    argv = fp32.command("127.0.0.1", 30000, 0, nccl_port=31000)[3:]
    assert sglang.check(argv) is None
    assert sglang.parse(argv, ["dtype", "model_impl"]) == {"dtype": "float32", "model_impl": "transformers"}
    assert fp32.env()["TRITON_F32_DEFAULT"] == "ieee"
    bf16 = engine("bfloat16")
    assert "--model-impl" not in bf16.command("127.0.0.1", 30000, 0) and "TRITON_F32_DEFAULT" not in bf16.env()
    assert sglang.parse(engine("float32", model_impl="sglang").command("127.0.0.1", 30000, 0)[3:],
                        ["model_impl"]) == {"model_impl": "sglang"}


@pytest.mark.parametrize("override, message", [
    ("rollout.server_args.mem_fraction_static=abc", "argument --mem-fraction-static: invalid float value: 'abc'"),
    ("+rollout.server_args.no_such_option=1", "unrecognized arguments: --no-such-option 1"),
    # gone since sglang 0.4; argparse takes it for an abbreviation of two newer flags
    ("+rollout.server_args.disable_flashinfer=true",
     "ambiguous option: --disable-flashinfer could match --disable-flashinfer-autotune"),
    ("+rollout.server_args.attention_backend=warp_drive", "argument --attention-backend: invalid choice: 'warp_drive'"),
])
def test_sglang_rejects_bad_pass_through(sglang, override, message):
    (cmd, *_) = engine_commands(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", override])
    err = sglang.check(cmd[3:])
    assert err is not None and message in err, err


def test_managed_server_args_are_sglang_options(sglang):
    opts = sglang.options()
    for key in MANAGED_SERVER_ARGS:
        assert key in opts["fields"], f"{key} is not a ServerArgs field of sglang {sglang.info['version']}"
        assert key in opts["dests"], key
        assert to_flags({key: 1})[0] in opts["flags"], key


def test_embedded_engine_takes_sglang_flag_names(sglang):
    """The embedded engine's flags are SGLang's (but --num-threads, its own)."""
    spec = ServerSpec(engine="embedded", model_path="/ckpt", tokenizer_path="/ckpt", dtype="float32", device="cpu",
                      gpus=1, seed=0, trust_remote_code=True, num_threads=2, memory_saver=True)
    cmd = server_command(spec, "127.0.0.1", 30000)
    assert "--enable-memory-saver" in cmd
    i = cmd.index("--num-threads")
    assert sglang.check(cmd[3:i] + cmd[i + 2:]) is None


@pytest.mark.parametrize("override, expected", [
    ("rollout.server_args.mem_fraction_static=abc",
     "rollout.server_args.mem_fraction_static: argument --mem-fraction-static: invalid float value: 'abc' "
     "(sglang 0.5.17)"),
    ("+rollout.server_args.disable_flashinfer=true",
     "rollout.server_args.disable_flashinfer: not a ServerArgs option of sglang 0.5.17 (no --disable-flashinfer); "
     "did you mean disable_flashinfer_autotune?"),
    ("+rollout.server_args.cuda_graph_max_bs_decoding=64",
     "rollout.server_args.cuda_graph_max_bs_decoding: not a ServerArgs option of sglang 0.5.17 "
     "(no --cuda-graph-max-bs-decoding); did you mean cuda_graph_max_bs_decode"),
    ("+rollout.server_args.kv_cache_dtype=fp7",
     "rollout.server_args.kv_cache_dtype: argument --kv-cache-dtype: invalid choice: 'fp7'"),
    ("+rollout.server_args.tensor_parallel_size=2",
     "rollout.server_args.tensor_parallel_size: --tensor-parallel-size is sglang's alias of tp_size, set by "
     "slime_hydra"),
    ("+rollout.server_args.dllm_fdfo=false",
     "rollout.server_args.dllm_fdfo: false is left off the command line, which keeps sglang's default (True); "
     "write no_dllm_fdfo: true for --no-dllm-fdfo"),
    ("+rollout.server_args.context_length=false",
     "rollout.server_args.context_length: false is left off the command line"),
    ("+rollout.server_args.disable_radix_cache=1",
     "rollout.server_args.disable_radix_cache: unrecognized arguments: 1"),
    # accepted
    ("+rollout.server_args.no_dllm_fdfo=true", None),
    ("+rollout.server_args.enable_tf32_matmul=false", None),
    ("+rollout.server_args.disable_radix_cache=false", None),
    ("+rollout.server_args.cuda_graph_bs_decode=[1,2,4,8]", None),
    ("+rollout.server_args.cuda_graph_max_bs=64", None),  # 0.5.17: a deprecated alias of cuda_graph_max_bs_decode
    ("+rollout.server_args.disable_prefill_cuda_graph=false", None),
    ("+rollout.server_args.context_length=32k", None),
    ("+rollout.server_args.json_model_override_args={rope_theta: 10000}", None),
])
def test_validation_checks_server_args_with_sglang(sglang, override, expected):
    errs = [e for e in sglang.validate(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", override])
            if e.startswith("rollout.server_args")]
    if expected is None:
        assert errs == []
    else:
        assert len(errs) == 1 and errs[0].startswith(expected), errs


def test_validation_reports_managed_keys_once(sglang):
    errs = sglang.validate(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", "+rollout.server_args.tp_size=2"])
    assert [e for e in errs if e.startswith("rollout.server_args")] == [
        "rollout.server_args.tp_size: set by slime_hydra from parallelism.gpus_per_engine; remove it"]


def test_validation_without_sglang_does_not_import_it():
    """Here sglang is not importable: validation skips the parser check and imports nothing heavy."""
    import importlib.util

    from slime_hydra.launch.validate import validate

    assert importlib.util.find_spec("sglang") is None
    errs = validate(resolved(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b",
                              "rollout.server_args.mem_fraction_static=abc"]))
    assert not [e for e in errs if e.startswith("rollout.server_args")]
    assert "sglang" not in sys.modules


def test_validation_in_the_driver_checks_in_a_child_process(sglang, monkeypatch):
    """The driver's case: sglang importable (here: the fixture's folder on sys.path) but not imported.
    The check runs in a child process, and this process gains neither sglang nor its environment variables."""
    from slime_hydra.launch.validate import validate

    monkeypatch.syspath_prepend(str(sglang.site))
    env = dict(os.environ)
    errs = validate(resolved(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b",
                              "rollout.server_args.mem_fraction_static=abc",
                              "+rollout.server_args.disable_radix_cache=true"]))
    assert [e for e in errs if e.startswith("rollout.server_args")] == [
        "rollout.server_args.mem_fraction_static: argument --mem-fraction-static: invalid float value: 'abc' "
        "(sglang 0.5.17)"]
    assert "sglang" not in sys.modules and "triton" not in sys.modules
    assert dict(os.environ) == env


def test_validation_needs_no_model_config(sglang):
    """Validation parses flags only: a model path that is a hub id (no network here) or a missing
    folder does not turn every server_args key into "couldn't connect to huggingface.co" (seen with
    sglang 0.5.17, whose ServerArgs constructor reads the model's config)."""
    for model in ("model=qwen3_4b", "model.path=/nonexistent/checkpoint"):
        errs = sglang.validate(["rollout=sglang", "parallelism=1gpu", "model=qwen3_0_6b", model,
                                "+rollout.server_args.attention_backend=triton",
                                "+rollout.server_args.sampling_backend=pytorch"])
        assert [e for e in errs if e.startswith("rollout.server_args")] == [], errs


def test_engines_turn_off_the_prefill_cuda_graph(sglang):
    """Colocated and split engines get --disable-prefill-cuda-graph unless server_args chooses a prefill
    graph itself (false included: SGLang's default then). Every key that counts as a choice is one of
    this sglang's flags."""
    flags = set(sglang.options()["flags"])
    assert {to_flags({key: 1})[0] for key in PREFILL_GRAPH_KEYS + DECODE_GRAPH_KEYS} <= flags
    for layout, saver in (("1gpu", True), ("split_4_4", False)):
        (cmd, *_) = engine_commands(["rollout=sglang", f"parallelism={layout}", "model=qwen3_4b"])
        assert sglang.parse(cmd[3:], ["enable_memory_saver", "disable_prefill_cuda_graph"]) == {
            "enable_memory_saver": saver, "disable_prefill_cuda_graph": True}, layout
    (chosen, *_) = engine_commands(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b",
                                    "+rollout.server_args.cuda_graph_backend_prefill=tc_piecewise"])
    assert sglang.parse(chosen[3:], ["disable_prefill_cuda_graph", "cuda_graph_backend_prefill"]) == {
        "disable_prefill_cuda_graph": False, "cuda_graph_backend_prefill": "tc_piecewise"}
    (kept, *_) = engine_commands(["rollout=sglang", "parallelism=split_4_4", "model=qwen3_4b",
                                  "+rollout.server_args.disable_prefill_cuda_graph=false"])
    assert sglang.parse(kept[3:], ["disable_prefill_cuda_graph"]) == {"disable_prefill_cuda_graph": False}


@pytest.mark.parametrize("overrides, max_bs", [
    (["rollout.batch_size=8"], 64),  # TRL's anchor: 8 prompts x 8 samples on one engine
    (["rollout.batch_size=5", "rollout.n_samples_per_prompt=4"], 24),  # 20 sequences: SGLang's next size
    (["rollout.batch_size=8", "rollout.concurrency=2"], 16),  # two group requests at once
    (["rollout.batch_size=8", "algo.dynamic_sampling=true"], 120),  # 8 + a refill of 8, less 1, groups
    (["rollout.batch_size=8", "parallelism=colocate_4gpu"], 32),  # two engines: four groups each
    (["rollout.batch_size=32"], None),  # 256 sequences: SGLang's own default
    (["rollout.batch_size=8", "+rollout.server_args.cuda_graph_max_bs_decode=32"], 32),  # the user's
    (["rollout.batch_size=8", "+rollout.server_args.cuda_graph_bs_decode=[1,8,64]"], None),
])
def test_decode_cuda_graphs_follow_the_engine_batch(sglang, overrides, max_bs):
    """Decode graphs up to what the run can send an engine at once (plan.engine_batch), on SGLang's own grid."""
    (cmd, *_) = engine_commands(["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", *overrides])
    assert sglang.parse(cmd[3:], ["cuda_graph_max_bs_decode"]) == {"cuda_graph_max_bs_decode": max_bs}


def test_a_shared_gpus_kv_pool_is_held_to_the_plan(sglang):
    """Colocated, the engine's KV pool is held to the memory estimate's tokens, and where the engine stays resident
    SGLang starts with a mem_fraction_static that reaches them (it sizes the pool from what the trainer leaves free
    as it starts, which a trainer warming up beside it moves); the user's fraction has set the count. With
    offload_rollout (the plan counts engine and trainer in different phases), on GPUs of its own, or with the user's
    own max_total_tokens, the user's fraction is sent as it is."""
    keys = ["max_total_tokens", "mem_fraction_static"]
    base = ["rollout=sglang", "model=qwen3_4b", "rollout.batch_size=8", "parallelism.offload_rollout=false"]
    cfg = resolved([*base, "parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.3"])
    planned = make_plan(cfg).memory.kv_cache_tokens
    assert planned and planned > 100_000
    assert planned < resolved_plan_tokens([*base, "parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.5"])

    def sent(*overrides):
        (cmd, *_) = engine_commands([*base, *overrides])
        return sglang.parse(cmd[3:], keys)

    assert sent("parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.3") == \
        {"max_total_tokens": planned, "mem_fraction_static": 0.9}
    assert sent("parallelism=1gpu", "rollout.server_args.mem_fraction_static='0.3'") == \
        {"max_total_tokens": planned, "mem_fraction_static": 0.9}  # a number in a string, as the plan reads it
    assert sent("parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.95")["mem_fraction_static"] == 0.95
    assert sent("parallelism=1gpu", "~rollout.server_args.mem_fraction_static")["mem_fraction_static"] == 0.9
    offload = sent("parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.3",
                   "parallelism.offload_rollout=true", "parallelism.offload_train=true")
    assert offload["mem_fraction_static"] == 0.3 and offload["max_total_tokens"]
    assert sent("parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.3",
                "+rollout.server_args.max_total_tokens=5000") == {"max_total_tokens": 5000, "mem_fraction_static": 0.3}
    assert sent("parallelism=split_4_4", "rollout.server_args.mem_fraction_static=0.3") == \
        {"max_total_tokens": None, "mem_fraction_static": 0.3}
    note = SglangEngine.plan_notes(cfg, make_plan(cfg))[0]
    assert note.endswith(f"; its KV cache held to {planned:,} tokens (the estimate's, the GPU being shared; SGLang "
                         "starts with mem_fraction_static=0.9 to reach it)"), note
    cfg = resolved([*base, "parallelism=1gpu", "rollout.server_args.mem_fraction_static=0.95"])
    assert SglangEngine.plan_notes(cfg, make_plan(cfg))[0].endswith("(the estimate's, the GPU being shared)")


def resolved_plan_tokens(overrides):
    return make_plan(resolved(overrides)).memory.kv_cache_tokens


def test_decode_graph_sizes_are_sglangs(sglang):
    for max_bs in (1, 8, 20, 64, 100, 256, 300, 600):
        assert decode_graph_sizes(max_bs) == sglang.decode_graph_sizes(max_bs), max_bs
    for batch in (1, 3, 13, 64, 65, 250):  # the rounding: the smallest captured size that holds the batch
        assert decode_graph_max_bs(batch) in sglang.decode_graph_sizes(256)
        assert decode_graph_max_bs(batch) >= batch
        assert all(b < batch for b in sglang.decode_graph_sizes(256) if b < decode_graph_max_bs(batch))
    assert len(sglang.decode_graph_sizes(SGLANG_DEFAULT_DECODE_MAX_BS)) == 36


def test_memory_saver_cuda_graph_is_off(monkeypatch):
    """torch_memory_saver pauses CUDA graphs only in its preload hook mode; SGLang asserts otherwise."""
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    spec = ServerSpec(engine="sglang", model_path="m", tokenizer_path="m", dtype="bfloat16", device="cuda", gpus=1,
                      seed=0, memory_saver=True)
    assert SglangEngine(spec).env()["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "false"
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true")  # the environment wins
    assert SglangEngine(spec).env()["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "true"


def test_the_driver_takes_the_parser_check_later(sglang, monkeypatch, tmp_path):
    """In a run (launch/main.py), validation leaves sglang's parser check running in its child process
    (config/deferred.py) and the driver takes its answer while Ray starts: the same problems. The
    answer is kept for the next run with the same arguments and the same sglang."""
    from slime_hydra.config.deferred import deferred_checks
    from slime_hydra.launch.validate import validate

    monkeypatch.syspath_prepend(str(sglang.site))
    monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path))
    overrides = ["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", "rollout.server_args.mem_fraction_static=abc"]
    with deferred_checks() as pending:
        errs = validate(resolved(overrides))
    assert not [e for e in errs if e.startswith("rollout.server_args")] and len(pending) == 1
    assert pending[0].proc is not None  # the parser ran in a child
    problem = ("rollout.server_args.mem_fraction_static: argument --mem-fraction-static: invalid float value: 'abc' "
               "(sglang 0.5.17)")
    assert pending[0].problems() == [problem]
    assert "sglang" not in sys.modules
    # the next run with the same arguments and the same sglang takes the kept answer: no child, nothing to wait for
    with deferred_checks() as again:
        validate(resolved(overrides))
    assert again[0].proc is None and again[0].problems() == [problem]
    with deferred_checks() as off:  # rollout.sglang_fast_start=false: answered within validation
        errs = validate(resolved([*overrides, "rollout.sglang_fast_start=false"]))
    assert off == [] and problem in errs
    with deferred_checks() as other:  # other arguments: the parser again
        validate(resolved([*overrides[:-1], "rollout.server_args.mem_fraction_static=0.5"]))
    assert other[0].proc is not None and other[0].problems() == []
    source = sglang.site / "sglang" / "srt" / "server_args.py"  # another sglang (here: the file changed)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1))
    try:
        with deferred_checks() as newer:
            validate(resolved(overrides))
        assert newer[0].proc is not None and newer[0].problems() == [problem]
    finally:
        os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns - 1))


def test_fast_start_starts_the_same_server_through_the_forking_launcher():
    overrides = list(COMBOS[0])
    plain, forking = engine_commands(overrides + ["rollout.sglang_fast_start=false"]), engine_commands(overrides)
    launcher = [sys.executable, "-m", "slime_hydra.rollout.engines.sglang.fast_start"]
    assert [c[:3] for c in forking] == [launcher] * len(plain)
    assert [c[3:] for c in forking] == [c[3:] for c in plain]  # the same flags: launch_server parses them
