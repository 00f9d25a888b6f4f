"""The in-code tokenizers: ``PreTrainedTokenizerFast``s (no download) that save and load with ``AutoTokenizer``.
builtin:digits and builtin:calc spell their task's characters and nothing else (a character outside the vocabulary
is an error, never padding); builtin:bytes spells any UTF-8 text, a token per byte. Entries longer than a
character, but for the byte tokens, are special tokens, matched whole.
"""

from __future__ import annotations

import re
from typing import List

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime_hydra.data.tasks import BUILTIN_TOKENIZERS

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %}|{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{% endif %}")

# builtin:calc, shaped like real tool-use templates: a tool call is ``<call>`` and its expression; consecutive
# tool messages share one ``<tool>`` header (as Qwen's), so multi-turn masks come from the whole conversation.
#   [user "37*48-1772", assistant call, tool "4", assistant "4"]
#   -> <user>37*48-1772<assistant><call><eos><tool>4<assistant>4<eos>
CALC_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<system>{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}<user>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}<assistant>{{ m['content'] or '' }}"
    "{%- for c in (m['tool_calls'] or []) -%}<call>{{ c['function']['arguments']['expression'] or '' }}{%- endfor -%}"
    "<eos>{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<tool>{%- else -%},{%- endif -%}"
    "{{ m['content'] }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<assistant>{%- endif -%}")
# builtin:bytes: a role token before each message, <eos> after each answer
#   [system "Antworte kurz.", user "Wie viele?"] -> <system>Antworte kurz.<user>Wie viele?<assistant>
BYTES_CHAT_TEMPLATE = ("{%- for m in messages -%}<{{ m['role'] }}>{{ m['content'] }}"
                       "{%- if m['role'] == 'assistant' -%}<eos>{%- endif -%}{%- endfor -%}"
                       "{%- if add_generation_prompt -%}<assistant>{%- endif -%}")
CHAT_TEMPLATES = {"builtin:digits": CHAT_TEMPLATE, "builtin:calc": CALC_CHAT_TEMPLATE,
                  "builtin:bytes": BYTES_CHAT_TEMPLATE}


def builtin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    vocab = BUILTIN_TOKENIZERS[name]
    ids = {t: i for i, t in enumerate(vocab)}
    if name == "builtin:bytes":  # no merges: every character falls back to its UTF-8 bytes
        tok = Tokenizer(models.BPE(vocab=ids, merges=[], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    else:  # no unk_token: a character outside the vocabulary fails to encode
        tok = Tokenizer(models.WordLevel(ids))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in vocab if len(t) > 1 and not t.startswith("<0x")])  # matched whole, first
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATES.get(name, CHAT_TEMPLATE)
    return fast


def unknown_chars(name: str, text: str) -> List[str]:
    """The characters of ``text`` that the built-in tokenizer ``name`` cannot spell, each once, in order."""
    vocab = BUILTIN_TOKENIZERS[name]
    if name == "builtin:bytes":
        return []
    text = re.sub("|".join(re.escape(t) for t in vocab if len(t) > 1), "", text)
    return list(dict.fromkeys(c for c in text if c not in vocab))


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    if name_or_path.startswith("builtin:"):
        return builtin_tokenizer(name_or_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
