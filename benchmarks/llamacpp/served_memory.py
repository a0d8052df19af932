"""Served memory: peak RSS of `verispec serve` on the llama.cpp backend against llama.cpp's own `llama-server`,
one server at a time, under the same load (issue 41's goal: peak RSS <= 1.2x llama-server's).

    python benchmarks/llamacpp/served_memory.py [--clients 16] [--max-tokens 64] [--also-drafts none]
        [--out benchmarks/llamacpp/results/served_memory.json]

Each server runs as its own process, started, loaded and stopped before the next one starts (never both at once):

- `verispec serve --target qwen2.5-coder-1.5b --backend llama.cpp --llama-threads 2`, every other flag at its
  default (the draft too, `--draft`'s default), plus `--port` and `--model-name` (the name the requests send);
  ``--also-drafts`` adds runs with another `--draft` (``none``: the target alone) to show what the draft holds;
- `llama-server` on the same GGUF with `benchmarks/serve.py`'s `LlamaServer` flags: `-np 16 -c <cells>
  --kv-unified -t 2 -fa on --no-webui`, where <cells> is the KV memory `verispec serve` sizes for itself
  (`LlamaSettings.kv_cells()` from the same command line, parsed by verispec's own parser).

For each: wait for ``/health``, let it settle, read the idle RSS (``VmRSS``) and the peak so far (``VmHWM``, the
load's peak); send ``--clients`` concurrent streamed greedy completions of ``--max-tokens`` tokens (the prompts of
``benchmarks/prompts.json``, `benchmarks/serve.py`'s client); then read ``VmHWM`` again (the peak over the whole
life of the process, load included), the anonymous / file-backed split and the largest mappings, and stop the
server. Where a server forks, each measure is summed over its processes (a sum of peaks: an upper bound).
Also measured: the RSS of a bare Python process that imports what `verispec serve` imports, before any model,
and what llama.cpp allocates for `verispec serve`'s models (its own log lines: weights, KV, output and compute
buffers), in a process of their own. Each verispec run records the commit it ran (``git describe --dirty``).

Writes ``--out`` (JSON) and a Markdown table beside it (``.md``); progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import cpu_name  # noqa: E402  (llamacpp/bench.py)
import serve  # noqa: E402  (benchmarks/serve.py: the client, the health wait and llama-server's flags)

GB = 1e9
DEFAULT_GGUF = "/root/.cache/verispec/models/qwen2.5-coder-1.5b-instruct.gguf"
DEFAULT_SERVER = "/tmp/lcp/build/bin/llama-server"
# What `verispec serve` imports before it loads a model (its command module, the server, the backend, the
# tokenizer's library, torch): the Python part of its idle RSS.
IMPORTS = ("import torch, transformers, uvicorn, verispec.cli.commands, verispec.serving.app, "
           "verispec.serving.engine, verispec.models.llamacpp")


def log(message: str) -> None:
    print(f"[served-memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- /proc readings
def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/<pid>/task/*/children``)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def status_bytes(pid: int, fields: tuple[str, ...] = ("VmRSS", "VmHWM", "RssAnon", "RssFile")) -> dict[str, int]:
    """``fields`` of ``/proc/<pid>/status`` in bytes, summed over the process and its descendants."""
    total = dict.fromkeys(fields, 0)
    for member in process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:  # gone meanwhile
            continue
        for line in lines:
            name, _, value = line.partition(":")
            if name in total:
                total[name] += int(value.split()[0]) * 1024
    return total


def largest_mappings(pid: int, count: int = 8) -> list[dict]:
    """The ``count`` mappings of ``pid`` holding the most resident memory, grouped by what is mapped (a file, or
    ``[heap]`` / ``[anon]``), from ``/proc/<pid>/smaps``."""
    by_name: dict[str, int] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header: range perms offset dev inode [path]
            name = head[5] if len(head) > 5 else "[anon]"
        elif head and head[0] == "Rss:":
            by_name[name] = by_name.get(name, 0) + int(head[1]) * 1024
    top = sorted(by_name.items(), key=lambda item: -item[1])[:count]
    return [{"mapping": mapped, "rss_gb": round(rss / GB, 3)} for mapped, rss in top]


def no_usage(text: str) -> int:
    """The client's token count for a stream without usage: both servers send usage, so this never runs."""
    raise RuntimeError("a stream ended without its usage chunk")


def in_gb(readings: dict[str, int]) -> dict[str, float]:
    return {name: round(value / GB, 3) for name, value in readings.items()}


# ----------------------------------------------------------------------------- one server's life
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_and_measure(pid: int, url: str, prompts: list[str], args) -> dict:
    """With the server at ``url`` (process ``pid``) healthy: idle readings, the load, the peak."""
    time.sleep(args.settle)
    idle = status_bytes(pid)
    log(f"  idle RSS {idle['VmRSS'] / GB:.2f} GB (peak while loading {idle['VmHWM'] / GB:.2f} GB); "
        f"{args.clients} clients x {args.max_tokens} tokens")
    level = asyncio.run(serve.run_level(url, prompts, args.clients, 1, args.max_tokens))
    after = status_bytes(pid)
    log(f"  peak RSS {after['VmHWM'] / GB:.2f} GB ({level['completion_tokens']} tokens in {level['wall_s']:.1f} s)")
    return {"idle_rss_gb": round(idle["VmRSS"] / GB, 3), "peak_rss_gb": round(after["VmHWM"] / GB, 3),
            "peak_rss_bytes": after["VmHWM"],
            "load_peak_rss_gb": round(idle["VmHWM"] / GB, 3), "idle": in_gb(idle), "after_load": in_gb(after),
            "largest_mappings_after_load": largest_mappings(pid), "processes": len(process_tree(pid)),
            "requests": level["requests"], "completion_tokens": level["completion_tokens"],
            "wall_s": round(level["wall_s"], 2), "throughput_tok_s": round(level["throughput_tok_s"], 2)}


def verispec_command(args, draft: str | None, port: int) -> list[str]:
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--backend", "llama.cpp",
               "--llama-threads", str(args.threads), "--port", str(port), "--model-name", serve.MODEL]
    return command + (["--draft", draft] if draft is not None else [])


def verispec_cells(command: list[str]) -> tuple[int, str]:
    """The KV cells `verispec serve` gives its target with this command line, and the layout in words, as its CLI
    computes them (verispec's own parser and ``llama_settings``; no model loaded)."""
    from verispec.cli import build_parser
    from verispec.cli.common import llama_settings
    from verispec.models.llamacpp import LlamaSettings, kv_layout

    from verispec.factory import auto_draft

    parsed = build_parser().parse_args(command[command.index("serve"):])
    settings = dataclasses.replace(llama_settings(parsed) or LlamaSettings(), trees=parsed.trees)  # as load() does
    if parsed.draft == "auto":
        parsed.draft = auto_draft(parsed.target, parsed.backend)
    return settings.kv_cells(), kv_layout(settings)


def source_version() -> str:
    """The repository's commit, ``-dirty`` with uncommitted edits (the code a server started now imports)."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def run_verispec(args, draft: str | None, prompts: list[str]) -> dict:
    port = free_port()
    version = source_version()
    command = verispec_command(args, draft, port)
    url = f"http://127.0.0.1:{port}"
    log(f"verispec serve (draft {draft or 'default'}): {' '.join(command[1:])}")
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a full pipe nobody reads would stall it
        server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors)
        try:
            if not serve.wait_healthy(url, args.start_timeout, 0.5, gone=lambda: server.poll() is not None):
                errors.seek(0)
                raise RuntimeError(f"verispec serve did not start ({' '.join(command)}):\n"
                                   f"{errors.read().decode(errors='replace')[-3000:]}")
            result = load_and_measure(server.pid, url, prompts, args)
        finally:
            stop(server)
        errors.seek(0)
        lines = errors.read().decode(errors="replace").splitlines()
    result["load_messages"] = [line for line in lines if "llama.cpp" in line or "KV memory" in line]
    return {"command": " ".join(["python", *command[1:]]), "source": version, **result}


def run_llama_server(args, cells: int, prompts: list[str]) -> dict:
    log(f"llama-server: -np {args.clients} -c {cells} --kv-unified -t {args.threads}")
    server = serve.LlamaServer(args.llama_server, args.gguf, args.clients, cells, args.threads, [])
    try:
        result = load_and_measure(server.process.pid, server.url, prompts, args)
    finally:
        server.close()
    return {"command": " ".join(server.command), **result}


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def llama_buffers(command: list[str]) -> dict:
    """What llama.cpp allocates for `verispec serve`'s models with this command line: its own log lines (weights,
    KV memory, output and compute buffers) and the RSS after each model is loaded, in a process that imports only
    llama-cpp-python and verispec's backend (``--buffers-only``, below)."""
    code = subprocess.run([sys.executable, __file__, "--buffers-only", json.dumps(command)], cwd=ROOT,
                          capture_output=True, text=True)
    if code.returncode != 0:
        raise RuntimeError(f"reading llama.cpp's buffers failed:\n{code.stderr[-3000:]}")
    return json.loads(code.stdout)


def buffers_only(command: list[str]) -> dict:
    """``llama_buffers``' child: the target and the draft loaded as `verispec serve` loads them (its parser,
    ``llama_settings``, ``LlamaModel`` with the draft's ``draft_settings``; no pass-cost measurement), llama.cpp's
    log kept by a callback of ours (verispec quiets llama-cpp-python's own)."""
    import ctypes

    import llama_cpp
    import llama_cpp._logger  # noqa: F401  (installs its callback on import: ours replaces it after)

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    from verispec.acquire import resolve
    from verispec.cli import build_parser
    from verispec.cli.common import llama_settings
    from verispec.models.llamacpp import LlamaModel, LlamaSettings, draft_settings

    from verispec.factory import auto_draft

    parsed = build_parser().parse_args(command[command.index("serve"):])
    settings = dataclasses.replace(llama_settings(parsed) or LlamaSettings(), trees=parsed.trees)  # as load() does
    if parsed.draft == "auto":
        parsed.draft = auto_draft(parsed.target, parsed.backend)
    models, out = [], {}
    try:
        for role, name, role_settings in (("target", parsed.target, settings),
                                          ("draft", parsed.draft, draft_settings(settings))):
            name = name.partition("+")[2] if name.startswith("suffix+") else name  # suffix+MODEL: the model
            if role == "draft" and name in ("none", "ngram", "suffix"):
                continue
            lines.clear()
            models.append(LlamaModel(resolve(name, backend="llama.cpp").path, role_settings, probe=False))
            keys = ("model buffer size", "output buffer size", "KV buffer size", "compute buffer size", "n_ctx ",
                    "n_seq_max", "n_batch", "n_ubatch", "n_outputs_max ")
            out[role] = {"log": [" ".join(line.split()) for line in "".join(lines).splitlines()
                                 if any(key in line for key in keys)],
                         "rss_after_gb": in_gb(status_bytes(os.getpid()))}
    finally:
        for model in models:
            model.close()
    return out


def import_cost() -> dict:
    """RSS of a Python process (this interpreter) that has imported what `verispec serve` imports."""
    code = f"{IMPORTS}; print(open('/proc/self/status').read())"
    output = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in output.splitlines()
              if line.startswith(("VmRSS", "RssAnon", "RssFile"))}
    return {"code": IMPORTS, **in_gb(fields)}


# ----------------------------------------------------------------------------- report
def markdown(results: dict) -> str:
    reference = results["llama_server"]["peak_rss_bytes"]
    lines = [
        "# Served memory: `verispec serve` (llama.cpp backend) against `llama-server`", "",
        f"Machine: {results['machine']}, {results['cpus']} CPUs; {results['threads']} threads each; "
        f"{results['clients']} concurrent streamed greedy completions of {results['max_tokens']} tokens "
        "(`benchmarks/prompts.json`); one server at a time.", f"Command: `{results['command']}`", "",
        "| server | idle RSS | peak while loading | peak RSS | peak / llama-server's | anon / file after the load |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in [*results["verispec"].items(), ("llama-server", results["llama_server"])]:
        after = run["after_load"]
        lines.append(f"| {name} | {run['idle_rss_gb']:.2f} GB | {run['load_peak_rss_gb']:.2f} GB | "
                     f"{run['peak_rss_gb']:.2f} GB | {run['peak_rss_bytes'] / reference:.2f}x | "
                     f"{after['RssAnon']:.2f} / {after['RssFile']:.2f} GB |")
    imports = results["import_cost"]
    lines += ["", f"Goal: peak RSS <= 1.2x llama-server's: **{'met' if results['goal_met'] else 'not met'}** "
              f"({results['ratio']:.2f}x).",
              f"A bare Python process after `verispec serve`'s imports, before any model: {imports['VmRSS']:.2f} GB "
              f"({imports['RssAnon']:.2f} GB anonymous).", "",
              f"llama.cpp's buffers for `verispec serve`'s models ({results['verispec_kv']['layout']}), from "
              "llama.cpp's log, loaded one after the other in a process that imports only verispec and "
              "llama-cpp-python (its RSS once each is loaded, the draft beside the target):", ""]
    for role, loaded in results["verispec_llama_buffers"].items():
        lines.append(f"- {role} (RSS {loaded['rss_after_gb']['VmRSS']:.2f} GB): "
                     + "; ".join(line.partition(": ")[2] for line in loaded["log"]))
    lines += ["", "Commands:", ""]
    lines += [f"- {name} (at {run.get('source', 'unknown')}): `{run['command']}`"
              for name, run in results["verispec"].items()]
    lines.append(f"- llama-server: `{results['llama_server']['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="verispec serve's --target")
    parser.add_argument("--gguf", default=DEFAULT_GGUF, help="--target's GGUF, for llama-server")
    parser.add_argument("--llama-server", default=DEFAULT_SERVER, metavar="BIN")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (and llama-server's slots)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--also-drafts", default="", metavar="DRAFTS",
                        help="comma-separated further --draft values for verispec serve (e.g. none, suffix)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after /health before the idle reading")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to load")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "served_memory.json")
    parser.add_argument("--buffers-only", default=None, help=argparse.SUPPRESS)  # llama_buffers' child
    args = parser.parse_args(argv)
    if args.buffers_only:
        print(json.dumps(buffers_only(json.loads(args.buffers_only))))
        return 0

    missing = [f"{what} not found: {path}" for what, path in (("llama-server binary", args.llama_server),
                                                             ("GGUF", args.gguf)) if not Path(path).is_file()]
    if missing:
        parser.error("; ".join(missing) + " (build llama.cpp's tools from the vendored source, "
                     "benchmarks/llamacpp/README.md; the GGUF comes with `verispec generate --backend llama.cpp`)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prompts = [p["text"] for p in json.loads((ROOT / "benchmarks" / "prompts.json").read_text())]
    serve.COUNT_TOKENS = no_usage

    results = {"machine": cpu_name(), "cpus": len(os.sched_getaffinity(0)), "threads": args.threads,
               "clients": args.clients, "max_tokens": args.max_tokens, "prompts": "benchmarks/prompts.json",
               "command": " ".join(["python", os.path.relpath(__file__, ROOT), *(argv if argv is not None else
                                                                                   sys.argv[1:])]),
               "import_cost": import_cost(), "verispec": {}}
    log(f"imports alone: {results['import_cost']['VmRSS']:.2f} GB")
    cells, layout = verispec_cells(verispec_command(args, None, 0))
    results["verispec_kv"] = {"cells": cells, "layout": layout}
    log("llama.cpp's buffers for verispec serve's models")
    results["verispec_llama_buffers"] = llama_buffers(verispec_command(args, None, 0))
    for draft in [None, *[d for d in args.also_drafts.split(",") if d]]:
        name = "verispec serve" + (f" --draft {draft}" if draft else "")
        results["verispec"][name] = run_verispec(args, draft, prompts)
        args.out.write_text(json.dumps(results, indent=2))  # what ran so far, if the rest is cut off
    results["llama_server"] = run_llama_server(args, cells, prompts)
    default = results["verispec"]["verispec serve"]
    results["ratio"] = default["peak_rss_bytes"] / results["llama_server"]["peak_rss_bytes"]
    results["goal_met"] = results["ratio"] <= 1.2
    args.out.write_text(json.dumps(results, indent=2))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
