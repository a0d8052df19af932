"""``verispec batch``: 200 rows of mixed settings give the same completions in-process, in batches of another size
and over two Ray Data workers; a job killed mid-way (the process, or one Ray worker) and restarted has every row
exactly once, each as an uninterrupted run writes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import ray
from batch_support import decoded, job_rows, read_output, write_jsonl
from serving.serving_support import save_pair, wait_until
from tiny_models import one_torch_thread

from verispec.offline import JobDefaults, run_batch
from verispec.offline.store import OutputFile

ROWS = 200
GROUP = 8
DEFAULTS = JobDefaults(max_tokens=6, seed=5)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as each Ray worker has (Ray sets OMP_NUM_THREADS to its CPUs): the tiny models run no
    faster on two, and on a busy machine two threads wait on each other."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny pair, the input, and the reference output of an uninterrupted in-process run."""
    root = tmp_path_factory.mktemp("batch-job")
    target, draft = save_pair(root / "models")
    rows = job_rows(ROWS)
    source = write_jsonl(root / "in.jsonl", rows)
    reference = root / "reference.jsonl"
    summary = run_batch(target, draft, input_path=source, output_path=reference, batch_size=GROUP, defaults=DEFAULTS,
                        progress=False, fast=False)
    assert (summary.written, summary.errors, summary.workers) == (ROWS, 2, 0)
    return {"root": root, "target": target, "draft": draft, "rows": rows, "input": source,
            "reference": read_output(reference)}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=256 * 2**20,
             log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def assert_same_rows(got: dict[int, dict], job) -> None:
    """Every input row exactly once (``read_output`` refuses a duplicate), each as the reference run wrote it."""
    assert sorted(got) == list(range(ROWS))
    assert [decoded(got[i]) for i in range(ROWS)] == [decoded(job["reference"][i]) for i in range(ROWS)]


def test_reference_rows_keep_their_fields_and_report_telemetry(job) -> None:
    out = job["reference"]
    for i, row in enumerate(job["rows"]):
        assert {k: out[i][k] for k in row} == row, "every input field comes back as it was"
    ok = [row for row in out.values() if row["finish_reason"] != "error"]
    assert {row["finish_reason"] for row in ok} == {"stop", "length"}
    assert all(row["completion_tokens"] == len(row["tokens"]) <= job["rows"][row["input_index"]].get("max_tokens", 6)
               for row in ok)
    assert sum(row["verispec"]["accepted_tokens"] for row in ok) > 0
    assert out[17]["finish_reason"] == "error" and "temperature" in out[17]["error"]
    assert out[18]["finish_reason"] == "error" and "prompt" in out[18]["error"]
    sampled = [row for row in ok if row.get("temperature") and "seed" not in job["rows"][row["input_index"]]]
    assert sampled and all(isinstance(row["seed"], int) for row in sampled), "job-seeded rows report their seed"


def test_the_batch_a_row_lands_in_does_not_change_its_tokens(job, tmp_path) -> None:
    """Greedy and seeded rows decoded one at a time equal the same rows decoded in groups of 8."""
    subset = write_jsonl(tmp_path / "in.jsonl", job["rows"][:16])
    out = tmp_path / "alone.jsonl"
    run_batch(job["target"], job["draft"], input_path=subset, output_path=out, batch_size=1, defaults=DEFAULTS,
              progress=False, fast=False)
    alone = read_output(out)
    assert [decoded(alone[i]) for i in range(16)] == [decoded(job["reference"][i]) for i in range(16)]


@pytest.mark.ray
def test_two_ray_workers_write_the_in_process_rows(job, local_ray, tmp_path) -> None:
    out = tmp_path / "ray.jsonl"
    summary = run_batch(job["target"], job["draft"], input_path=job["input"], output_path=out, workers=2,
                        batch_size=GROUP, defaults=DEFAULTS, progress=False, fast=False)
    assert (summary.written, summary.workers) == (ROWS, 2)
    assert_same_rows(read_output(out), job)


def _worker_processes() -> list[psutil.Process]:
    """Ray Data's actors of this job (Ray names the process after the actor's class)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "_RayGroupWorker" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.ray
def test_a_ray_worker_killed_mid_job_is_replaced_and_no_row_is_lost(job, local_ray, tmp_path) -> None:
    """SIGKILL one worker once the job has written rows: Ray restarts the actor and retries its group."""
    import threading

    out = tmp_path / "ray-killed.jsonl"
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = run_batch(job["target"], job["draft"], input_path=job["input"], output_path=out,
                                          workers=2, batch_size=GROUP, defaults=DEFAULTS, progress=False, fast=False)
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: _lines(out) >= GROUP or not thread.is_alive(), 120, "the first group written")
    workers = _worker_processes()
    assert workers and thread.is_alive(), "the job must still be running when its worker is killed"
    victim = workers[0].pid
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=180)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    assert _lines(out) == ROWS
    assert_same_rows(read_output(out), job)
    assert victim not in [p.pid for p in _worker_processes()]


def test_a_killed_job_resumes_without_missing_or_repeated_rows(job, tmp_path) -> None:
    """``verispec batch`` in a process of its own, SIGKILLed mid-job, then the same command again."""
    out = tmp_path / "killed.jsonl"
    command = [sys.executable, "-m", "verispec.cli", "batch", "--target", job["target"], "--draft", job["draft"],
               "--no-fast", "--input", str(job["input"]), "--output", str(out), "--batch-size", str(GROUP),
               "--max-new-tokens", str(DEFAULTS.max_tokens), "--seed", str(DEFAULTS.seed), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _lines(out) >= 5 * GROUP or process.poll() is not None, 120, "40 rows written")
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    written = _lines(out)
    assert 5 * GROUP <= written < ROWS
    before = OutputFile(out).written()  # a line the kill cut short is dropped, as the resumed job does
    resumed = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{ROWS - len(before)} rows written" in resumed.stderr
    after = read_output(out)
    assert {i: after[i] for i in before} == before, "rows written before the kill stay as they were"
    assert_same_rows(after, job)


def test_a_line_cut_by_a_kill_is_dropped_and_written_again(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps({"input_index": 0, "text": "a"}) + "\n" + '{"input_index": 1, "te', encoding="utf-8")
    assert list(OutputFile(path).written()) == [0]
    assert path.read_text(encoding="utf-8").endswith("}\n")
    OutputFile(path).append([{"input_index": 1, "text": "b"}])
    assert sorted(OutputFile(path).written()) == [0, 1]


def test_an_output_of_another_input_is_refused(job, tmp_path) -> None:
    out = tmp_path / "other.jsonl"
    out.write_text(json.dumps({"input_index": 3, "prompt": "not this one"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not this input's"):
        run_batch(job["target"], job["draft"], input_path=job["input"], output_path=out, progress=False, fast=False)


def test_parquet_input_and_no_ray_installed(job, tmp_path, monkeypatch) -> None:
    """A Parquet input gives the JSONL input's rows; asked for workers without Ray, the job runs in-process."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verispec.offline import job as job_module

    picked = [i for i, row in enumerate(job["rows"][:24]) if not isinstance(row.get("prompt"), list)]  # one type a column
    rows = [{k: v for k, v in job["rows"][i].items() if k != "meta"} for i in picked]
    source = tmp_path / "in.parquet"
    columns = dict.fromkeys(key for row in rows for key in row)  # every row's fields, absent ones null
    pq.write_table(pa.Table.from_pydict({key: [row.get(key) for row in rows] for key in columns}), source)
    monkeypatch.setattr(job_module, "_ray_available", lambda: False)
    out = tmp_path / "out.jsonl"
    summary = run_batch(job["target"], job["draft"], input_path=source, output_path=out, workers=2, batch_size=GROUP,
                        defaults=DEFAULTS, progress=False, fast=False)
    assert summary.workers == 0
    got = read_output(out)
    # Rows seeded by the job sample with a seed of their index, which differs here: compare the others.
    own = [n for n, row in enumerate(rows) if row.get("seed") is not None or not row.get("temperature")]
    assert len(own) > len(rows) // 2
    assert [decoded(got[n]) for n in own] == [decoded(job["reference"][picked[n]]) for n in own]
