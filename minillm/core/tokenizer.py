"""Text <-> token ids, through a checkpoint's ``tokenizer.json`` and the ``tokenizers`` package."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token")


def _token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A thin wrapper: encode/decode, the special token ids, streaming decode, and the checkpoint's
    chat template (a Jinja string, as Hugging Face stores it; None when the checkpoint has none)."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ):
        self._tok = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_id = tokenizer.token_to_id(eos_token) if eos_token else None

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        specials: dict[str, str | None] = {}
        template = None
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            specials = {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKEN_KEYS}
            template = cfg.get("chat_template")
        if (directory / "chat_template.jinja").is_file():  # newer checkpoints keep it in a file of its own
            template = (directory / "chat_template.jinja").read_text()
        if not isinstance(template, str):  # absent, or a list of named templates (not supported)
            template = None
        return cls(tok, specials.get("bos_token"), specials.get("eos_token"), template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; the tokenizer's own template decides whether a BOS is added."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self._tok.save(str(directory / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 characters.

    Byte-level tokens can split one character across two tokens; decoding the ids seen so far
    and printing only the new, complete suffix keeps the stream readable.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for the next token
            return ""
        piece, self.printed = text[self.printed :], len(text)
        return piece

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (an unfinished character)."""
        text = self.tokenizer.decode(self.ids)
        piece, self.printed = text[self.printed :], len(text)
        return piece
