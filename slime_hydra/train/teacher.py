"""On-policy distillation's teacher beside the trainer: a frozen Hugging Face causal LM on the trainer rank's
device that scores the student's sampled tokens (a forward pass over prompt + response, no generation). Each
rank scores its own rows, whatever the trainer backend, in micro-batches of ``trainer.micro_batch_size``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

from slime_hydra.train.batch import make_micro_batch, response_log_probs

if TYPE_CHECKING:
    from slime_hydra.config.schema import ModelConfig


class Teacher:
    def __init__(self, cfg: "ModelConfig", device: torch.device, micro_batch_size: int):
        from transformers import AutoModelForCausalLM

        self.device, self.micro_batch_size = device, micro_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype),
                                                          trust_remote_code=cfg.trust_remote_code).to(device).eval()
        self.model.config.use_cache = False
        self.pad_id = self.model.config.pad_token_id or 0

    @torch.no_grad()
    def log_probs(self, data: Dict[str, list], response_len: int, temperature: float) -> torch.Tensor:
        """``[N, response_len]`` float32 on CPU: the teacher's log-probs of every row's response tokens under
        ``softmax(logits / temperature)``, zero on padding."""
        n, size = len(data["tokens"]), self.micro_batch_size
        out = []
        for s in range(0, n, size):
            mb = make_micro_batch(data, range(s, min(s + size, n)), response_len, self.pad_id).to(self.device)
            logits = self.model(input_ids=mb.input_ids).logits
            out.append(response_log_probs(logits, mb, temperature)[0].float() * mb.loss_mask.ne(0))
        return torch.cat(out).cpu()
