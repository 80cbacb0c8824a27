"""Print a completion to a terminal as its tokens are committed.

Incremental detokenisation as in vLLM's ``detokenize_incrementally`` / transformers' ``TextStreamer``: the new text of
a step is ``decode(ids[prefix:])`` less ``decode(ids[prefix:read])``, held back while it ends in an incomplete UTF-8
sequence (U+FFFD), so a multi-byte character split across tokens is printed once it is whole and each decode call
covers only the last few tokens.
"""
from __future__ import annotations

import sys


class TextStream:
    """``on_tokens`` is an ``LLM.generate(stream=...)`` callback for one prompt; ``close(final_text)`` prints what
    the stream has not (all of it when the engine streamed nothing) and the closing newline.

    The printed text always equals ``final_text`` when the streamed decode is a prefix of it (byte-level BPE,
    SentencePiece); otherwise the rest of the stream is dropped and the final text is printed on a new line.
    """

    def __init__(self, tokenizer, out=None):
        self.tok, self.out = tokenizer, out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.printed = ""

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def on_tokens(self, updates) -> None:
        for _, ids in updates:
            self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._write(now[len(before):])
            self.prefix, self.read = self.read, len(self.ids)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.printed += text

    def end_line(self) -> None:
        """End a stream cut short (an interrupt, a failed request) on its own line: a newline when something was
        printed and it does not end in one; nothing otherwise."""
        if self.printed and not self.printed.endswith("\n"):
            self._write("\n")

    def close(self, final_text: str) -> None:
        if final_text.startswith(self.printed):
            self._write(final_text[len(self.printed):])
        else:
            self._write("\n" + final_text)
        self._write("\n")
