"""The proposer over a loaded DSpark / DFlash draft model (monolith.models.dspark): the
draft's K/V of the committed context rows live in a `DraftContext`, which the drafter
owns and hands out as its snapshot."""

from __future__ import annotations

import mlx.core as mx

from ..models.dspark import Proposal
from ..sampling import SamplingParams


class DraftModelDrafter:
    """A `Drafter` (drafter.py) over a draft model."""

    def __init__(self, draft):
        self.draft = draft
        self.taps = list(draft.taps)
        self.max_proposals = int(draft.max_proposals)
        self.context = None

    def __repr__(self) -> str:
        return f"DraftModelDrafter(taps={self.taps}, max_proposals={self.max_proposals})"

    def fork(self) -> DraftModelDrafter:
        """A drafter over the same draft model with a context of its own (one per
        sequence of a batch)."""
        return DraftModelDrafter(self.draft)

    def start(self, max_context: int) -> None:
        self.context = self.draft.make_context(max_context)

    def observe(self, features: mx.array) -> None:
        self.draft.append_context(self._context(), features)

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None,
                hidden: mx.array | None = None) -> Proposal:
        """`hidden`: the block's hidden states when they ran batched (Draft.forward_batch)."""
        return self.draft.propose(self._context(), anchor, gamma, params, key=key, **_given(hidden))

    def propose_guided(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None, guide,
                       limit: int, hidden: mx.array | None = None) -> Proposal:
        return self.draft.propose_guided(self._context(), anchor, gamma, params, key, guide, limit, **_given(hidden))

    def arrays(self) -> list[mx.array]:
        return self._context().arrays()

    def snapshot(self):
        return self.context

    def restore(self, snapshot, rows: int) -> bool:
        if snapshot is None or snapshot.offset < rows:
            return False
        snapshot.restore(rows)
        self.context = snapshot
        return True

    def _context(self):
        if self.context is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        return self.context


def _given(hidden) -> dict:  # TEMP until Draft.propose takes hidden=
    return {} if hidden is None else {"hidden": hidden}
