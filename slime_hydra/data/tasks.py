"""Built-in tasks with a verifiable answer, for the embedded default.

A good task for a tiny random-init model under RL has a rule readable from the prompt, a large
prompt space (so held-out prompts test the rule, not memory) and a short answer (so random sampling
sometimes hits it). ``max_digit``: the prompt is five digits and ``=``, the answer the largest digit
("38152=" -> "8"). A random policy scores about 1/576 (one right digit, then end-of-sequence);
greedy accuracy on held-out prompts reaches about 0.9 within ~100 GRPO steps.

This module is light (no torch, no tokenizers) so that config validation can import it.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Tuple

# The vocabulary of the in-code character tokenizer (slime_hydra.data.tokenizer).
DIGITS_VOCAB: List[str] = ["<pad>", "<eos>", *"0123456789", *"=+-*#><,:? |"]
BUILTIN_TOKENIZERS: Dict[str, List[str]] = {"builtin:digits": DIGITS_VOCAB}


def _max_digit(rng: random.Random, code: int) -> Tuple[str, str]:
    digits = f"{code:05d}"
    return digits + "=", max(digits)


# name -> (size of the prompt space, code -> (prompt, label))
TASKS: Dict[str, Tuple[int, Callable[[random.Random, int], Tuple[str, str]]]] = {
    "max_digit": (10**5, _max_digit),
}


def make_splits(task: str, num_train: int, num_eval: int, seed: int) -> Tuple[List[dict], List[dict]]:
    """Disjoint train and held-out rows ``{"prompt", "label"}``, deterministic in ``seed``."""
    space, make = TASKS[task]
    if num_train + num_eval > space:
        raise ValueError(f"data.num_train + data.num_eval = {num_train + num_eval} > {space} distinct {task} prompts")
    rng = random.Random(seed)
    codes = rng.sample(range(space), num_train + num_eval)
    rows = [dict(zip(("prompt", "label"), make(rng, c))) for c in codes]
    return rows[:num_train], rows[num_train:]
