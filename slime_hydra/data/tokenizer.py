"""The in-code character tokenizers of the built-in tasks: real ``PreTrainedTokenizerFast``s (built
with the ``tokenizers`` library, no download) that save and load with ``AutoTokenizer``.

Every vocabulary entry is one character, except the special tokens (``<eos>``, and for
``builtin:calc`` the chat roles and ``<call>``), which are matched whole.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime_hydra.data.tasks import BUILTIN_TOKENIZERS

# A minimal chat template, so apply_chat_template works with the built-in tokenizer too.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}|{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)

# builtin:calc: a chat template with roles and tool calls, shaped like the templates of real
# tool-use models. An assistant turn ends with <eos>; a tool call is ``<call>`` followed by its
# ``expression`` argument; CONSECUTIVE tool messages share one ``<tool>`` header, separated by
# commas (as Qwen's template groups them into one user turn), so rendering each tool message on
# its own gives different text than rendering the conversation -- which is why multi-turn masks
# are built from the template's output over the whole conversation (slime_hydra.rollout.multiturn).
#   [user "37*48-1772", assistant call, tool "4", assistant "4"]
#   -> <user>37*48-1772<assistant><call><eos><tool>4<assistant>4<eos>
CALC_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<system>{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}<user>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}<assistant>{{ m['content'] or '' }}"
    "{%- for c in (m['tool_calls'] or []) -%}<call>{{ c['function']['arguments']['expression'] or '' }}{%- endfor -%}"
    "<eos>"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<tool>{%- else -%},{%- endif -%}"
    "{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)
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
