"""Sequences that share each forward: a decoder is written as a generator of the model
work it needs (`Forward`: rows of one sequence through the target; `Propose`: one
draft block), and whoever drives it decides whether that work runs alone (`drive`) or
packed with other sequences' (`Batch`).

    steps = decoder.steps(session, prompt, ...)   # a generator
    work = next(steps)                             # a Forward, a Propose or a Peers
    work = steps.send(result)                      # ... until StopIteration(outcome)

A `Peers` item asks about the batch instead (what the other sequences put into the
last forward: the batch-aware schedulers read it). A `Batch` steps every sequence at
once: first the draft blocks of the sequences that
draft (packed through the draft model: `Draft.forward_batch`), until every sequence
waits on a target forward, then one target forward over all their rows
(`forward_batch`: the linears see every sequence's rows, attention and the gated
DeltaNet run per sequence on its own cache). A sequence's host work between two
work items (sampling, acceptance, commit, the token callbacks) is the same as when it
runs alone, so a greedy sequence's output in a batch is its output alone.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from ..models.qwen3_5 import Segment
from ..sampling import SamplingParams

Steps = Generator  # a decoder's steps: yields Forward / Propose, receives their results, returns its outcome


@dataclass
class Forward:
    """Rows `tokens` of one sequence through `model` at `cache`'s offset: the result is
    what model.forward(tokens, cache, taps, logits) returns, (logits, tap features)."""

    model: object
    tokens: object  # int32 mx.array [T]
    cache: object
    taps: tuple = ()
    logits: str = "all"
    features: tuple | None = None  # image rows' features and the rows' multimodal positions (a prefill
    positions: object = None  # chunk with images: runtime/images.py), as models/qwen3_5.Segment takes them

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def segment(self) -> Segment:
        return Segment(self.tokens, self.cache, tuple(self.taps), self.logits, self.features, self.positions)

    def run(self):
        if self.features is None and self.positions is None:
            return self.model.forward(self.tokens, self.cache, taps=list(self.taps), logits=self.logits)
        return self.model.forward_batch([self.segment()])[0]


@dataclass
class Propose:
    """One draft block after `anchor` (drafter.propose, or propose_guided with a guide):
    the result is the drafter's Proposal."""

    drafter: object
    anchor: int
    gamma: int
    params: SamplingParams
    key: object
    guide: object = None
    limit: int = 0
    extra: dict = field(default_factory=dict)  # hidden=... when the block ran batched

    def run(self):
        if self.guide is None:
            return self.drafter.propose(self.anchor, self.gamma, self.params, self.key, **self.extra)
        return self.drafter.propose_guided(self.anchor, self.gamma, self.params, self.key, self.guide, self.limit,
                                           **self.extra)


@dataclass
class Peers:
    """A question, not work: the result is (the other sequences of the batch, the target
    rows they put into the latest forward); (0, 0) alone. Schedulers that know the
    batch ask it before a round (scheduler.py)."""

    def run(self) -> tuple[int, int]:
        return (0, 0)


def drive(steps: Steps):
    """Run a decoder's steps alone, each work item as it comes; its outcome."""
    try:
        work = next(steps)
        while True:
            work = steps.send(work.run())
    except StopIteration as stop:
        return stop.value


def run_forwards(items: list[Forward]) -> list:
    """The results of target forwards of different sequences, one packed forward per
    model (each alone where the model cannot pack)."""
    results = [None] * len(items)
    for model, members in _groups(items, lambda r: r.model).items():
        batched = getattr(model, "forward_batch", None)
        if batched is None or len(members) == 1:
            for i in members:
                results[i] = items[i].run()
            continue
        outs = batched([items[i].segment() for i in members])
        for i, out in zip(members, outs):
            results[i] = out
    return results


def run_proposals(items: list[Propose]) -> list:
    """The Proposals of different sequences' draft blocks: the rows each drafter observed
    since its last proposal, then the blocks, run through each draft model packed; then
    the greedy sequences' proposals are drawn together (`propose_batch`: one chain, slot
    after slot) and every other sequence draws its own."""
    results = [None] * len(items)
    groups = _groups(items, lambda r: r.drafter.draft)
    for draft, members in groups.items():
        if draft is not None:
            items[members[0]].drafter.append_together([items[i].drafter for i in members])
    for draft, members in groups.items():
        if draft is not None and len(members) > 1:
            hidden = draft.forward_batch([(items[i].drafter.context, items[i].anchor) for i in members])
            for i, h in zip(members, hidden):
                items[i].extra = {"hidden": h}
            chained = [i for i in members if items[i].guide is None and items[i].params.greedy]
            if len(chained) > 1:
                proposals = draft.propose_batch([(items[i].anchor, items[i].gamma, items[i].extra["hidden"])
                                                 for i in chained], items[chained[0]].params)
                for i, proposal in zip(chained, proposals):
                    results[i] = proposal
        for i in members:
            if results[i] is None:
                results[i] = items[i].run()
    return results


def _groups(items, key) -> dict:
    groups: dict = {}
    for i, r in enumerate(items):
        groups.setdefault(key(r), []).append(i)
    return groups


class Member:
    """One sequence in a Batch: its steps and the work item it waits on (a Forward, a
    Propose or a Peers; None once done);
    `owner` is the caller's (the engine's Job)."""

    def __init__(self, steps: Steps, owner=None):
        self.steps = steps
        self.owner = owner
        self.work = None
        self.rows = 0  # target rows of its latest forward
        self.done = False
        self.outcome = None
        self.error: BaseException | None = None  # what ended the steps, if they raised

    def send(self, result=None, error: BaseException | None = None) -> None:
        try:
            if error is not None:
                self.work = self.steps.throw(error)
            elif self.work is None:
                self.work = next(self.steps)
            else:
                self.work = self.steps.send(result)
        except StopIteration as stop:
            self.work, self.done, self.outcome = None, True, stop.value
        except Exception as e:  # noqa: BLE001 - the steps raised: this sequence ends, the others go on
            self.work, self.done, self.error = None, True, e


class Batch:
    """The sequences that step together (see the module doc). A sequence's steps handle
    their own errors; an error of the shared work is retried sequence by sequence, so
    only the sequence it belongs to sees it (thrown into its steps)."""

    def __init__(self):
        self.members: list[Member] = []

    def __len__(self) -> int:
        return len(self.members)

    def add(self, steps: Steps, owner=None) -> Member:
        """Start a sequence: it runs to its first work item (or to its end)."""
        member = Member(steps, owner)
        member.send()
        if not member.done:
            self.members.append(member)
        return member

    def step(self) -> list[Member]:
        """One round of every sequence: its draft block if it drafts, then its rows of one
        shared target forward. Returns the sequences that ended (removed)."""
        while True:
            asking = [s for s in self.members if isinstance(s.work, Peers)]
            total = sum(s.rows for s in self.members)
            for s in asking:
                s.send((len(self.members) - 1, total - s.rows))
            drafting = [s for s in self.members if isinstance(s.work, Propose)]
            if drafting:
                self._run(drafting, run_proposals)
            elif not asking:
                break
        forwarding = [s for s in self.members if isinstance(s.work, Forward)]
        for s in forwarding:
            s.rows = s.work.rows
        if forwarding:
            self._run(forwarding, run_forwards)
        ended = [s for s in self.members if s.done]
        self.members = [s for s in self.members if not s.done]
        return ended

    def rows(self) -> int:
        """Target rows the sequences wait to run (plain: 1; a verify: 1 + proposals)."""
        return sum(s.work.rows for s in self.members if isinstance(s.work, Forward))

    @staticmethod
    def _run(members: list[Member], run) -> None:
        try:
            results = run([s.work for s in members])
        except Exception:  # noqa: BLE001 - find whose work failed: each alone
            for s in members:
                try:
                    result = run([s.work])[0]
                except Exception as e:  # noqa: BLE001 - reported to that sequence only
                    s.send(error=e)
                else:
                    s.send(result)
            return
        for s, result in zip(members, results):
            s.send(result)
