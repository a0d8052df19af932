"""Telemetry: what happened to each row (``RowRecord``, the one owner of a row's counts) and to a whole call
(``GenerationStats``: its steps, timings and the records of its rows)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace


@dataclass
class SourceCounts:
    """One drafter's share of a row's drafting (a composite's lookup and model are counted apart), by row step."""

    consulted: int = 0  # row steps that asked it for a draft
    hits: int = 0  # ... where it had one (a lookup's continuation was found; a model always has one)
    drafts: int = 0  # blocks of its drafts the target scored
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, consulted: int = 0, hits: int = 0, draft_length: int = 0, accepted: int = 0) -> None:
        self.consulted += consulted
        self.hits += hits
        self.drafts += draft_length > 0
        self.draft_tokens += draft_length
        self.accepted_tokens += accepted

    def merge(self, other: SourceCounts) -> None:
        for name in ("consulted", "hits", "drafts", "draft_tokens", "accepted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(hit_rate=self.hits / self.consulted if self.consulted else 0.0,
                   acceptance_rate=self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                   mean_draft_length=self.draft_tokens / self.drafts if self.drafts else 0.0)
        return out


_SUMMED = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens",
           "target_passes", "num_drafts", "tree_drafts", "tree_nodes", "forks_won")


@dataclass
class RowRecord:
    """What happened to one row (one sequence of a request): the single owner of its counts, which the batch
    counts into and the engine's ``FinishEvent``, the server's responses and ``/metrics``, offline output rows and
    ``GenerationStats`` read. A sum of records (``sum_records``: the engine's totals, a request's choices) is a
    record too; the rates are derived here only."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # ... of them a prompt cache held already (not evaluated again)
    completion_tokens: int = 0  # tokens emitted (EOS included; past a stop string too)
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # ... and kept by the target
    num_drafts: int = 0  # target passes in which the row had at least one draft
    target_passes: int = 0  # target passes that committed tokens for the row
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: times draft i of a block was kept
    sources: dict[str, SourceCounts] = field(default_factory=dict)  # per drafter: its share of the drafting
    tree_drafts: int = 0  # target passes in which the row's drafts were a tree (``core/tree.py``)
    tree_nodes: int = 0  # ... their nodes, all branches
    forks_won: int = 0  # ... passes whose accepted path left the first branch (tokens a chain would have lost)
    time_to_first_token_s: float | None = None  # from ``started`` (a row's own; not summed)
    total_time_s: float | None = None  # from ``started`` to its end, set by whoever ends it (the engine)
    started: float = field(default_factory=time.perf_counter, repr=False, compare=False)  # the row's creation

    def count_step(self, draft_length: int, num_accepted: int) -> None:
        """One target pass that committed tokens for the row: ``draft_length`` drafts, ``num_accepted`` kept."""
        self.draft_tokens += draft_length
        self.accepted_tokens += num_accepted
        self.target_passes += 1
        self.num_drafts += draft_length > 0
        _add_into(self.accepted_per_position, [1] * num_accepted)

    def count_tree(self, nodes: int, fork_won: bool) -> None:
        """One pass that scored a draft tree of ``nodes`` nodes for the row (its accepted depth is counted by
        ``count_step``); ``fork_won``: the accepted path left the first branch."""
        self.tree_drafts += 1
        self.tree_nodes += nodes
        self.forks_won += fork_won

    def count_source(self, name: str, **values: int) -> None:
        """Add to drafter ``name``'s share (created at first use): ``SourceCounts.add``'s arguments."""
        self.sources.setdefault(name, SourceCounts()).add(**values)

    def add(self, other: RowRecord) -> RowRecord:
        """Add ``other``'s counts to this record (times are a row's own: not summed); returns this record."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        _add_into(self.accepted_per_position, other.accepted_per_position)
        for name, counts in other.sources.items():
            self.sources.setdefault(name, SourceCounts()).merge(counts)
        return self

    @property
    def acceptance_rate(self) -> float:
        """Kept over proposed drafts (0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens emitted per target pass (1.0 for the target alone)."""
        return self.completion_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Drafts per target pass (passes without drafts included)."""
        return self.draft_tokens / self.target_passes if self.target_passes else 0.0


def sum_records(records: Iterable[RowRecord]) -> RowRecord:
    """The records' counts summed into a new record."""
    return functools.reduce(RowRecord.add, records, RowRecord())


def _from_rows(name: str, per_row: bool = False) -> property:
    """A ``GenerationStats`` count read from its rows' records: their sum, or (``per_row``) one entry per row."""
    return property(lambda self: (list if per_row else sum)(getattr(record, name) for record in self.rows or ()))


# ``to_dict``'s keys beside the fields: the counts read from the records and the rates.
_READ_OUT = ("draft_tokens", "accepted_tokens", "generated_tokens", "row_steps", "row_draft_tokens",
             "row_accepted_tokens", "row_target_passes", "acceptance_rate", "per_position_acceptance",
             "conditional_acceptance", "iid_acceptance", "mean_accepted_length", "tokens_per_target_pass",
             "tokens_per_row_step", "tokens_per_second", "mean_draft_length", "tree_drafts", "tree_nodes", "forks_won")


@dataclass
class GenerationStats:
    """Counters for one ``generate`` call (all rows together): its steps and timings, and its rows' records.

    A *step* is one target forward pass over the whole active batch; a *row step* is one row's share of it. Token
    counts (``draft_tokens``, ``sources``, the ``row_*`` lists, ...) are read from ``rows``, the records of the
    rows its batch was given, in order (for ``generate``: by prompt index)."""

    num_draft_tokens: int | str = 0  # the gamma setting ("auto" or a fixed number)
    steps: int = 0
    mixed_steps: int = 0  # steps where rows of the batch kept different numbers of drafts
    target_calls: int = 0  # target forward passes, prefill included
    draft_calls: int = 0  # draft forward passes, prefill included
    accepted_length_histogram: list[int] = field(default_factory=list)  # [n] = row steps that kept n drafts
    position_proposed: list[int] = field(default_factory=list)  # [j] = drafts proposed at block position j
    position_accepted: list[int] = field(default_factory=list)  # [j] = drafts kept at block position j
    position_judged: list[int] = field(default_factory=list)  # [j] = drafts at j whose predecessors were all kept
    draft_length_steps: list[int] = field(default_factory=list)  # [k] = steps that drafted k columns
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    # The speculation controller (verispec.policy.controller): steps it decided by reason, and its last
    # decision (cap, reason, expected tokens per second at the cap and with the target alone).
    controller_steps: dict[str, int] = field(default_factory=dict)
    controller_last: dict | None = None
    # None keeps no records: the engine's batches, which may run for days (its rows' records go out with their
    # FinishEvents)
    rows: list[RowRecord] | None = field(default_factory=list)

    def record_step(self, gamma: int, draft_lengths: list[int], num_accepted: list[int]) -> None:
        """Count one verification step: what each active row drafted and kept, by block position (the rows'
        own totals are their records')."""
        self.steps += 1
        self.mixed_steps += len(set(num_accepted)) > 1
        _add_into(self.draft_length_steps, [0] * gamma + [1])
        _add_into(self.accepted_length_histogram, [0] * (gamma + 1))
        for values in (self.position_proposed, self.position_accepted, self.position_judged):
            _add_into(values, [0] * gamma)  # every position up to the step's columns, kept or not
        for length, accepted in zip(draft_lengths, num_accepted):
            self.accepted_length_histogram[accepted] += 1
            _add_into(self.position_proposed, [1] * length)
            _add_into(self.position_accepted, [1] * accepted)
            _add_into(self.position_judged, [1] * min(accepted + 1, length))  # none after a rejection

    def record_decision(self, decision: dict) -> None:
        """The controller's decision for this step (``CapDecision.to_dict()``)."""
        self.controller_last = decision
        self.controller_steps[decision["reason"]] = self.controller_steps.get(decision["reason"], 0) + 1

    @property
    def total(self) -> RowRecord:
        """The rows' records summed."""
        return sum_records(self.rows or ())

    draft_tokens = _from_rows("draft_tokens")
    accepted_tokens = _from_rows("accepted_tokens")
    generated_tokens = _from_rows("completion_tokens")
    row_steps = _from_rows("target_passes")
    row_draft_tokens = _from_rows("draft_tokens", per_row=True)
    row_accepted_tokens = _from_rows("accepted_tokens", per_row=True)
    row_target_passes = _from_rows("target_passes", per_row=True)
    tree_drafts = _from_rows("tree_drafts")  # a tree's nodes count as its draft tokens (``draft_tokens``)
    tree_nodes = _from_rows("tree_nodes")
    forks_won = _from_rows("forks_won")

    @property
    def sources(self) -> dict[str, SourceCounts]:
        """Per drafter ("model", "suffix", "ngram", ...; a composite's two apart): its share over the rows."""
        return self.total.sources

    @property
    def mean_draft_length(self) -> float:
        """Draft columns per step, averaged over steps (a step's; a row's is ``RowRecord.mean_draft_length``)."""
        return sum(k * n for k, n in enumerate(self.draft_length_steps)) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens the target kept (0 when nothing was proposed)."""
        return self.total.acceptance_rate

    @property
    def per_position_acceptance(self) -> list[float]:
        """[j] = P(draft at block position j kept | it was proposed)."""
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """[j] = P(draft at block position j kept | every draft before it was kept): the per-position rates
        that the acceptance estimates (``verispec.policy``) use. Drafts after a rejection are never judged."""
        return [a / n if n else 0.0 for a, n in zip(self.position_accepted, self.position_judged)]

    @property
    def iid_acceptance(self) -> float:
        """One per-draft acceptance rate, as in Leviathan et al.'s formula: the censored geometric MLE, kept
        drafts over judged drafts (``acceptance_rate`` divides by proposed drafts and so underestimates it)."""
        judged = sum(self.position_judged)
        return sum(self.position_accepted) / judged if judged else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Average drafts kept per row step."""
        return self.accepted_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens emitted per row per target pass (1.0 for the target alone): the server's name for it too."""
        return self.total.tokens_per_target_pass

    @property
    def tokens_per_row_step(self) -> float:
        """Deprecated name of :attr:`tokens_per_target_pass` (kept for one release, also in ``to_dict``)."""
        return self.tokens_per_target_pass

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(replace(self, rows=[]))
        del out["rows"]  # read out below as the totals and ``row_*`` lists users know
        out.update({name: getattr(self, name) for name in _READ_OUT})
        out["sources"] = {name: counts.to_dict() for name, counts in sorted(self.sources.items())}
        return out


def _add_into(values: list[int], more: Sequence[int]) -> list[int]:
    """``values`` plus ``more`` elementwise, in place (grown to the longer of the two); returns ``values``."""
    values.extend([0] * (len(more) - len(values)))
    for i, count in enumerate(more):
        values[i] += count
    return values
