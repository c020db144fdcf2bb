"""Incremental detokenization with stop strings, as a stream of text deltas."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class StopText:
    """Generated text, grown piece by piece, cut at the first stop string and emitted in deltas.

    Text is emitted only once it cannot be the start of a stop string (held back until that is
    ruled out). The text-level half of :class:`IncrementalDetokenizer`, on its own so that anything
    producing text (the server tests' scripted engine) stops exactly as the engine does."""

    def __init__(self, stop: tuple[str, ...], include_stop: bool = False):
        self.stop = stop
        self.include_stop = include_stop  # cut after the stop string instead of before it
        self.floor = 0  # stop strings are looked for from here (the text before min_tokens does not count)
        self.text = ""  # all text so far (cut at a stop string once one is hit)
        self.emitted = 0  # characters of self.text already returned
        self.hit: str | None = None  # the stop string that stopped it (None: none yet)

    def extend(self, piece: str, look: bool = True) -> bool:
        """Append a piece; True when a stop string was hit (the text is then cut before it, or after
        it with include_stop). look=False: the piece does not count for stop strings (min_tokens)."""
        self.text += piece
        if not look:
            self.floor = len(self.text)
            return False
        for s in self.stop:
            pos = self.text.find(s, max(self.floor, self.emitted - len(s)))
            if pos != -1:
                self.text = self.text[:pos + (len(s) if self.include_stop else 0)]
                self.hit = s
                return True
        return False

    def delta(self, final: bool = False) -> str:
        """Text not yet returned that can be returned now."""
        end = len(self.text)
        if not final and self.hit is None:
            end -= self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


class IncrementalDetokenizer:
    """Turns token ids, appended one at a time, into text deltas.

    Text is emitted only once it is stable: not ending in an incomplete UTF-8 sequence
    and not possibly the start of a stop string (held back until it is ruled out).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0,
                 include_stop: bool = False, skip_special: bool = True):
        self.tok = tokenizer
        self.min_tokens = min_tokens  # stop strings count from this many tokens on (vLLM's min_tokens)
        self.out = StopText(stop, include_stop)
        # the tokenizers library's own incremental decoder: each token costs the same however long
        # the output (decoding all ids again per token grew with the output: 0.2 ms at 2000 tokens)
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        self.count = 0  # tokens added

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self.out.hit

    def add(self, token_id: int) -> bool:
        """Add a token; returns True when a stop string was hit (text is cut before it, or after it
        with include_stop)."""
        self.count += 1
        piece = self._stream.step(self.tok.backend, token_id)
        if piece is None:
            return False  # incomplete multi-byte character; wait for more tokens
        return self.out.extend(piece, look=self.count >= self.min_tokens)

    def delta(self, final: bool = False) -> str:
        """Text not yet returned that can be returned now."""
        return self.out.delta(final)
