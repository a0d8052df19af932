"""``run_batch``: an offline generation job, in-process or spread over Ray Data actors.

The input rows are cut into fixed groups of ``batch_size`` consecutive rows (group ``g``: rows
``[g * batch_size, (g + 1) * batch_size)``), each decoded as one batch (``worker.GroupDecoder``). Groups are the
unit of work everywhere: the in-process loop decodes them one after the other; with Ray, a ``map_batches`` over an
actor pool (each actor holds one decoder, loaded once) decodes them in parallel, and Ray places the actors,
restarts one that dies and retries its group. Either way the driver alone writes the output, a group at a time
(``store.OutputFile``): a restarted job skips the rows written and decodes the groups that still miss rows
(whole, so that every row is decoded in the same batch as before; only the missing rows are written).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from .store import INDEX_FIELD, OutputFile, read_rows
from .worker import GroupDecoder, JobDefaults

log = logging.getLogger("verispec.offline")


@dataclass
class BatchSummary:
    rows: int  # rows in the input
    skipped: int  # already in the output when the job started
    written: int  # written by this run
    errors: int  # of those, rows that finished with "error"
    workers: int  # Ray actors used (0: in-process)


def _groups(rows: list[dict], batch_size: int, done: dict[int, dict]) -> list[list[tuple[int, dict]]]:
    """The groups that still miss a row in the output, each whole."""
    indexed = list(enumerate(rows))
    groups = [indexed[start:start + batch_size] for start in range(0, len(rows), batch_size)]
    return [group for group in groups if any(index not in done for index, _ in group)]


def _check_resumable(rows: list[dict], done: dict[int, dict]) -> None:
    """The output must have been written for this input: same row count bound, same prompts."""
    for index, row in done.items():
        if not isinstance(index, int) or not 0 <= index < len(rows) or any(
                row.get(key) != rows[index].get(key) for key in ("prompt", "messages")):
            raise ValueError(f"the output already holds a row (input_index {index!r}) that is not this input's: "
                             "give another --output, or the input it was written for")


def batch_schedule(target: str, load_options: dict) -> str:
    """A batch job's default draft schedule: "heuristic" (transformers' +2 / -1, which reads no timings, so even
    greedy rows decode in the same blocks on every run and every worker: the same tokens) where passes are
    bitwise the same whatever their shape (torch; llama.cpp's bitwise mode); "auto" (the speculation controller,
    priced from measured pass costs) on llama.cpp in its default mode, where each drafted token of a batch's pass
    costs a large share of it: the heuristic's drafts made 8-row groups ~25% slower than the target alone there
    (docs/ray.md), and greedy output there is exact in distribution, not bitwise, whatever the schedule."""
    from ..factory import choose_backend

    settings = load_options.get("llama_settings")
    bitwise = load_options.get("bitwise")
    bitwise = bool(settings is not None and settings.bitwise) if bitwise is None else bitwise
    on_llama = choose_backend(target, load_options.get("backend", "auto"), load_options.get("device", "cpu"))
    return "auto" if on_llama == "llama.cpp" and not bitwise else "heuristic"


def run_batch(target: str, draft: str | None = None, *, input_path: str | os.PathLike,
              output_path: str | os.PathLike, workers: int | None = None, batch_size: int = 16,
              defaults: JobDefaults | None = None, progress: bool = True, ray_address: str | None = None,
              cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0, **load_options) -> BatchSummary:
    """Generate a completion for every row of ``input_path`` (JSONL or Parquet) into ``output_path`` (JSONL).

    Each output row is its input row (every field kept) plus ``input_index``, ``text``, ``tokens``,
    ``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``seed`` (the one sampling used) and ``verispec``
    (speculative telemetry). Rows already in ``output_path`` are skipped (resume after a kill). ``workers``: Ray
    actors (``ray_address`` joins a cluster, else a local Ray instance is started on loopback); ``None`` decodes
    in-process, as does any ``workers`` when Ray is not installed. Greedy and seeded rows give the same tokens
    however many workers run and whether the job was interrupted, since a row's batch is its input group.
    ``load_options`` go to ``verispec.load`` (``num_draft_tokens`` defaults to :func:`batch_schedule`'s;
    ``llama_settings`` to ``LlamaSettings(n_seq_max=batch_size)``, a llama.cpp target's rows).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    defaults = defaults or JobDefaults()
    if load_options.get("llama_settings") is None:  # on llama.cpp: a KV stream for each row of a group
        from ..models.llama_context import LlamaSettings

        load_options["llama_settings"] = LlamaSettings(n_seq_max=batch_size)
    if load_options.get("num_draft_tokens") is None:
        load_options["num_draft_tokens"] = batch_schedule(target, load_options)
    rows = read_rows(input_path)
    output = OutputFile(output_path)
    done = output.written()
    _check_resumable(rows, done)
    pending = _groups(rows, batch_size, done)
    if workers is not None and not _ray_available():
        log.warning("ray is not installed (pip install 'verispec[ray]'): running in-process")
        workers = None
    summary = BatchSummary(rows=len(rows), skipped=len(done), written=0, errors=0, workers=workers or 0)
    if not pending:
        return summary
    if workers is None:
        worker = GroupDecoder.load(target, draft, defaults, load_options)
        results = (worker.decode(group) for group in pending)
    else:
        results = _ray_results(pending, target, draft, defaults, load_options, workers, ray_address,
                               cpus_per_worker, gpus_per_worker)
    from tqdm.auto import tqdm

    with tqdm(total=len(rows), initial=len(done), unit="row", desc="verispec batch", disable=not progress) as bar:
        for group_out in results:
            fresh = [row for row in group_out if row[INDEX_FIELD] not in done]
            output.append(fresh)
            summary.written += len(fresh)
            summary.errors += sum(row["finish_reason"] == "error" for row in fresh)
            bar.update(len(fresh))
    return summary


def _ray_available() -> bool:
    try:
        import ray.data  # noqa: F401
    except ImportError:
        return False
    return True


class _RayGroupWorker:
    """A Ray Data actor: loads the models once, then decodes the groups it is given (a group per call)."""

    def __init__(self, target: str, draft: str | None, defaults: dict, load_options: dict) -> None:
        self.worker = GroupDecoder.load(target, draft, defaults, load_options)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        decoded = [json.dumps(self.worker.decode([(index, row) for index, row in json.loads(group)]))
                   for group in batch["group"]]
        return {"group": np.array(decoded, dtype=object)}


def _ray_results(pending: list[list[tuple[int, dict]]], target: str, draft: str | None, defaults: JobDefaults,
                 load_options: dict, workers: int, ray_address: str | None, cpus_per_worker: float,
                 gpus_per_worker: float) -> Iterator[list[dict]]:
    """Decoded groups as Ray Data's actors finish them (in any order). Starts a local Ray instance on loopback
    (and stops it at the end) unless one is running or ``ray_address`` names a cluster."""
    import ray
    import ray.data

    started = not ray.is_initialized()
    if started:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 **({} if ray_address else {"_node_ip_address": "127.0.0.1"}))
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False  # the job's own bar counts rows
        items = [{"group": json.dumps(group, default=str)} for group in pending]
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _RayGroupWorker, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
            fn_constructor_kwargs={"target": target, "draft": draft, "defaults": asdict(defaults),
                                   "load_options": load_options})
        for batch in dataset.iter_batches(batch_size=1, batch_format="numpy"):
            for group in batch["group"]:
                yield json.loads(group)
    finally:
        if started:
            ray.shutdown()
