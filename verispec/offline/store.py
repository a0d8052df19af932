"""A job's files: the input rows (JSONL or Parquet) and the append-only JSONL output that makes a job resumable.

The output is written one group of rows at a time, in one ``write`` followed by ``flush`` and ``fsync``, so a
job killed at any moment loses nothing it had written. On restart the rows already in the output are read back
(by their ``input_index``) and skipped; a last line cut short by the kill is dropped from the file first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

INDEX_FIELD = "input_index"  # the row's 0-based position in the input: the key that makes a job resumable


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a ``.parquet`` file (pyarrow) or a JSON-lines file (anything else; blank lines skipped)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ValueError("reading Parquet needs pyarrow (pip install 'verispec[ray]')") from error
        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON object: {error}") from error
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")  # noqa: TRY004
            rows.append(row)
    return rows


class OutputFile:
    """The job's output: JSON lines appended a group at a time; ``written()`` reads back what is there."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def written(self) -> dict[int, dict]:
        """The rows already written, by input index. A last line without its newline (the job was killed while
        writing it) is cut from the file; any other unreadable line is an error."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            with self.path.open("r+b") as handle:
                handle.truncate(complete)
        rows: dict[int, dict] = {}
        for number, line in enumerate(data[:complete].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                index = row[INDEX_FIELD]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{self.path}:{number}: not a row written by verispec batch ({error})") from error
            if index in rows:
                raise ValueError(f"{self.path}:{number}: input row {index} is written twice")
            rows[index] = row
        return rows

    def append(self, rows: list[dict]) -> None:
        """Write ``rows`` at the end of the file, durably, before returning."""
        if not rows:
            return
        text = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
