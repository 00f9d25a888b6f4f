"""What the GPU benches run on, with nothing to download: a checkpoint of a real model's shape with random
bf16 weights and a word-level tokenizer over its vocabulary ("t0", "t1", ...), so the embedding and LM head
have their real shapes, and prompts of random words of that vocabulary.

    python3 bench/gpu/workload.py /tmp/q06 --prompts /tmp/q06.jsonl      # Qwen3-0.6B shape, 2048 prompts
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Workload:
    """The checkpoint, prompts and batch of a GRPO step that a bench runs (and the run's work folder)."""

    work: str  # where the checkpoint, prompts, server logs and run dirs go
    preset: str = "qwen3_0_6b"  # the model shape (conf/model/)
    prompts: int = 8  # prompts a step
    samples: int = 8  # samples per prompt
    new_tokens: int = 256  # tokens per answer
    prompt_words: int = 64  # words per prompt (a word is a token)
    words: int = 1000  # the prompts' words: "t0" .. "t<words - 1>"
    device: str = "cuda"

    @property
    def ckpt(self) -> str:
        return os.path.join(self.work, "q06" if self.preset == "qwen3_0_6b" else self.preset)

    @property
    def data(self) -> str:
        return self.ckpt + ".jsonl"

    def build(self) -> None:
        """The checkpoint (kept if there) and 2048 prompts."""
        os.makedirs(self.work, exist_ok=True)
        build_checkpoint(self.ckpt, self.preset, reuse=True)
        add_chat_template(self.ckpt)
        write_prompts(self.data, 2048, self.prompt_words, self.words)


def arch_of(preset: str, overrides: Sequence[str] = ()):
    """The ``ArchConfig`` of ``conf/model/<preset>.yaml``, with ``model.arch.*`` overrides applied."""
    from omegaconf import OmegaConf

    from slime_hydra.config.describe import compose
    from slime_hydra.config.schema import ArchConfig

    node = compose([f"model={preset}", *(o for o in overrides if o.startswith("model.arch."))]).model.arch
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ArchConfig), node))


def build_checkpoint(out: str, preset: str = "qwen3_0_6b", arch=None, device: str = "cpu",
                     reuse: bool = False) -> str:
    """Random bf16 weights (seed 0) of ``arch`` (default: the preset's), initialised on ``device`` (minutes
    on a CPU for 4B parameters), and the tokenizer, written whole to ``out``. ``reuse``: keep a checkpoint
    already there (name ``out`` after the shape then)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from slime_hydra.model.hf import hf_config

    if reuse and os.path.exists(os.path.join(out, "config.json")):
        return out
    arch = arch or arch_of(preset)
    vocab = ["<pad>", "<eos>"] + [f"t{i}" for i in range(arch.vocab_size - 2)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(arch, pad_token_id=0, eos_token_id=1), dtype=torch.bfloat16)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# roles as words of the vocabulary (t5 system, t6 user, t7 assistant, t8 tool): the agent scenarios' conversations
CHAT_TEMPLATE = ("{% for m in messages %} t{{ {'system': 5, 'user': 6, 'assistant': 7, 'tool': 8}[m['role']] }} "
                 "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} t7{% endif %}")


def add_chat_template(ckpt: str) -> None:
    """Give the checkpoint's tokenizer :data:`CHAT_TEMPLATE` (the other scenarios send raw prompts)."""
    path = os.path.join(ckpt, "tokenizer_config.json")
    cfg = json.load(open(path))
    if cfg.get("chat_template") != CHAT_TEMPLATE:
        cfg["chat_template"] = CHAT_TEMPLATE
        with open(path + ".tmp", "w") as f:
            json.dump(cfg, f, indent=1)
        os.replace(path + ".tmp", path)


def write_prompts(path: str, n: int = 2048, words: int = 64, vocab: int = 1000, labels: bool = True) -> str:
    """``n`` prompts of ``words`` random words "t<i>", i < ``vocab`` (seed 0), with a random label "t0".."t9"
    (or "") each: a jsonl for ``data=jsonl``."""
    rng = random.Random(0)
    with open(path + ".tmp", "w") as f:
        for _ in range(n):
            prompt = " ".join(f"t{rng.randrange(vocab)}" for _ in range(words))
            f.write(json.dumps({"prompt": prompt, "label": f"t{rng.randrange(10)}" if labels else ""}) + "\n")
    os.replace(path + ".tmp", path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="where the checkpoint goes")
    ap.add_argument("--preset", default="qwen3_0_6b", help="a model preset of conf/model/")
    ap.add_argument("--prompts", help="also write 2048 prompts of 64 random words here")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    build_checkpoint(args.checkpoint, args.preset)
    if args.prompts:
        write_prompts(args.prompts)


if __name__ == "__main__":
    main()
