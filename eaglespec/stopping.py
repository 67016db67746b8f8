"""When a generation stops, and what it has produced then: one rule for plain and EAGLE decoding.

Plain decoding produces one token at a time and checks after each: an EOS ends it (the EOS is not
kept), then a stop string ends it (the text is cut where the match starts; the token that completed
it is kept, as it was generated), then the budget ends it ("length"). An EAGLE round hands over several
tokens at once; feeding them through the same rule one at a time is what makes its result equal plain
decoding's in every field: the tokens, the text, the finish reason and the token count. In particular
of two overlapping stop strings the one that *completes* first wins, and an EOS that lies past the
budget is never seen.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundOutcome:
    kept: list[int]          # the round's tokens that join the output
    consumed: int            # tokens of the round the rule looked at (kept, plus an EOS that ended it)
    done: bool


@dataclass
class Stopper:
    """Feed it each round's tokens; it keeps the output, its text and the finish reason."""
    tokenizer: object | None
    eos_ids: set[int]
    ignore_eos: bool
    stops: list[str]
    budget: int
    out: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"
    done: bool = False

    @property
    def hold(self) -> int:
        """Characters at the end of the text that may still grow into a stop string: not streamed yet."""
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, tokens: list[int]) -> RoundOutcome:
        kept: list[int] = []
        consumed = 0
        for t in tokens:
            consumed += 1
            if t in self.eos_ids and not self.ignore_eos:
                self.finish, self.done = "stop", True
                break
            self.out.append(t)
            kept.append(t)
            # A stop string can only appear by adding a token: decoding after each one (as plain
            # decoding does) finds the match that completes first.
            if self.stops and self._stop_string_hit():
                break
            if len(self.out) >= self.budget:
                self.finish, self.done = "length", True
                break
        if self.tokenizer is not None and not (self.stops and consumed):
            self.text = self._decode()  # without stop strings, once per round is enough
        return RoundOutcome(kept, consumed, self.done)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.out, skip_special_tokens=True)

    def _stop_string_hit(self) -> bool:
        self.text = self._decode()
        # The earliest match in the text; text before the last `hold` characters was already
        # searched, but decoding may rewrite a trailing incomplete character, so search it all.
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text, self.finish, self.done = self.text[:min(hits)], "stop", True
        return True


def stream_delta(text: str, sent: int, hold: int, done: bool) -> tuple[str, int]:
    """The text that can be streamed now, and the new count of streamed characters. Holds back what may
    still become a stop string and an incomplete UTF-8 character (decoded as U+FFFD until its bytes arrive)."""
    if done:
        return text[sent:], max(sent, len(text))
    # An incomplete character at the end decodes as one U+FFFD per byte so far, and shrinks to one
    # character when its last byte arrives: the text's length there is not yet known. Only the
    # settled text before it counts, less what may still grow into a stop string. (Counting the
    # U+FFFDs let a stop string's first character out: the fuzzer's case 195 of seed 0.)
    settled = len(text.rstrip("\ufffd"))
    safe = max(sent, settled - hold)
    return text[sent:safe], safe
