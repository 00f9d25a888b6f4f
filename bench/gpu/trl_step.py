"""TRL's GRPOTrainer (HF generate, no vLLM), the baseline of bench/sglang_gpu.py's ``trl`` phase, on the same
checkpoint, prompts and batch as run.py there: the workload's completions at their full length, the same
micro-batches, fp32 weights under bf16 autocast, no KL (TRL's default beta 0). Rollout = its
_generate_and_score_completions, train = the rest of the optimiser step, sync = 0 (one model)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

from gpu.harness import log
from gpu.workload import Workload


def phase_trl(w: Workload, steps: int, micro_batch: int, out: Dict[str, Any]) -> None:
    """TRL's GRPOTrainer on the same checkpoint, prompts and batch (see the module docstring). Each
    step's row has run.py's metric names, so the table reads both alike."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = w.device == "cuda"
    out["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rollout_s: List[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # generation, rewards, advantages, old log-probs
            sync()
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                sync()
                rollout_s.append(time.perf_counter() - t)

    rows: List[Dict[str, Any]] = out.setdefault("rows", [])

    class StepTimes(TrainerCallback):
        """Wall time between optimiser steps (as run.py's perf/step_time: everything of the step)."""

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            step, gen = now - self.t, sum(rollout_s)
            rollout_s.clear()
            rows.append({"step": state.global_step, "perf/step_time": step, "perf/rollout_wait_time": gen,
                         "perf/rollout_time": gen, "perf/train_time": step - gen, "perf/weight_sync_time": 0.0,
                         "perf/offload_time": 0.0})
            log(f"trl step {state.global_step}: {step:.2f}s (rollout {gen:.2f}s)")
            self.t = now

    with open(w.data) as f:
        data = [json.loads(line) for line in f][:w.prompts * (steps + 1)]
    dataset = Dataset.from_list([{"prompt": d["prompt"], "label": d["label"]} for d in data])

    def first_word_is_label(completions, label, **kw):
        return [float(c.split()[:1] == [lab]) for c, lab in zip(completions, label)]

    args = GRPOConfig(
        output_dir=os.path.join(w.work, "trl"), max_steps=steps, num_generations=w.samples,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=w.prompts * w.samples // micro_batch,
        max_completion_length=w.new_tokens, temperature=1.0, top_p=1.0, learning_rate=1e-6, beta=0.0,
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, generation_kwargs={"min_new_tokens": w.new_tokens})  # every completion full
    out["config"] = {k: getattr(args, k) for k in ("num_generations", "per_device_train_batch_size",
                                                    "gradient_accumulation_steps", "generation_batch_size",
                                                    "max_completion_length", "bf16", "gradient_checkpointing",
                                                    "beta", "loss_type", "use_vllm")}
    model = AutoModelForCausalLM.from_pretrained(w.ckpt, dtype=torch.float32)  # fp32 master weights, as ours
    tok = AutoTokenizer.from_pretrained(w.ckpt)
    t0 = time.perf_counter()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=first_word_is_label, args=args, train_dataset=dataset,
                               processing_class=tok, callbacks=[StepTimes()])
    out["startup_s"] = time.perf_counter() - t0  # the trainer's construction (the model was loaded before)
    trainer.train()
    out["returncode"] = 0
    out["wall_s"] = time.perf_counter() - t0
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
