"""Which drafter a start uses when it has more than one (docs/drafts.md 7).

The candidates are the drafters a start has loaded: the DSpark drafts named by --draft
(given more than once) or the demo's, and the target's own MTP head (`--draft mtp`, or a
target pack that carries one). Plain decoding is always one more. serve and chat measure
each candidate on this machine at start, with the decoder's own rounds:

- `cost`: what a round costs in plain steps (calibrate.measure_break_even, the figure
  the decoder's fallback then reads);
- `tokens`: the tokens a round emits on average, greedy, after CALIBRATION_PROMPTS
  rendered by the target's chat template (calibrate.measure_acceptance).

A candidate's expected speed is tokens / cost times plain decoding's. It pays when a
round costs at most (1 - PAY_MARGIN) x the tokens it emits, the margin the break-even
check keeps (calibrate.py): a figure near the cut would swing across it from start to
start. The fastest candidate that pays is used; none paying, plain decoding. The
costs are measured first: a candidate whose round could not pay even if every proposal
were accepted is not run on the prompts (MLX's Linux CPU wheel, where a round of 8 rows
costs 8-10 plain steps). A sequential drafter (MTP: one head step per proposal) also gets its proposals per round
chosen: its cost is measured at 1 and at the most proposals, the best count is picked
with the cost linear between them, then measured itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runtime.calibrate import BreakEven, measure_acceptance, measure_break_even, pays
from .runtime.decoder import Decoder
from .runtime.drafter import check_gamma
from .sampling import SamplingParams
from .tokenizer import TokenizerError

# What a coding assistant's user asks: code, an explanation, an API question. Greedy
# acceptance on them is the same at every start (the measurement's noise is the cost's).
CALIBRATION_PROMPTS = (
    "Write a Python function that reads a CSV file and returns its rows as a list of dicts.",
    "What does the function `json.dumps` do?",
    "Explain the difference between a list and a tuple in Python, with a short example.",
)
CALIBRATION_TOKENS = 48  # generated after each prompt


@dataclass(frozen=True)
class Candidate:
    name: str  # as the logs and /stats name it: the draft's source, or "mtp"
    drafter: object  # a runtime.drafter.Drafter


@dataclass(frozen=True)
class Measured:
    candidate: Candidate
    gamma: int  # proposals per round
    cost: BreakEven  # a round's cost in plain steps
    tokens: float | None  # tokens a round emits on the calibration prompts; None: not measured (cannot pay)

    @property
    def speed(self) -> float:
        """Expected decode speed relative to plain decoding's (the most a round could
        emit where acceptance was not measured)."""
        return (self.gamma + 1 if self.tokens is None else self.tokens) / self.cost.steps

    @property
    def pays(self) -> bool:
        return self.tokens is not None and pays(self.cost.steps, self.tokens)

    def describe(self) -> str:
        cost = f"a round of {self.gamma} proposals costs {self.cost.describe()}"
        if self.tokens is None:
            return (f"{self.candidate.name}: {cost}: cannot pay even if it emitted all {self.gamma + 1} tokens "
                    "(acceptance not measured)")
        return (f"{self.candidate.name}: {self.tokens:.2f} tokens a round, {cost}: {self.speed:.2f}x plain"
                + ("" if self.pays else ", does not pay"))


def calibration_prompts(tokenizer) -> list[list[int]]:
    """CALIBRATION_PROMPTS as the target's chat template renders them (the plain text
    where the tokenizer has no template)."""
    try:
        return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CALIBRATION_PROMPTS]
    except TokenizerError:
        return [tokenizer.encode(text) for text in CALIBRATION_PROMPTS]


def measure(model, candidate: Candidate, gamma: int, prompts, stops=frozenset(), fixed_gamma: bool = True) -> Measured:
    """`candidate` measured at `gamma` proposals a round, or (a sequential drafter,
    without `fixed_gamma`) at the count in 1..gamma with the best expected speed. The
    costs come first: a drafter that could not pay even if every proposal were accepted
    is not run on the calibration prompts."""
    drafter, params = candidate.drafter, SamplingParams()
    top = measure_break_even(model, drafter, gamma, params)
    sequential = not fixed_gamma and gamma > 1 and drafter.sequential
    one = measure_break_even(model, drafter, 1, params) if sequential else None
    counts = range(1, gamma + 1) if sequential else [gamma]

    def cost(g: int) -> float:
        return top.steps if one is None else one.steps + (top.steps - one.steps) * (g - 1) / (gamma - 1)

    if not any(pays(cost(g), g + 1) for g in counts):
        best = max(counts, key=lambda g: (g + 1) / cost(g))
        return Measured(candidate, best, top if best == gamma else one, None)
    acceptance = measure_acceptance(model, drafter, gamma, prompts, CALIBRATION_TOKENS, stops)
    best = max(counts, key=lambda g: acceptance.tokens(g) / cost(g))
    measured = top if best == gamma else one if best == 1 else measure_break_even(model, drafter, best, params)
    return Measured(candidate, best, measured, acceptance.tokens(best))


def choose(measured: list[Measured]) -> Measured | None:
    """The fastest candidate that pays; None: plain decoding."""
    return max((m for m in measured if m.pays), key=lambda m: m.speed, default=None)


def report(measured: list[Measured], chosen: Measured | None) -> str:
    """The log line: every candidate's figures and the one chosen (the start's decision
    is engine_setup.decision's line, once the decoder is made)."""
    figures = "; ".join(m.describe() for m in measured)
    best = (f"best: {chosen.candidate.name} ({chosen.gamma} proposals a round)" if chosen
            else "none pays here")
    return (f"drafters measured on {len(CALIBRATION_PROMPTS)} calibration prompts: {figures}; plain decoding: 1.00x; "
            f"{best} (one --draft forces a drafter)")


@dataclass(frozen=True)
class Choice:
    """The drafter a start uses (None: plain decoding) and, where it was measured against
    the others, its proposals a round and its round's cost; or why none drafts."""

    candidate: Candidate | None
    gamma: int | None = None
    cost: BreakEven | None = None
    not_drafting: str | None = None
    spare: Measured | None = None  # none pays: the fastest candidate, for requests that ask to draft


def on_request(choice: Choice, decoder, args, model):
    """(a decoder that drafts every round, its draft's name) for requests that ask to be
    drafted (`monolith.draft`), or (None, None): the start's drafting decoder's drafter,
    else the drafter chosen but not drafting (its round cannot pay), else the fastest
    measured (none pays): the demo's draft and MTP head are tiny beside the target."""
    if decoder is not None:  # it drafts already: a request that asks drafts with its fallback off
        drafter, gamma, name = decoder.drafter, decoder.gamma, choice.candidate.name
    elif choice.candidate is not None:
        drafter, gamma, name = choice.candidate.drafter, choice.gamma, choice.candidate.name
    elif choice.spare is not None:
        drafter, gamma, name = choice.spare.candidate.drafter, choice.spare.gamma, choice.spare.candidate.name
    else:
        return None, None
    try:
        gamma = gamma or check_gamma(args.draft_block_size, drafter.max_proposals)
    except ValueError:
        return None, None
    return Decoder(model, drafter, args.max_context, args.prefill_chunk_size, gamma), name


def choose_drafter(args, plan, model, tokenizer, candidates: list[Candidate], log,
                   fallback: bool = True) -> Choice:
    """The drafter a start uses among `candidates`, as the flags (`args`, `plan`: an
    model_flags.ModelPlan) say: the one --draft forces; the first where nothing is
    measured (generate, a named --spec-sched); else the one with the best expected
    tokens per second, or none (the module doc). Candidates that cannot run as the
    flags ask (a --draft-block-size past their proposals) are left out with a note."""
    if not candidates:
        return Choice(None)
    if plan.forced or not fallback or args.spec_sched is not None:
        if len(candidates) > 1:
            why = "generate measures nothing" if not fallback else f"--spec-sched {args.spec_sched} measures nothing"
            log(f"{why}: {candidates[0].name} is used, the first of {len(candidates)} drafters")
        return Choice(candidates[0])
    block, usable = args.draft_block_size, []
    for c in candidates:
        if block is None or block <= c.drafter.max_proposals:
            usable.append(c)
        else:
            log(f"{c.name} is not used: --draft-block-size {block} is past its {c.drafter.max_proposals} "
                "proposals a round")
    if not usable:
        return Choice(None, not_drafting=f"drafts loaded, not drafting: --draft-block-size {block} is past every "
                                         "draft's proposals a round")
    prompts, stops = calibration_prompts(tokenizer), frozenset(tokenizer.eos_token_ids)
    measured = [measure(model, c, check_gamma(block, c.drafter.max_proposals), prompts, stops,
                        fixed_gamma=block is not None) for c in usable]
    chosen = choose(measured)
    log(report(measured, chosen))
    if chosen is None:
        figures = ", ".join(f"{m.candidate.name} {m.speed:.2f}x plain" for m in measured)
        return Choice(None, not_drafting=f"drafts loaded, not drafting: none pays here ({figures})",
                      spare=max(measured, key=lambda m: m.speed))
    return Choice(chosen.candidate, chosen.gamma, chosen.cost)


def decision(draft_name: str | None, not_drafting: str | None, args) -> str:
    """The one log line that says how a start decodes, once its decoder is made."""
    if draft_name:
        how = ("measured to pay here" if args.spec_sched is None else f"--spec-sched {args.spec_sched}: always")
        return f"decoding: drafting with {draft_name} ({how})"
    if not_drafting:
        return f"decoding: plain ({not_drafting})"
    return "decoding: plain (no draft)"
