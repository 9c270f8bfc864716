"""Speculation in the stream: the opt-in `monolith` field of a chat request
(docs/serving.md, "Speculation in the stream"; docs/api-fields.md).

With `"monolith": {"spec": true}`, each streamed chat chunk whose delta carries text also
carries `delta.monolith.spec`: the text cut into pieces by how its tokens came
(runtime/events.py: accepted, correction, bonus, plain; runtime/textstream.py cuts the
engine's text), each piece with its part (reasoning or content); and the chunk that
carries `finish_reason` carries the reply's speculation stats (`stats_of`), as does the
non-streamed response. The pieces follow the reasoning splitter and the tool-call parser
by where each piece of their output lies in their input (their `spans`): `SpecPieces`.
"""

from __future__ import annotations

from bisect import bisect_right

from ...runtime.events import PLAIN, Delta, Finished, merge_pieces
from ..reasoning import ReasoningSplitter
from ..tools.calls import ToolCallParser

FIELD = "monolith"  # the request's option (requests.MonolithOptions) and the reply's key


def stats_of(finished: Finished) -> dict:
    """The reply's speculation stats, from the engine's Finished event (zeros and empty
    lists for plain decoding): with a fallback, its plain rounds and its switches between
    drafted and plain rounds (docs/drafts.md 4.2)."""
    spec, usage, stats = finished.spec, finished.usage, finished.speculative
    rounds = spec.drafts if spec else 0
    return {"rounds": rounds, "draft_tokens": spec.draft_tokens if spec else 0,
            "accepted_tokens": spec.accepted_tokens if spec else 0,
            "accepted_per_position": list(spec.accepted_per_position) if spec else [],
            "acceptance_length": spec.acceptance_length if spec else 0.0,
            "decode_tok_s": finished.decode_tok_s, "prefill_tok_s": finished.prefill_tok_s,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "plain_rounds": stats.plain_rounds if stats else 0,
            "switches": [s.as_json() for s in stats.switches] if stats else []}


def spec_entries(pieces, part: str) -> dict:
    """A delta's `monolith` object for its (text, how) pieces of `part`."""
    return {"spec": [{"text": text, "how": how, "part": part} for text, how in pieces]}


class Track:
    """Text in order with how each character came: (text, how) pieces added, cut out
    again by offsets. The pieces are kept as they came (no growing string to copy on
    every delta)."""

    def __init__(self):
        self.length = 0
        self.starts: list[int] = []
        self.pieces: list[tuple[str, str]] = []

    def add(self, pieces) -> None:
        for text, how in pieces:
            if text:
                self.starts.append(self.length)
                self.pieces.append((text, how))
                self.length += len(text)

    def cut(self, start: int, end: int) -> tuple[tuple[str, str], ...]:
        """The pieces of the text [start, end)."""
        i, pieces = max(bisect_right(self.starts, start) - 1, 0), []
        while i < len(self.starts) and self.starts[i] < end:
            at, (text, how) = self.starts[i], self.pieces[i]
            pieces.append((text[max(start - at, 0):end - at], how))
            i += 1
        return merge_pieces(pieces)


class SpecPieces:
    """The pieces of a streamed chat reply's reasoning and content: the deltas' pieces,
    cut where the splitter and the parser (None without tools) put their text."""

    def __init__(self, splitter: ReasoningSplitter, parser: ToolCallParser | None):
        self.splitter, self.parser = splitter, parser
        splitter.spans = []
        if parser is not None:
            parser.spans = []
        self.fed = Track()  # the deltas' text, as the splitter was fed it
        self.content = Track()  # the splitter's content, as the parser was fed it

    def add(self, delta: Delta) -> None:
        """A delta about to be fed to the splitter (text without pieces counts as plain)."""
        same = "".join(text for text, _ in delta.spec) == delta.text
        self.fed.add(delta.spec if same else ((delta.text, PLAIN),))

    def take(self) -> tuple[tuple, tuple]:
        """(reasoning pieces, content pieces) of what the splitter and the parser gave out
        since the last call."""
        reasoning, content = [], []
        spans, self.splitter.spans = self.splitter.spans, []
        for part, start, end in spans:
            pieces = self.fed.cut(start, end)
            if part == "reasoning":
                reasoning += pieces
            elif self.parser is None:
                content += pieces
            else:
                self.content.add(pieces)
        if self.parser is not None:
            spans, self.parser.spans = self.parser.spans, []
            for start, end in spans:
                content += self.content.cut(start, end)
        return merge_pieces(reasoning), merge_pieces(content)
