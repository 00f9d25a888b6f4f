"""The in-code character tokenizers of the built-in tasks: ``PreTrainedTokenizerFast``s (no download) that
save and load with ``AutoTokenizer``. Entries longer than a character are special tokens, matched whole.
"""

from __future__ import annotations

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
CHAT_TEMPLATES = {"builtin:digits": CHAT_TEMPLATE, "builtin:calc": CALC_CHAT_TEMPLATE}


def builtin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    vocab = BUILTIN_TOKENIZERS[name]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in vocab if len(t) > 1])  # matched whole, before the split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATES.get(name, CHAT_TEMPLATE)
    return fast


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    if name_or_path.startswith("builtin:"):
        return builtin_tokenizer(name_or_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
