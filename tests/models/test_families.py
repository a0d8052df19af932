"""Every causal-LM family of the installed transformers, built tiny from its config, decodes exactly through
verispec (greedy: the target's own tokens, batches of 1 and 3 with left padding, a partly agreeing draft,
draft lengths 1 / 3 / 8) or is refused with a clear ``ValueError`` before any work. The protocol and the
tiny configs are in ``tests/families.py``.

The default run takes a fixed subset: the five families the cache adapter used to get wrong (MPT and GPT-Neo
local layers attend by slot index, so the holes left by rejected drafts changed their output; Phi-3 longrope
re-encodes every position past a length; RWKV keeps its state outside the cache it is given; OpenAI-GPT has
no cache and crashed), the three it was built on, and a spread of others. ``-m slow`` runs every family and
checks that the README's table is what they do.
"""

from __future__ import annotations

import families
import pytest

from verispec.models import capability

EXACT = ("exact", "")
EXPECTED = {
    "mpt": ("refused", capability.SLOT_DEPENDENT),
    "gpt_neo": ("refused", capability.SLOT_DEPENDENT),
    "rwkv": ("refused", capability.NO_CACHE_STATE),
    "openai-gpt": ("refused", capability.FORWARD_FAILS),
    "mistral": ("refused", capability.UNROLLABLE_LAYERS),
    "phi3-longrope": ("exact, shorter requests", None),  # exact up to the switch; longer requests refused
    "gpt2": EXACT, "llama": EXACT, "qwen2": EXACT, "bloom": EXACT, "opt": EXACT, "mixtral": EXACT,
}
STATUSES = {"exact", "exact, shorter requests", "refused", "not built"}


def test_the_default_subset_is_the_expected_one() -> None:
    assert set(families.DEFAULT_SUBSET) == set(EXPECTED)


@pytest.mark.parametrize("family", families.DEFAULT_SUBSET)
def test_family_decodes_exactly_or_is_refused(family: str) -> None:
    verdict = families.verdict(family)  # raises AssertionError on a wrong token or a crash
    status, reason = EXPECTED[family]
    assert verdict.status == status, verdict
    if reason is not None:
        assert verdict.reason == reason, verdict
    # The README's table says the same (the slow run checks the whole table).
    assert families.readme_verdicts()[family] == (verdict.status, families.table_reason(verdict.reason))


@pytest.mark.slow
@pytest.mark.parametrize("family", families.families())
def test_every_family_decodes_exactly_or_is_refused(family: str) -> None:
    assert families.verdict(family).status in STATUSES


@pytest.mark.slow
def test_readme_table_is_what_the_families_do() -> None:
    table = families.render_table([families.verdict(family) for family in families.families()])
    assert families.readme_table() == table, "the families changed: run `python -m tests.families --write`"
