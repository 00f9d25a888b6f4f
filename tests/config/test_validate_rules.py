"""Validation rules for engines, nodes, the built-in task size, resume, and what must load before Ray starts
(user hooks, dataset rows): each fires on a config that breaks it, with its dotted key, and not on one that keeps it."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, compose, resolved
from slime_hydra.config import ConfigError
from slime_hydra.launch.validate import check, validate

TINY = ROOT / "tests/fixtures/tiny.jsonl"
FILE_DATA = ["data=jsonl", f"data.path={TINY}", "eval.datasets=[]"]
# the Qwen3-4B trainer fits an H200 with one sample per micro-batch and gradient checkpointing (plan/memory.py)
FITS = ["trainer.micro_batch_size=1", "trainer.gradient_checkpointing=true"]
SGLANG_SPLIT = ["model=qwen3_4b", "rollout=sglang", "parallelism=split_4_4", *FILE_DATA, *FITS]
SGLANG_COLOCATED = ["model=qwen3_4b", "rollout=sglang", "parallelism=colocate_8gpu", *FILE_DATA, *FITS]
TINY_FILE_DATA = ["data=jsonl", "rollout.max_response_len=8"]  # the tiny model on your data (64 positions)


def errors(overrides):
    os.chdir(ROOT)
    return validate(resolved(overrides))


def fires(overrides, needle):
    errs = errors(overrides)
    return any(needle in e for e in errs)


RULES = [
    # 1. the embedded engine is one process on one device
    (["parallelism=split_4_4", "parallelism.gpus_per_engine=2"],
     "parallelism.gpus_per_engine: must be 1 for rollout.engine=embedded (it has no tensor parallelism), got 2"),
    # 2. at least one rollout slot and one engine
    (["parallelism.rollout_gpus=0"], "parallelism.rollout_gpus: must be >= 1, got 0"),
    ([*SGLANG_SPLIT, "parallelism.rollout_gpus=1", "parallelism.gpus_per_engine=2"],
     "parallelism.rollout_gpus: 1 < gpus_per_engine=2 gives 0 rollout engines"),
    # 3. without the router the manager has one URL
    ([*SGLANG_SPLIT, "rollout.router.enabled=false"],
     "rollout.router.enabled: false needs exactly one engine (the rollout manager talks to one URL), but "
     "parallelism.rollout_gpus / gpus_per_engine = 4 / 1 = 4 engines"),
    # 4. disjoint train and held-out prompts from the task's prompt space (max_digit: 10**4)
    (["data.num_train=9800", "data.num_eval=256"],
     "data.num_train: data.num_train + data.num_eval = 9800 + 256 = 10056 must be <= 10000, the number of distinct "
     "max_digit prompts"),
    (["experiment=calculator_agent", "data.num_train=81000"], "must be <= 81000, the number of distinct calc prompts"),
    (["data.num_train=0"], "data.num_train: must be >= 1 (and data.num_eval >= 0), got 0 and 256"),
    # 5. several nodes need a Ray cluster to join
    ([*SGLANG_SPLIT, "parallelism.num_nodes=2"], "cluster.address: required for parallelism.num_nodes=2"),
    # 7. tensor handles (CUDA IPC) stay on one node; 'auto' is 'tensor' when colocated
    ([*SGLANG_COLOCATED, "parallelism.num_nodes=2", "cluster.address=auto"],
     "sync.transport: 'tensor' (the colocated default) hands the engines CUDA IPC / shared-memory handles, which "
     "cannot cross nodes, but parallelism.num_nodes=2"),
    ([*SGLANG_COLOCATED, "parallelism.num_nodes=2", "cluster.address=auto", "sync.transport=tensor"],
     "sync.transport: 'tensor'"),
    # 10. model-parallel sizes are counts; an eval dataset's own reward type is a registered one
    (["parallelism.tensor_parallel=0"], "parallelism.tensor_parallel: must be >= 1, got 0"),
    (["eval.datasets=[{name: a, reward: nope}]"],
     "eval.datasets[0].reward: 'nope' is not one of ['exact', 'math', 'f1', 'remote', 'custom']"),
    # 11. the preemption signal is one a scheduler sends ahead, named without SIG; the grace is positive
    (["trainer.preempt_signal=SIGUSR1"], "trainer.preempt_signal: one of TERM, USR1, USR2, HUP, XCPU"),
    (["trainer.preempt_grace_s=0"], "trainer.preempt_grace_s: must be > 0, got 0"),
]


@pytest.mark.parametrize("overrides, expected", RULES, ids=[r[1][:50] for r in RULES])
def test_each_rule_fires(overrides, expected):
    assert fires(overrides, expected), errors(overrides)


@pytest.mark.parametrize("overrides", [
    [*SGLANG_SPLIT, "parallelism.gpus_per_engine=2", "parallelism.rollout_gpus=4"],  # SGLang engines can span GPUs
    ["rollout.router.enabled=false"],  # the default has one engine
    ["data.num_train=9744", "data.num_eval=256"],  # exactly the whole prompt space
    [*SGLANG_SPLIT, "parallelism.num_nodes=2", "cluster.address=auto"],  # split: weights go over NCCL
    [*SGLANG_COLOCATED, "parallelism.num_nodes=2", "cluster.address=auto", "sync.transport=disk"],
    ["trainer.resume=auto"],
])
def test_configs_that_keep_the_rules_are_valid(overrides):
    assert errors(overrides) == []


# ---------------------------------------------------------------------------------------- 6. resume
def _save(run_dir, step):
    from slime_hydra.checkpoint.ckpt import save_checkpoint

    return save_checkpoint(str(run_dir), step, lambda d: None, {"epoch": 0}, keep=2)


def test_resume_needs_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    errs = errors([f"trainer.resume={empty}"])
    assert any(e.startswith(f"trainer.resume: {str(empty)!r} holds no checkpoint") for e in errs), errs

    run = tmp_path / "run"
    ckpt = _save(run, 5)
    assert errors([f"trainer.resume={run}"]) == []  # a run directory: its checkpoints/latest
    assert errors([f"trainer.resume={ckpt}"]) == []  # a checkpoint directory

    os.remove(os.path.join(ckpt, "meta.json"))  # checkpoints/latest names a checkpoint that is gone
    errs = errors([f"trainer.resume={run}"])
    assert any(e.startswith(f"trainer.resume: {str(run)!r} names {ckpt!r}") and "no meta.json" in e for e in errs), errs


def test_resume_past_num_rollout_is_refused(tmp_path):
    run = tmp_path / "run"
    _save(run, 4)
    needle = f"trainer.num_rollout: 2 is below step 4 of the checkpoint that trainer.resume={str(run)!r} resumes"
    assert fires([f"trainer.resume={run}", "trainer.num_rollout=2"], needle)
    assert errors([f"trainer.resume={run}", "trainer.num_rollout=4"]) == []  # a finished run: nothing left to do
    # auto: the checkpoint in the run directory, known once the run starts (launch/main.py sets output_dir)
    cfg = resolved(["trainer.resume=auto", "trainer.num_rollout=2"])
    cfg.output_dir = str(run)
    assert any(e.startswith("trainer.num_rollout: 2 is below step 4") for e in validate(cfg))
    cfg.output_dir = str(tmp_path / "fresh")  # nothing saved there yet: a fresh start
    assert validate(cfg) == []


def _torch_ckpt(run_dir, *, fsdp=False, adapter=None, critic=False):
    """A torch backend checkpoint's files as its save() lays them out (empty: the rules read only names and
    adapter/adapter_config.json)."""
    def write(d):
        open(os.path.join(d, "trainer.pt"), "wb").close()
        if fsdp:
            os.makedirs(os.path.join(d, "dcp"))
        if adapter is not None:
            os.makedirs(os.path.join(d, "adapter"))
            with open(os.path.join(d, "adapter", "adapter_config.json"), "w") as f:
                json.dump(adapter, f)
        if critic:
            open(os.path.join(d, "critic.pt"), "wb").close()

    from slime_hydra.checkpoint.ckpt import save_checkpoint

    return save_checkpoint(str(run_dir), 1, write, {"epoch": 0}, keep=2)


def _keyed(overrides, key):
    return [e for e in errors(overrides) if e.startswith(key)]


def test_resume_refuses_another_strategy(tmp_path):
    from slime_hydra.checkpoint.rules import FSDP_DIR
    from slime_hydra.train.backends.torch.fsdp import DCP_DIR

    assert FSDP_DIR == DCP_DIR
    fsdp = _torch_ckpt(tmp_path / "fsdp", fsdp=True)
    errs = _keyed([f"trainer.resume={fsdp}"], "trainer.strategy:")
    assert errs and errs[0].startswith(f"trainer.strategy: 'ddp' but the checkpoint {fsdp} was saved with "
                                       "trainer.strategy='fsdp'"), errs
    assert _keyed([f"trainer.resume={fsdp}", "trainer.strategy=fsdp"], "trainer.strategy:") == []
    ddp = _torch_ckpt(tmp_path / "ddp")
    errs = _keyed([f"trainer.resume={ddp}", "trainer.strategy=fsdp"], "trainer.strategy:")
    assert errs and "was saved with trainer.strategy='ddp'" in errs[0], errs
    assert errors([f"trainer.resume={ddp}"]) == []


QWEN3_TARGETS = ["down_proj", "gate_proj", "v_proj", "k_proj", "q_proj", "o_proj", "up_proj"]  # as PEFT wrote them


def test_resume_refuses_other_lora_settings(tmp_path):
    lora = _torch_ckpt(tmp_path / "lora", adapter={"r": 4, "lora_alpha": 32.0, "target_modules": QWEN3_TARGETS})
    same = [f"trainer.resume={lora}", "trainer.lora.rank=4"]
    assert errors(same) == []
    assert _keyed([*same, "trainer.lora.alpha=256"], "trainer.lora.alpha:") == [
        f"trainer.lora.alpha: 256.0 but the checkpoint {lora} was saved with lora_alpha=32.0 "
        f"({lora}/adapter/adapter_config.json); resume it with trainer.lora.alpha=32.0"]
    assert _keyed([f"trainer.resume={lora}", "trainer.lora.rank=8"], "trainer.lora.rank:")[0].startswith(
        f"trainer.lora.rank: 8 but the checkpoint {lora} was saved with r=4")
    errs = _keyed([*same, "trainer.lora.target_modules=[q_proj,v_proj]"], "trainer.lora.target_modules:")
    assert errs and "target_modules=['down_proj', 'gate_proj'" in errs[0], errs
    errs = _keyed([f"trainer.resume={lora}"], "trainer.lora.rank:")  # LoRA off: the adapter would be dropped
    assert errs and errs[0].startswith(f"trainer.lora.rank: 0 but the checkpoint {lora} was saved with LoRA "
                                       "(it has adapter/ with r=4, lora_alpha=32.0)"), errs
    full = _torch_ckpt(tmp_path / "full")
    errs = _keyed([f"trainer.resume={full}", "trainer.lora.rank=4"], "trainer.lora.rank:")
    assert errs and "was saved without LoRA (it has no adapter/)" in errs[0], errs


def test_resume_under_ppo_needs_the_critic(tmp_path):
    grpo = _torch_ckpt(tmp_path / "grpo")
    errs = _keyed([f"trainer.resume={grpo}", "algo=ppo"], "algo.advantage_estimator:")
    assert errs and f"the checkpoint {grpo} has no critic.pt" in errs[0], errs
    ppo = _torch_ckpt(tmp_path / "ppo", critic=True)
    assert _keyed([f"trainer.resume={ppo}", "algo=ppo"], "algo.advantage_estimator:") == []


def test_chat_prompts_and_system_prompts_need_the_chat_template(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": "2+2?", "label": "4"}\n'
                    '{"prompt": [{"role": "user", "content": "3+3?"}], "label": "6"}\n')
    data = ["data=jsonl", f"data.path={chat}", "rollout.max_response_len=8"]
    needle = f"data.apply_chat_template: {chat}:2: the prompt is a list of chat messages"
    assert fires([*data, "eval.datasets=[]", "data.apply_chat_template=false"], needle)
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "2+2?", "label": "4"}\n')
    evals = ["data=jsonl", f"data.path={plain}", "rollout.max_response_len=8", "data.apply_chat_template=false"]
    assert not fires([*evals, "eval.datasets=[]"], "data.apply_chat_template")  # string prompts: no template needed
    assert fires([*evals, f"eval.datasets=[{{name: e, path: {chat}}}]"], needle)  # an eval set's chat prompts
    assert fires(["data.system_prompt=hi", "data.apply_chat_template=false"],
                 "data.system_prompt: needs data.apply_chat_template=true")


# ----------------------------------------------------------------------------------------- 8. hooks
@pytest.mark.parametrize("key", ["rollout.generate", "rollout.dynamic_filter", "rollout.rollout_function",
                                 "data.buffer_filter", "reward.custom"])
def test_a_hook_that_does_not_import_names_its_key(key):
    errs = errors([f"{key}=nopkg.mod.fn"])
    assert any(e.startswith(f"{key}: hook 'nopkg.mod.fn': no module 'nopkg.mod' can be imported") for e in errs), errs


def test_hook_typos_and_broken_modules(tmp_path, monkeypatch):
    (tmp_path / "broken_hooks.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "fine_hooks.py").write_text("def keep(cfg, group):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    errs = errors(["rollout.dynamic_filter=fine_hooks.keeep", "reward.type=custom",
                   "+reward.custom={_target_: fine_hooks.nope, bonus: 1}", "data.buffer_filter=broken_hooks.pick"])
    assert any(e.startswith("rollout.dynamic_filter: hook 'fine_hooks.keeep': 'fine_hooks' has no attribute 'keeep'")
               for e in errs), errs
    assert any(e.startswith("reward.custom: ") and "fine_hooks.nope" in e for e in errs), errs
    assert any(e.startswith("data.buffer_filter: RuntimeError: boom at import") for e in errs), errs
    ok = ["rollout.dynamic_filter=fine_hooks.keep", "data.buffer_filter=slime_hydra.data.source.pop_first"]
    assert errors(ok) == []


def test_the_calculator_experiment_loads_its_hooks():
    assert errors(["experiment=calculator_agent"]) == []  # rollout.generate and reward.custom are _target_ nodes


# ------------------------------------------------------------------------------------ 9. dataset rows
def _write(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_dataset_rows_are_parsed_with_the_file_and_line(tmp_path):
    ok = '{"prompt": "1+1?", "label": "2"}'
    bad_json = _write(tmp_path / "bad.jsonl", ok, '{"prompt": "2+2?", "label": ')
    errs = errors([*TINY_FILE_DATA, f"data.path={bad_json}", "eval.datasets=[]"])
    assert len(errs) == 1 and errs[0].startswith(f"data.path: {bad_json}:2: invalid JSON (Expecting value"), errs

    no_label = _write(tmp_path / "no_label.jsonl", ok, '{"prompt": "2+2?"}')
    empty = _write(tmp_path / "empty.jsonl", "")
    errs = errors([*TINY_FILE_DATA, f"data.path={TINY}",
                   f"eval.datasets=[{{name: a, path: '{no_label}'}}, {{name: b, path: '{empty}'}}]"])
    assert any(e.startswith(f"eval.datasets[0].path: {no_label}:2: missing key 'label' (keys here: prompt); set "
                            "data.label_key") for e in errs), errs
    assert f"eval.datasets[1].path: {empty}: no rows" in errs, errs

    # the eval set's own keys are the ones read
    answers = _write(tmp_path / "answers.jsonl", '{"q": "1+1?", "answer": "2"}')
    assert errors([*TINY_FILE_DATA, f"data.path={TINY}",
                   f"eval.datasets=[{{name: a, path: '{answers}', input_key: q, label_key: answer}}]"]) == []
    assert errors([*TINY_FILE_DATA, f"data.path='{TINY}@[0:1]'", f"eval.datasets=[{{name: a, path: '{TINY}'}}]"]) == []


def test_every_rules_module_is_collected():
    """A component's ``rules.py`` with a ``check`` runs in ``validate`` (a new one cannot be forgotten)."""
    from slime_hydra.launch.validate import RULES

    found = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "slime_hydra").rglob("rules.py")}
    assert found - {"slime_hydra.config.rules"} == {m.__name__ for m in RULES}  # config.rules: the shared helpers


def test_new_rules_are_reported_together(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", json.dumps({"prompt": ""}))
    with pytest.raises(ConfigError) as e:
        check(compose(["data.num_train=10000", "parallelism.num_nodes=2", "rollout.generate=nopkg.gen",
                       f"eval.datasets=[{{name: a, path: '{bad}'}}]"]))
    keys = sorted(v.split(":", 1)[0] for v in e.value.violations)
    assert keys == ["cluster.address", "data.num_train", "eval.datasets[0].path", "rollout.generate"], (
        e.value.violations)
