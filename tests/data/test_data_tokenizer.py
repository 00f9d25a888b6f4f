"""The in-code tokenizers: builtin:bytes writes any UTF-8 text a token per byte and reads it back; the character
tokenizers of the built-in tasks refuse a character they have no token for (never padding)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from slime_hydra.data.tasks import BYTES_VOCAB, DIGITS_VOCAB
from slime_hydra.data.tokenizer import builtin_tokenizer, unknown_chars

TEXTS = ["Jürgen hat 3 Äpfel und kauft 4 dazu.", "Größe: 5 Straßen, je 2 €", "数学 🍎\ttab\nnewline",
         "a literal <0x41> stays text"]


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_writes_and_reads_any_text(text):
    tok = builtin_tokenizer("builtin:bytes")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [6 + b for b in text.encode()]  # after the 6 special tokens, one token per byte
    assert tok.decode(ids) == text and unknown_chars("builtin:bytes", text) == []
    assert tok.pad_token_id == 0 and 0 not in ids


def test_bytes_special_tokens_and_chat_template(tmp_path):
    tok = builtin_tokenizer("builtin:bytes")
    assert len(tok) == len(BYTES_VOCAB) == 262
    messages = [{"role": "system", "content": "Antworte kurz."}, {"role": "user", "content": "Wie viele Äpfel?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<system>Antworte kurz.<user>Wie viele Äpfel?<assistant>"
    ids = tok(text + "7<eos>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids[-1] == tok.eos_token_id == 1 and ids.count(4) == 1  # roles and <eos> whole
    assert tok.decode(ids, skip_special_tokens=True) == "Antworte kurz.Wie viele Äpfel?7"  # bytes are not special
    tok.save_pretrained(tmp_path)  # the initial checkpoint carries it; engines and trainers load it back
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids[:-2] and again.decode(ids) == text + "7<eos>"
    assert again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text


def test_a_character_tokenizer_refuses_what_it_cannot_write():
    tok = builtin_tokenizer("builtin:digits")
    assert tok("3815=", add_special_tokens=False)["input_ids"] == [DIGITS_VOCAB.index(c) for c in "3815="]
    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):  # not <pad>, as it once was
        tok("Äpfel 3=", add_special_tokens=False)
    assert unknown_chars("builtin:digits", "<eos>Jürgen: 3+4=?") == ["J", "ü", "r", "g", "e", "n"]
    assert unknown_chars("builtin:calc", "<user>37*48-1772<assistant>") == []
