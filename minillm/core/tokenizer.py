"""Text <-> token ids, through a checkpoint's ``tokenizer.json`` and the ``tokenizers`` package;
and text streamed as ids come: ``StreamDecoder`` (whole characters only), ``TextStream`` (cut at
the first stop string, as an API's ``stop`` asks)."""

from __future__ import annotations

import contextlib
import functools
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

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary, added tokens included: no token stands for
        more characters of text (a byte-level or byte-fallback token's string is at least as long
        as the text it decodes to), so a text of n characters needs at least n / this tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """For a byte-level BPE (GPT-2's scheme: each byte spelled by one printable character), the
        character -> byte table; None for other tokenizers."""
        if type(self._tok.decoder).__name__ != "ByteLevel":
            return None
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        rest = [b for b in range(256) if b not in printable]
        chars = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}
        return chars

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which need not be whole UTF-8 characters: a byte-level
        token read through its alphabet, a byte-fallback token (``<0x0A>``) as its byte, any other
        as its decoded text."""
        piece = self._tok.id_to_token(int(token_id))
        table = self._byte_level
        if piece is not None and table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

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

    Byte-level tokens can split one character across two tokens, and a token's text can depend on
    the one before it (a leading space a decoder strips at the start of a text). So each new piece
    is the decoded text of a short window, the ids since the last piece plus the ones of the piece
    before as context, minus the text of that context alone: the same text as decoding every id
    seen so far, for the cost of a few ids per token instead of all of them (as vLLM and Hugging
    Face's streamers do). The pieces joined are ``tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0  # characters returned so far
        self._context = self._start = 0  # the window: ids[_context:_start] decoded already, ids[_start:] not yet

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._piece(final=False)

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (an unfinished character)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        context = self.tokenizer.decode(self.ids[self._context : self._start])
        text = self.tokenizer.decode(self.ids[self._context :])
        if not text.startswith(context):  # a decoder for which a window's text is not its text in place
            text = self.tokenizer.decode(self.ids)  # then decode it all, this once
            context = text[: self.printed]
        if text.endswith("\ufffd") and not final:  # an unfinished multi-byte character: wait for the next token
            return ""
        piece = text[len(context) :]
        self.printed += len(piece)
        self._context, self._start = self._start, len(self.ids)
        return piece


class TextStream:
    """Token ids in, text out, cut at the first stop string. Text that could still become the
    start of a stop string (the longest end of it that begins one) is held back until it cannot,
    or the answer ends. With ``include_stop``, the stop string itself ends the text."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False):
        self.decoder = StreamDecoder(tokenizer)
        self.stop, self.longest = stop, max((len(s) for s in stop), default=0)
        self.include_stop = include_stop
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.text += self.decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [(i, len(s)) for i, s in ((self.text.find(s, self.sent), s) for s in self.stop) if i >= 0]
        if hits:
            at, length = min(hits)
            self.stopped, end = True, at + length if self.include_stop else at
        else:
            end = len(self.text) if final else len(self.text) - self._may_begin_a_stop()
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def _may_begin_a_stop(self) -> int:
        """How many characters at the end of the unsent text could be the beginning of a stop string."""
        unsent = self.text[self.sent :]
        for n in range(min(len(unsent), self.longest - 1), 0, -1):
            if any(s.startswith(unsent[-n:]) for s in self.stop):
                return n
        return 0
