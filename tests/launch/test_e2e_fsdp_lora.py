"""``python run.py`` with FSDP2 (``trainer.strategy=fsdp``) and LoRA (``trainer.lora.rank``) on CPU: the real
loop (Ray, the embedded engine behind sglang-router, weight pushes), short runs that learn and resume."""

from __future__ import annotations

import pytest

from runs import FAST, leftover_processes, metrics, run

pytestmark = pytest.mark.integration


def test_lora_colocated_pushes_merged_weights_and_saves_the_adapter(tmp_path):
    """The fast suite's LoRA run: colocated (shared-memory handles, offload), three steps. The engine scores
    the tokens it sampled as the trainer does (log-prob gap < 1e-3: the merged weights arrived whole), and
    the checkpoint is the adapter, loadable by PEFT on the base checkpoint."""
    d = tmp_path / "run"
    summary = run(d, "parallelism=cpu_colocate", "trainer.lora.rank=8", "algo.lr=1e-2", "trainer.num_rollout=3",
                  "trainer.save_interval=3", *FAST)
    assert summary["steps"] == 3 and summary["max_logprob_abs_diff"] < 1e-3
    rows = metrics(d)[1:]
    assert all(r["perf/weight_sync_bytes"] > 0 for r in rows) and all(r["train/grad_norm"] > 0 for r in rows)
    ckpt = d / "checkpoints" / "step_000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "data_state.json", "meta.json", "trainer.pt"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d / "initial_model"), ckpt / "adapter")
    assert any(".lora_B." in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    assert not leftover_processes()


@pytest.mark.slow  # 27 s; FSDP2's fast tests are tests/train/test_fsdp.py
def test_fsdp_colocated_over_disk(tmp_path):
    """The fast suite's FSDP2 run: one rank (its own process group), colocated, weights gathered into a
    safetensors file (sync.transport=disk) that the engine loads: it scores its samples as the trainer does."""
    d = tmp_path / "run"
    summary = run(d, "parallelism=cpu_colocate", "trainer.strategy=fsdp", "sync.transport=disk",
                  "trainer.num_rollout=2", "trainer.save_interval=2", *FAST)
    assert summary["steps"] == 2 and summary["max_logprob_abs_diff"] < 1e-3
    ckpt = d / "checkpoints" / "step_000002"
    assert (ckpt / "dcp").is_dir() and (ckpt / "hf" / "config.json").exists()
    assert not leftover_processes()


@pytest.mark.slow
def test_lora_learns_the_default_task(tmp_path):
    """LoRA rank 16 on the default task (the tiny model, 32 x 16 samples a step, lr 1e-2: adapters need a
    higher rate than the full model's 3e-3). Held-out reward at steps 10 / 20 of this 20-step run (runs are
    deterministic per seed; 2 shared cores, ~3 min): seed 1234 (this test) 0.629 / 0.891, seed 1 0.711 /
    0.754, seed 2 0.547 / 0.547, seed 3 0.746 / 0.758; full fine-tuning reaches 0.86-0.89 by step 20
    (tests/launch/test_e2e.py). lr 3e-2 (seeds 1, 2: 0.34, 0.55 at step 30) and rank 64 (seed 2: 0.19) did worse.
    The threshold holds for every seed measured: >= 0.5 by step 20."""
    d = tmp_path / "run"
    summary = run(d, "trainer.lora.rank=16", "algo.lr=1e-2", "trainer.num_rollout=20", "eval.interval=10",
                  "logging.progress=false")
    assert summary["eval_reward_initial"] <= 0.2
    assert summary["eval_reward_final"] >= 0.5, summary  # 0.891 measured for seed 1234


@pytest.mark.slow
def test_fsdp_two_ranks_learn_and_resume_on_one(tmp_path):
    """Two trainer ranks with FSDP2 (gloo) learn the default task (held-out 0.891 at step 20, measured), and
    the run resumes from its torch.distributed.checkpoint files on one rank (resharded)."""
    d = tmp_path / "run"
    two = ["trainer.strategy=fsdp", "parallelism.trainer_gpus=2", "parallelism.gpus_per_node=3"]
    summary = run(d, *two, "trainer.num_rollout=20", "trainer.save_interval=10", "eval.interval=10", *FAST[:1])
    assert summary["eval_reward_final"] >= 0.8, summary
    assert (d / "checkpoints" / "step_000020" / "dcp").is_dir()
    run(d, "trainer.strategy=fsdp", "trainer.num_rollout=22", "trainer.resume=auto", *FAST)
    rows = metrics(d)
    assert [r["step"] for r in rows][-2:] == [21, 22]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in rows[-2:])
