"""Helpers of the offline-job tests: a 200-row job of mixed settings over the serving tests' tiny saved pair, and
reading an output back by input index."""

from __future__ import annotations

import json
import random
from pathlib import Path

from serving.serving_support import WORDS

PLAIN_WORDS = WORDS[3:]  # no special tokens


def job_rows(count: int = 200, seed: int = 0) -> list[dict]:
    """Prompts as text, token ids and chat messages; greedy, seeded sampling (with and without top-p / top-k) and
    job-seeded sampling; lengths 0..12; an ``id`` and a free field to carry through; two rows the decoder refuses."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        text = " ".join(rng.choice(PLAIN_WORDS) for _ in range(rng.randint(1, 8)))
        kind = i % 3
        row: dict = {"id": f"row-{i}", "meta": {"n": i}}
        if kind == 0:
            row["prompt"] = text
        elif kind == 1:
            row["prompt"] = [WORDS.index(w) for w in text.split()]
        else:
            row["messages"] = [{"role": "user", "content": text}]
        row["max_tokens"] = rng.randint(0, 12)
        mode = rng.randrange(4)
        if mode == 1:
            row.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(2**31))
        elif mode == 2:
            row.update(temperature=0.9, top_p=0.8, top_k=rng.choice([None, 5]), seed=rng.randrange(2**31))
        elif mode == 3:
            row.update(temperature=1.0)  # the job's seed decides
        rows.append(row)
    rows[17]["temperature"] = -1.0  # refused: an error row, the others unaffected
    rows[18].pop("prompt", None)
    rows[18].pop("messages", None)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_output(path: Path) -> dict[int, dict]:
    """The output's rows by input index; fails on a row written twice."""
    rows: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        assert row["input_index"] not in rows, f"row {row['input_index']} written twice"
        rows[row["input_index"]] = row
    return rows


def decoded(row: dict) -> tuple:
    """What must reproduce: the tokens, the text, why it ended and the seed it sampled with."""
    return row["tokens"], row["text"], row["finish_reason"], row.get("seed")
