"""Every preset composes and validates; every validation rule fires on a config that breaks it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import CONF, ROOT, compose, resolved
from slime_hydra.config import ConfigError
from slime_hydra.launch.validate import check, validate


def presets(group):
    return sorted(p.stem for p in Path(CONF, group).glob("*.yaml"))


@pytest.mark.parametrize("model", presets("model"))
def test_model_presets_compose(model):
    """Presets for real models compose and validate (their hub ids are not downloaded here); on eight GPUs
    the data-parallel torch trainer, which keeps fp32 weights and Adam state on every GPU, fits up to
    Qwen3-4B: the larger presets are refused by the memory estimate alone."""
    extra = [] if model == "tiny" else ["data=jsonl", f"data.path={ROOT / 'tests/fixtures/tiny.jsonl'}",
                                        "eval.datasets=[]", "parallelism=colocate_8gpu", "rollout=sglang",
                                        "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=true"]
    problems = validate(resolved([f"model={model}", *extra]))
    if model not in ("tiny", "qwen3_0_6b", "qwen3_4b"):
        memory = ("parallelism: colocated GPU", "rollout.server_args.mem_fraction_static")
        assert problems and all(p.startswith(memory) and "GiB" in p for p in problems), problems
    else:
        assert problems == [], problems


@pytest.mark.parametrize("algo", presets("algo"))
def test_algo_presets_compose(algo):
    cfg = compose([f"algo={algo}"])
    assert cfg.algo.name == algo


@pytest.mark.parametrize("group", ["rollout", "parallelism", "data", "trainer", "reward", "eval", "logging"])
def test_group_presets_compose(group):
    for name in presets(group):
        assert compose([f"{group}={name}"])[group] is not None


@pytest.mark.parametrize("experiment", presets("experiment"))
def test_experiments_validate_with_their_data(experiment, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    cfg = resolved([f"experiment={experiment}", f"data.path={data}"])
    assert validate(cfg) == []


def test_readme_command_composes():
    cfg = compose(["model=qwen3_4b", "algo=grpo"])
    assert cfg.model.arch.hidden_size == 2560 and cfg.algo.name == "grpo"


def test_default_is_the_embedded_run():
    cfg = check(compose())
    assert (cfg.model.name, cfg.rollout.engine, cfg.parallelism.device, cfg.data.source) == (
        "tiny", "embedded", "cpu", "builtin")
    assert cfg.trainer.global_batch_size == 512 and cfg.trainer.num_steps_per_rollout == 1  # 32 prompts x 16
    assert cfg.algo.lr == 3e-3  # from conf/recipe/tiny_digits.yaml
    assert compose(["model=qwen3_4b"]).algo.lr == 1e-6  # the recipe applies to tiny+digits only


@pytest.mark.parametrize("override, where", [
    ("model.arch.hiden_size=3", "model.arch.hiden_size"),
    ("algo.learning_rate=1", "algo.learning_rate"),
    ("rollout.batchsize=3", "rollout.batchsize"),
    ("trainer.num_rollout=many", "trainer.num_rollout"),
])
def test_typos_fail_at_compose_with_the_dotted_path(override, where):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)) as e:
        compose([override])
    assert where.split(".")[-1] in str(e.value) + str(e.value.__cause__)


def test_keys_added_with_plus_must_exist():
    """Hydra's error for a typo says 'To append to your config use +key=value'; that adds the key, so validation
    refuses what the schema does not have (with the nearest keys), and lets free-form dicts take any key."""
    with pytest.raises(ConfigError) as e:
        check(compose(["+trainer.num_rolout=5", "+dry_runn=true"]))
    assert sorted(e.value.violations) == [
        "dry_runn: not a config key; did you mean dry_run? (`python -m slime_hydra.config describe` lists them)",
        "trainer.num_rolout: not a config key; did you mean trainer.num_rollout or trainer.num_steps_per_rollout? "
        "(`python -m slime_hydra.config describe trainer` lists them)"]
    with pytest.raises(ConfigError, match=r"eval.datasets\[0\].pathh: not a config key; did you mean "
                                          r"eval.datasets\[0\].path\?"):
        check(compose(["data=jsonl", "data.path=tests/fixtures/tiny.jsonl", "eval.datasets=[{name: a}]",
                       "+eval.datasets.0.pathh=x"]))
    check(compose(["+rollout.router.args.foo=1"]))  # a dict section: any key


def test_typo_in_a_yaml_file_names_the_key(tmp_path):
    bad = tmp_path / "conf"
    import shutil

    shutil.copytree(CONF, bad)
    (bad / "model" / "broken.yaml").write_text(
        "defaults:\n  - _schema\n  - _self_\nname: broken\narch:\n  hidden_sise: 4\n")
    from hydra import compose as hc, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(bad), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as e:
            hc("config", overrides=["model=broken"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "hidden_sise" in msg and "model" in msg


RULES = [
    (["rollout.batch_size=32", "rollout.n_samples_per_prompt=8",
      "trainer.global_batch_size=100", "trainer.num_steps_per_rollout=2"],
     "trainer.global_batch_size: rollout.batch_size x rollout.n_samples_per_prompt = 32 x 8 = 256"),
    (["parallelism=split_4_4", "model=qwen3_4b", "rollout=sglang", "parallelism.gpus_per_node=6"],
     "the plan needs 8 GPUs"),
    (["parallelism=colocate_8gpu", "model=qwen3_4b", "parallelism.tensor_parallel=3"],
     "parallelism.trainer_gpus: 8 is not divisible"),
    (["parallelism=split_4_4", "model=qwen3_4b", "rollout=sglang", "parallelism.offload_train=true"],
     "parallelism.offload_train: true needs parallelism.colocate=true"),
    (["parallelism.offload_rollout=true"], "parallelism.offload_rollout: true needs parallelism.colocate=true"),
    (["parallelism=split_4_4", "parallelism.gpus_per_engine=3"],
     "parallelism.rollout_gpus: 4 is not divisible by gpus_per_engine=3"),
    (["parallelism=colocate_8gpu", "parallelism.rollout_gpus=9", "parallelism.gpus_per_node=16"],
     "colocated engines must sit on trainer GPUs"),
    (["parallelism.tensor_parallel=3", "parallelism.trainer_gpus=3", "parallelism.gpus_per_node=4"],
     "must divide num_heads=4"),
    (["parallelism.pipeline_parallel=2", "parallelism.trainer_gpus=2"], "does not divide num_layers=3"),
    (["parallelism.expert_parallel=2"], "parallelism.expert_parallel: 2 must divide num_experts=0"),
    (["parallelism.sequence_parallel=true"], "sequence_parallel: needs tensor_parallel > 1"),
    (["parallelism.tensor_parallel=2", "parallelism.trainer_gpus=2"], "torch trainer backend is data-parallel only"),
    (["parallelism.device=tpu"], "parallelism.device: 'tpu' is not one of"),
    (["parallelism.trainer_gpus=0"], "parallelism.trainer_gpus: must be >= 1"),
    (["parallelism.trainer_gpus=3", "rollout.batch_size=5",
      "rollout.n_samples_per_prompt=2", "parallelism.gpus_per_node=4"],
     "trainer.global_batch_size: 10 is not divisible by the data-parallel size 3"),
    (["model.path=/does/not/exist"], "model.path: '/does/not/exist' is not a directory"),
    (["model.tokenizer=null"], "model.tokenizer: required when model.path is null"),
    (["model.arch.vocab_size=30"], "model.arch.vocab_size: 30 != 24"),
    (["model.arch.num_kv_heads=3"], "num_heads=4 must be a multiple of num_kv_heads=3"),
    (["model.dtype=float8"], "model.dtype: 'float8' is not one of"),
    (["rollout.engine=sglang"], "rollout.engine: sglang needs parallelism.device=cuda"),
    (["rollout=sglang", "parallelism=1gpu", "model=qwen3_4b", "+rollout.server_args.tp_size=2"],
     "rollout.server_args.tp_size: set by slime_hydra"),
    (["rollout.temperature=0"], "rollout.temperature: must be > 0"),
    (["eval.interval=-1"], "eval.interval: must be >= 0, got -1"),
    (["trainer.save_interval=-1"], "trainer.save_interval: must be >= 0, got -1"),
    (["rollout.top_p=0"], "rollout.top_p: must be in (0, 1]"),
    (["rollout.top_p=0.95"], "rollout.top_p: 0.95 truncates training samples"),
    (["rollout.top_k=20"], "rollout.top_k: 20 truncates training samples"),
    (["rollout.max_response_len=64"], "rollout.max_response_len: 64 >= model.arch.max_position_embeddings=64, "
                                      "which leaves no room for the prompt; set rollout.max_response_len=32 or less"),
    (["rollout.router.policy=fastest"], "rollout.router.policy: 'fastest' is not one of"),
    (["rollout.over_sampling_batch_size=4"], "rollout.over_sampling_batch_size: 4 < rollout.batch_size=32"),
    (["rollout.partial_rollout=true"], "rollout.partial_rollout: recycles groups"),
    (["data.source=jsonl", "data.path=null"], "data.path: required for data.source=jsonl"),
    (["data=jsonl", "data.path=/nope.jsonl"], "data.path: '/nope.jsonl' does not exist"),
    (["data.task=sorting"], "data.task: 'sorting' is not one of"),
    (["data.task=calc"], "model.tokenizer: the built-in task calc is written in the builtin:calc vocabulary"),
    (["data=jsonl", "data.path=tests/fixtures/tiny.jsonl", "eval=digits"], "eval.datasets[0].path: required"),
    (["data.num_epoch=2"], "data.num_epoch: set only one of trainer.num_rollout and data.num_epoch"),
    (["trainer.num_rollout=null"], "trainer.num_rollout: set trainer.num_rollout or data.num_epoch"),
    (["trainer.warm_up=sometimes"], "trainer.warm_up: must be true, false or auto, got 'sometimes'"),
    (["eval.datasets=[{name: a},{name: a}]"], "eval.datasets: names must be unique"),
    (["eval.datasets=[{name: a, temperature: -1}]"], "eval.datasets[0].temperature: must be >= 0"),
    (["eval.datasets=[{name: a, path: /nope.jsonl}]"], "eval.datasets[0].path: '/nope.jsonl' does not exist"),
    (["trainer.mode=async", "parallelism=cpu_colocate", "parallelism.offload_train=true"],
     "parallelism.offload_train: true with trainer.mode=async on colocated GPUs"),
    (["trainer.mode=async", "parallelism=cpu_colocate", "parallelism.offload_rollout=true"],
     "parallelism.offload_rollout: true with trainer.mode=async on colocated GPUs"),
    (["sync.transport=tensor"], "sync.transport: 'tensor' shares memory"),
    (["trainer.update_weights_interval=2"], "trainer.update_weights_interval: > 1 only makes sense"),
    (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints: must be >= 1"),
    (["trainer.resume=/nope"], "trainer.resume: '/nope' is not a directory"),
    (["trainer.backend=jax"], "trainer.backend: 'jax' is not one of"),
    (["reward.type=remote"], "reward.url: required for reward.type=remote"),
    (["reward.type=custom"], "reward.custom: required for reward.type=custom"),
    (["logging.wandb_mode=cloud"], "logging.wandb_mode: 'cloud' is not one of"),
]


@pytest.mark.parametrize("overrides, expected", RULES, ids=[r[1][:40] for r in RULES])
def test_each_rule_fires(overrides, expected):
    os.chdir(ROOT)
    errs = validate(resolved(overrides))
    assert any(expected in e for e in errs), errs


def test_all_violations_are_reported_together():
    with pytest.raises(ConfigError) as e:
        check(compose(["rollout.temperature=0", "trainer.keep_checkpoints=0", "model.dtype=int4"]))
    assert len(e.value.violations) == 3
    assert "3 problems" in str(e.value)


def test_missing_required_value_is_reported():
    with pytest.raises(ConfigError, match=r"data.path: required for data.source=jsonl"):
        check(compose(["data=jsonl"]))
    with pytest.raises(ConfigError, match=r"parallelism.name: required value is missing"):
        check(compose(["parallelism.name=???"]))


def test_hf_config_mismatch_is_reported(tiny_ckpt):
    errs = validate(resolved([f"model.path={tiny_ckpt}", "model.arch.hidden_size=128", "model.arch.head_dim=32"]))
    assert any("model.arch.hidden_size: 128 but" in e and "config.json says hidden_size=64" in e for e in errs), errs


def test_every_registered_name_resolves():
    """Each registry entry imports to a function: a typo in a "module:function" target fails here, not in a run."""
    from slime_hydra.rewards import REWARD_TYPES
    from slime_hydra.train import algorithms as A

    for registry in (A.ADVANTAGE_ESTIMATORS, A.POLICY_LOSSES, A.KL_ESTIMATORS, REWARD_TYPES):
        for name in registry:
            assert callable(registry[name]), (registry.kind, name, registry.target(name))
    assert set(A.GROUP_REWARDS) == set(A.ADVANTAGE_ESTIMATORS)
    assert set(A.GROUP_REWARDS.values()) <= {None, "mean", "mean_std"}  # the modes rewards_for_estimator knows
    with pytest.raises(KeyError, match="unknown policy loss 'ppo'; expected one of"):
        A.POLICY_LOSSES["ppo"]


def test_dry_run_is_fast_and_starts_nothing():
    """CPU seconds, not wall-clock ones: a loaded machine (the test suite in parallel) stretched the
    wall time of this ~2 s dry run past any fixed limit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "run.py", "dry_run=true", "hydra.run.dir=/tmp/slime_hydra_dry"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr
    assert "Resource plan" in out.stdout and "trainer 0" in out.stdout and "engine 0" in out.stdout
    assert cpu < 3.0, f"dry run took {cpu:.2f} CPU seconds"


@pytest.mark.integration
def test_dry_run_imports_no_torch():
    """Validation reads the registries' names without importing what they name (torch alone takes over a second)."""
    code = ("import runpy, sys\n"
            "sys.argv = ['run.py', 'dry_run=true', 'hydra.run.dir=/tmp/slime_hydra_dry']\n"
            "try:\n    runpy.run_path('run.py', run_name='__main__')\n"
            "finally:\n    print('HEAVY', sorted(m for m in ('torch', 'transformers', 'ray', 'httpx', 'math_verify') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_invalid_config_exits_2_with_all_problems():
    out = subprocess.run([sys.executable, "run.py", "rollout.temperature=0", "trainer.keep_checkpoints=0",
                          "hydra.run.dir=/tmp/slime_hydra_bad"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "rollout.temperature" in out.stderr and "trainer.keep_checkpoints" in out.stderr


def test_the_logprob_gap_guard_is_on_by_default_with_a_limit_for_the_dtype():
    assert resolved(["model=qwen3_4b", "model.dtype=bfloat16"]).sync.max_logprob_diff == 0.05
    assert resolved(["model=qwen3_4b", "model.dtype=float32"]).sync.max_logprob_diff == 1e-3
    assert resolved(["model=qwen3_4b", "sync.max_logprob_diff=0.2"]).sync.max_logprob_diff == 0.2


def test_the_router_policy_routes_by_prefix_only_between_several_engines():
    assert resolved([]).rollout.router.policy == "round_robin"  # the default: one embedded engine
    assert resolved(["parallelism=colocate_8gpu", "rollout=sglang"]).rollout.router.policy == "cache_aware"
    assert resolved(["rollout.router.policy=random"]).rollout.router.policy == "random"


def test_async_on_colocated_slots_offloads_nothing_and_keeps_what_the_user_sets():
    """One-step off-policy on colocated slots trains while the next rollout generates: offload_train,
    offload_rollout and push_before_offload left unset resolve to false, on CPU slots (where a sync run takes
    the colocated choreography) and on a GPU (where the estimate would have the sync run's engine release its
    memory: the anchor workload, logits head, with SGLang keeping 0.7 of the H200; async then trains a smaller
    micro-batch beside it); the sync transport stays the tensor one."""
    for overrides in (["parallelism=cpu_colocate"],
                      ["model=qwen3_0_6b", "parallelism=1gpu", "rollout=sglang", "rollout.batch_size=8",
                       "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "trainer.fused_logprobs=false",
                       "data=jsonl", f"data.path={ROOT / 'tests/fixtures/prompts.jsonl'}"]):
        sync = resolved(overrides).parallelism
        assert sync.offload_rollout is True  # what the sync loop takes on these slots
        cfg = resolved([*overrides, "trainer.mode=async"])
        p = cfg.parallelism
        assert (p.offload_train, p.offload_rollout, p.push_before_offload) == (False, False, False)
        assert cfg.sync.transport == "tensor"
        assert validate(cfg) == []
    kept = resolved(["parallelism=cpu_colocate", "trainer.mode=async", "parallelism.offload_train=true"])
    assert (kept.parallelism.offload_train, kept.parallelism.offload_rollout) == (True, False)
    (problem,) = validate(kept)
    assert problem.startswith("parallelism.offload_train: true with trainer.mode=async on colocated GPUs")
    assert "set parallelism.offload_train=false" in problem and "parallelism.colocate=false" in problem


def test_warm_up_is_on_for_gpus_that_do_not_offload():
    """``trainer.warm_up=auto``: a trainer's first step on a GPU pays for CUDA's set-up and compiles, which the
    warm-up moves into the engines' start; on CPU slots it would only slow the start-up, and on a colocated GPU
    that offloads its gradients would sit beside the whole engine, uncounted."""
    assert resolved([]).trainer.warm_up is False
    gpu = resolved(["parallelism=1gpu"])
    assert (gpu.parallelism.offload_train, gpu.parallelism.offload_rollout, gpu.trainer.warm_up) == (False, False, True)
    assert resolved(["parallelism=1gpu", "parallelism.offload_rollout=true"]).trainer.warm_up is False
    assert resolved(["parallelism=split_4_4", "trainer=megatron"]).trainer.warm_up is True
    assert resolved(["trainer.warm_up=true"]).trainer.warm_up is True


def test_warm_up_runs_the_steps_shape():
    """The warm-up's rows are a rank's share of a step, each as long as the memory plan counts a sample: a compiled
    graph specialises to the range of sizes it first saw (H200: 14.2 s compiling again in step 1 after a warm-up on
    two short rows), and the plan already counts this much beside the engines."""
    from types import SimpleNamespace

    from slime_hydra.launch.parts import warm_up_shape
    from slime_hydra.train.backend import WarmUpShape

    cfg = resolved(["parallelism=1gpu", "rollout.batch_size=8", "rollout.n_samples_per_prompt=8",
                    "rollout.max_prompt_len=64", "rollout.max_response_len=256"])
    assert warm_up_shape(cfg, SimpleNamespace(data_parallel=1)) == WarmUpShape(64, 320, 256)
    assert warm_up_shape(cfg, SimpleNamespace(data_parallel=4)).samples == 16
    packed = resolved(["parallelism=1gpu", "trainer=megatron", "trainer.max_tokens_per_micro_batch=200",
                       "rollout.max_prompt_len=64", "rollout.max_response_len=256"])
    shape = warm_up_shape(packed, SimpleNamespace(data_parallel=1))
    assert (shape.length, shape.response_len) == (200, 199)  # within megatron's packed budget


BROKEN_YAML = "# @package _global_\ntrainer:\n  num_rollout: [1, 2\nalgo: {lr: 1}\n"


@pytest.mark.parametrize("multirun", [False, True])
def test_yaml_syntax_error_in_an_experiment_is_one_line_naming_file_line_and_column(tmp_path, multirun):
    """Hydra's own report of a YAML syntax error was a 95-line traceback (config/store.py wraps it)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(BROKEN_YAML)
    out = subprocess.run([sys.executable, "run.py", "--config-dir", str(tmp_path), *(["-m"] if multirun else []),
                          "experiment=mine", "dry_run=true", f"hydra.run.dir={tmp_path}/run",
                          f"hydra.sweep.dir={tmp_path}/sweep"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"{tmp_path}/experiment/mine.yaml:4:5: not valid YAML: expected ',' or ']', but got ':' " \
           "(while parsing a flow sequence that started at line 3, column 16)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) < 6, out.stderr


def test_describe_reports_a_yaml_syntax_error_in_one_line(tmp_path, monkeypatch):
    from slime_hydra.config import describe

    bad = tmp_path / "conf"
    import shutil

    shutil.copytree(CONF, bad)
    (bad / "experiment" / "mine.yaml").write_text(BROKEN_YAML)
    monkeypatch.setattr(describe, "CONF_DIR", bad)
    with pytest.raises(ConfigCompositionException, match=r"experiment/mine.yaml:4:5: not valid YAML"):
        describe.compose(["experiment=mine"])


def test_an_experiment_without_its_package_header_is_said_so(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("trainer:\n  num_rollout: 1\n")
    from hydra import compose as hc, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from slime_hydra.config.store import register_configs

    register_configs()
    register_configs()  # idempotent: wrapped once
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match=r"experiment/mine.yaml: the first line "
                                                             r"`# @package _global_` is missing"):
            hc("config", overrides=["experiment=mine", f"hydra.searchpath=[file://{tmp_path}]"])
    GlobalHydra.instance().clear()
