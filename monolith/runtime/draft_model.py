"""The proposer over a loaded DSpark / DFlash draft model (monolith.models.dspark): the
draft's K/V of the committed context rows live in a `DraftContext`, which the drafter
owns and hands out as its snapshot.

Observed rows wait (`waiting`) until the context is next used (a proposal, a snapshot,
its arrays), so that in a batch the rows every sequence observed since its last
proposal go through the draft's projections in one packed append
(`append_together`, batch.run_proposals)."""

from __future__ import annotations

import mlx.core as mx

from ..models.dspark import Proposal
from ..sampling import SamplingParams
from .drafter import Forking, Guided


class DraftModelDrafter(Forking, Guided):
    """A `Drafter` (drafter.py) over a draft model, also Forking and Guided."""

    def __init__(self, draft):
        self.draft = draft
        self.taps = list(draft.taps)
        self.max_proposals = int(draft.max_proposals)
        self.context = None
        self.waiting: list[mx.array] = []  # features observed, not yet in the context

    def __repr__(self) -> str:
        return f"DraftModelDrafter(taps={self.taps}, max_proposals={self.max_proposals})"

    def fork(self) -> DraftModelDrafter:
        """A drafter over the same draft model with a context of its own (one per
        sequence of a batch)."""
        return DraftModelDrafter(self.draft)

    def start(self, max_context: int) -> None:
        self.context = self.draft.make_context(max_context)
        self.waiting = []

    def observe(self, features: mx.array) -> None:
        if self.context is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        self.waiting.append(features)

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None,
                hidden: mx.array | None = None) -> Proposal:
        """`hidden`: the block's hidden states when they ran batched (Draft.forward_batch)."""
        return self.draft.propose(self._context(), anchor, gamma, params, key=key, hidden=hidden)

    def propose_guided(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None, guide,
                       limit: int, hidden: mx.array | None = None) -> Proposal:
        return self.draft.propose_guided(self._context(), anchor, gamma, params, key, guide, limit, hidden=hidden)

    def arrays(self) -> list[mx.array]:
        return self._context().arrays()

    def make_context(self, max_context: int):
        return self.draft.make_context(max_context)

    def append_together(self, drafters: list[DraftModelDrafter]) -> None:
        append_waiting(drafters)

    def snapshot(self):
        return None if self.context is None else self._context()

    def restore(self, snapshot, rows: int) -> bool:
        if snapshot is None or snapshot.offset < rows:
            return False
        snapshot.restore(rows)
        self.context, self.waiting = snapshot, []
        return True

    def _context(self):
        if self.context is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        if self.waiting:
            append_waiting([self])
        return self.context


def append_waiting(drafters: list[DraftModelDrafter]) -> None:
    """Append the rows each drafter observed since its context was last used, in one
    packed append per draft model (a drafter whose rows do not fit keeps them and fails
    at its next use, alone)."""
    groups: dict[int, list[DraftModelDrafter]] = {}
    for d in drafters:
        if d.waiting:
            groups.setdefault(id(d.draft), []).append(d)
    for members in groups.values():
        items = [(d.context, d.waiting[0] if len(d.waiting) == 1 else mx.concatenate(d.waiting)) for d in members]
        try:
            members[0].draft.append_batch(items)
        except ValueError:  # CacheError too: each alone, so only the culprit raises
            if len(members) == 1:
                raise
            for d, item in zip(members, items):
                try:
                    d.draft.append_batch([item])
                except ValueError:
                    continue
                d.waiting = []
            continue
        for d in members:
            d.waiting = []

