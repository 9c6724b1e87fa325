"""Incremental detokenisation for streamed answers: committed tokens in, text deltas out, ended at the first stop
string (`TextStream`, one per request of the serving engine)."""

from __future__ import annotations


class TextStream:
    """Turns committed tokens into text deltas; ends the request at the first stop string.

    The text is re-decoded from all tokens (a BPE token may change how its neighbours decode), a trailing
    U+FFFD (a half-finished UTF-8 character) is held back, and so are the last `max(len(stop)) - 1`
    characters, which could be the start of a stop string that the next tokens complete.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        """Add tokens; return (new text safe to emit, whether a stop string ended the request)."""
        self.tokens.extend(tokens)
        text = self.text()
        cut = min((i for i in (text.find(s, max(self.sent - self.holdback, 0)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            return self._take(text[:cut]), True
        end = len(text) - self.holdback
        if text.endswith("\ufffd"):
            end = min(end, len(text) - 1)
        return self._take(text[:max(end, self.sent)]), False

    def finish(self) -> str:
        """The held-back tail once the request ends without a stop string."""
        return self._take(self.text())

    def _take(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
