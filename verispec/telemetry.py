"""Per-request telemetry: what the draft proposed, what the target kept, and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SourceCounts:
    """One drafter's share of the drafting (a composite's lookup and model are counted apart), by row step."""

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


def count_source(counts: dict[str, SourceCounts], name: str, **values: int) -> None:
    """Add to ``counts[name]`` (created at first use): ``SourceCounts.add``'s arguments."""
    counts.setdefault(name, SourceCounts()).add(**values)


@dataclass
class GenerationStats:
    """Counters for one ``generate`` call (all rows together).

    A *step* is one target forward pass over the whole active batch; a *row step* is one row's share of it.
    """

    num_draft_tokens: int | str = 0  # the gamma setting ("auto" or a fixed number)
    steps: int = 0
    row_steps: int = 0
    mixed_steps: int = 0  # steps where rows of the batch kept different numbers of drafts
    target_calls: int = 0  # target forward passes, prefill included
    draft_calls: int = 0  # draft forward passes, prefill included
    draft_tokens: int = 0  # draft tokens proposed (summed over rows)
    accepted_tokens: int = 0  # draft tokens the target kept
    generated_tokens: int = 0  # tokens emitted (summed over rows)
    accepted_length_histogram: list[int] = field(default_factory=list)  # [n] = row steps that kept n drafts
    position_proposed: list[int] = field(default_factory=list)  # [j] = drafts proposed at block position j
    position_accepted: list[int] = field(default_factory=list)  # [j] = drafts kept at block position j
    position_judged: list[int] = field(default_factory=list)  # [j] = drafts at j whose predecessors were all kept
    draft_length_steps: list[int] = field(default_factory=list)  # [k] = steps that drafted k columns
    row_draft_tokens: list[int] = field(default_factory=list)  # per prompt row: drafts proposed
    row_accepted_tokens: list[int] = field(default_factory=list)  # per prompt row: drafts kept
    row_target_passes: list[int] = field(default_factory=list)  # per prompt row: target passes it took part in
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    # The speculation controller (verispec.policy.controller): steps it decided by reason, and its last
    # decision (cap, reason, expected tokens per second at the cap and with the target alone).
    controller_steps: dict[str, int] = field(default_factory=dict)
    controller_last: dict | None = None
    # Per drafter ("model", "suffix", "ngram", ...; a composite's two apart): row steps it was asked for a
    # draft and had one (hit rate), blocks, draft tokens and accepted tokens (acceptance, draft length).
    sources: dict[str, SourceCounts] = field(default_factory=dict)

    def start_rows(self, batch_size: int) -> None:
        self.row_draft_tokens = [0] * batch_size
        self.row_accepted_tokens = [0] * batch_size
        self.row_target_passes = [0] * batch_size

    def record_step(self, gamma: int, rows: list[int], draft_lengths: list[int], num_accepted: list[int]) -> None:
        """Count one verification step; ``rows`` are the prompt indices of the active batch rows."""
        self.steps += 1
        self.row_steps += len(num_accepted)
        self.mixed_steps += len(set(num_accepted)) > 1
        _grow(self.draft_length_steps, gamma + 1)
        self.draft_length_steps[gamma] += 1
        _grow(self.accepted_length_histogram, gamma + 1)
        _grow(self.position_proposed, gamma)
        _grow(self.position_accepted, gamma)
        _grow(self.position_judged, gamma)
        for row, length, accepted in zip(rows, draft_lengths, num_accepted):
            if row < len(self.row_target_passes):  # per-row lists exist for generate(), not for the engine
                self.row_draft_tokens[row] += length
                self.row_accepted_tokens[row] += accepted
                self.row_target_passes[row] += 1
            self.draft_tokens += length
            self.accepted_tokens += accepted
            self.accepted_length_histogram[accepted] += 1
            for j in range(length):
                self.position_proposed[j] += 1
            for j in range(accepted):
                self.position_accepted[j] += 1
            for j in range(min(accepted + 1, length)):
                self.position_judged[j] += 1

    def record_decision(self, decision: dict) -> None:
        """The controller's decision for this step (``CapDecision.to_dict()``)."""
        self.controller_last = decision
        self.controller_steps[decision["reason"]] = self.controller_steps.get(decision["reason"], 0) + 1

    @property
    def mean_draft_length(self) -> float:
        """Draft columns per step, averaged over steps."""
        return sum(k * n for k, n in enumerate(self.draft_length_steps)) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens the target kept (0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

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
        return self.generated_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_row_step(self) -> float:
        """Deprecated name of :attr:`tokens_per_target_pass` (kept for one release, also in ``to_dict``)."""
        return self.tokens_per_target_pass

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sources"] = {name: counts.to_dict() for name, counts in sorted(self.sources.items())}
        out.update(
            acceptance_rate=self.acceptance_rate,
            per_position_acceptance=self.per_position_acceptance,
            conditional_acceptance=self.conditional_acceptance,
            iid_acceptance=self.iid_acceptance,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_target_pass=self.tokens_per_target_pass,
            tokens_per_row_step=self.tokens_per_target_pass,  # deprecated key, kept for one release
            tokens_per_second=self.tokens_per_second,
            mean_draft_length=self.mean_draft_length,
        )
        return out


def _grow(values: list[int], size: int) -> None:
    values.extend([0] * (size - len(values)))
