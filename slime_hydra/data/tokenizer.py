"""The in-code character tokenizer of the built-in tasks: a real ``PreTrainedTokenizerFast``
(built with the ``tokenizers`` library, no download) that saves and loads with ``AutoTokenizer``."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime_hydra.data.tasks import BUILTIN_TOKENIZERS

# A minimal chat template, so apply_chat_template works with the built-in tokenizer too.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}|{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)


def builtin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    vocab = BUILTIN_TOKENIZERS[name]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    if name_or_path.startswith("builtin:"):
        return builtin_tokenizer(name_or_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
