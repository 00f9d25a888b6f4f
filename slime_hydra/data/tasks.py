"""Built-in tasks with a verifiable answer, for the embedded default (light: config validation imports it).

``max_digit``: four digits and ``=``, the answer the largest digit ("3815=" -> "8"): a rule readable from the
prompt, a large prompt space and a short answer, so a tiny random-init model learns it under RL.
``calc`` (``examples/calculator``): an expression with a one-digit value ("37*48-1772" -> "4") that an agent
gets by calling a calculator tool.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Tuple

# The vocabulary of the in-code character tokenizer (slime_hydra.data.tokenizer).
DIGITS_VOCAB: List[str] = ["<pad>", "<eos>", *"0123456789", *"=+-*#><,:? |"]
# builtin:calc: characters for arithmetic, plus chat roles and a tool-call marker as single tokens
# (every entry longer than one character is a special token; its chat template is in tokenizer.py).
CALC_VOCAB: List[str] = ["<pad>", "<eos>", *"0123456789", *"+-*%=?,",
                         "<system>", "<user>", "<assistant>", "<tool>", "<call>"]
# builtin:bytes, for any UTF-8 text (the tiny model on your data): chat roles, then the 256 bytes as
# byte-fallback tokens (id = 6 + byte value)
BYTES_VOCAB: List[str] = ["<pad>", "<eos>", "<system>", "<user>", "<assistant>", "<tool>",
                          *(f"<0x{b:02X}>" for b in range(256))]
BUILTIN_TOKENIZERS: Dict[str, List[str]] = {"builtin:digits": DIGITS_VOCAB, "builtin:calc": CALC_VOCAB,
                                            "builtin:bytes": BYTES_VOCAB}


def _max_digit(rng: random.Random, code: int) -> Tuple[str, str]:
    digits = f"{code:04d}"
    return digits + "=", max(digits)


def _calc(rng: random.Random, code: int) -> Tuple[str, str]:
    a, b, value = 10 + code // 900, 10 + code // 10 % 90, code % 10
    return f"{a}*{b}-{a * b - value}", str(value)


# name -> (size of the prompt space, code -> (prompt, label))
TASKS: Dict[str, Tuple[int, Callable[[random.Random, int], Tuple[str, str]]]] = {"max_digit": (10**4, _max_digit),
                                                                                "calc": (90 * 90 * 10, _calc)}
# the tokenizer whose vocabulary can express each task (prompts, answers and, for calc, tool calls)
TASK_TOKENIZERS: Dict[str, str] = {"max_digit": "builtin:digits", "calc": "builtin:calc"}


def make_splits(task: str, num_train: int, num_eval: int, seed: int) -> Tuple[List[dict], List[dict]]:
    """Disjoint train and held-out rows ``{"prompt", "label"}``, deterministic in ``seed``."""
    space, make = TASKS[task]
    if num_train + num_eval > space:
        raise ValueError(f"data.num_train + data.num_eval = {num_train + num_eval} > {space} distinct {task} prompts")
    rng = random.Random(seed)
    codes = rng.sample(range(space), num_train + num_eval)
    rows = [dict(zip(("prompt", "label"), make(rng, c))) for c in codes]
    return rows[:num_train], rows[num_train:]
