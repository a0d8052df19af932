"""Serving benchmark: ``verispec serve`` under 1, 4, 16 and 32 concurrent clients, speculative vs the target alone.

    python benchmarks/serve.py [--concurrency 1,4,16,32] [--requests-per-client 3] [--max-tokens 48] [--repeats 2]
                               [--also-drafts suffix,ngram] [--out benchmarks] [--replot]

One process loads the real pair once (target pre-packed, draft int4, as ``verispec serve`` does) and serves the
same OpenAI API twice on a loopback port: with the draft (``num_draft_tokens="auto"``) and with the target alone
(the same engine, no drafter, sharing the target's weights); ``--also-drafts`` adds free drafts (``suffix``,
``ngram``) on the same target weights as further modes, so every drafter is compared in one process. Each client sends streamed greedy completions of
the prompts in ``prompts.json`` one after another; per request it records the time to the first text, the time
per output token after it and the whole latency; per level, throughput (completion tokens per second of wall
time). Each level runs ``--repeats`` times per mode, the modes' order rotated each repeat (A B C, B C A, C A B; with
two modes A B B A: speculative, alone, alone, speculative)
so that a drift in machine speed hits both alike; a mode's throughput is its tokens over its summed wall time,
and each repeat's own throughput is reported as the spread.
Greedy outputs must be identical between the two modes, whatever the batch: the script checks and reports it.
Writes ``serve.json``, ``SERVE.md`` and ``serve.png`` (``--replot`` rewrites the last two from the first). Compare ratios, not absolute times: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from run import cpu_name  # noqa: E402
from verispec import SpeculativeDecoder  # noqa: E402
from verispec.cli.common import build_decoder  # noqa: E402
from verispec.models import eos_token_ids  # noqa: E402
from verispec.models.llamacpp import LlamaModel  # noqa: E402
from verispec.serving.engine import Engine  # noqa: E402
from verispec.serving.app import create_app  # noqa: E402

MODEL = "bench"


def log(message: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_healthy(url: str, seconds: float, poll: float, gone=lambda: False) -> bool:
    """Whether ``url``'s ``/health`` answers 200 within ``seconds`` (asked every ``poll`` s; False at once once
    ``gone()``, a server process that exited)."""
    deadline = time.monotonic() + seconds
    while not gone() and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    return False


class LiveServer:
    """uvicorn serving ``app`` from a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if not wait_healthy(self.url, 60, 0.05):
            raise TimeoutError("server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class LlamaServer:
    """llama.cpp's own ``llama-server`` on the same GGUF, as a subprocess on a free loopback port: ``slots`` slots
    (``-np``) sharing one KV memory of ``ctx`` cells (``--kv-unified``, as verispec's shared memory), ``threads``
    threads, flash attention on, ``extra`` flags (``--spec-type ngram-simple`` ...)."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx: int, threads: int, extra: list[str]) -> None:
        import subprocess

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-np", str(slots), "-c",
                        str(ctx), "--kv-unified", "-t", str(threads), "-fa", "on", "--no-webui", *extra]
        # Its log goes to a file: a pipe nobody reads while it serves would fill and stall the server.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log)
        if not wait_healthy(self.url, 300, 0.2, gone=lambda: self.process.poll() is not None):
            self.log.seek(0)
            error = self.log.read().decode(errors="replace")[-2000:]
            self.close()
            raise RuntimeError(f"llama-server did not start: {' '.join(self.command)}\n{error}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a server that does not stop is killed
            self.process.kill()
        self.log.close()


COUNT_TOKENS = None  # text -> tokens, for a server whose stream carries no usage (set in main)


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    text, usage, telemetry = "", None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if choice["text"] and first is None:
                    first = time.perf_counter()
                text += choice["text"]
            if chunk.get("usage"):
                usage, telemetry = chunk["usage"], chunk.get("verispec")
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else COUNT_TOKENS(text)
    first = first if first is not None else end
    return {
        "prompt": prompt, "text": text, "completion_tokens": tokens, "latency_s": end - start,
        "ttft_s": first - start, "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None,
        "draft_tokens": (telemetry or {}).get("draft_tokens", 0),
        "accepted_tokens": (telemetry or {}).get("accepted_tokens", 0),
        "tokens_per_target_pass": (telemetry or {}).get("tokens_per_target_pass"),
    }


async def run_level(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    async def client_loop(i: int) -> list[dict]:
        # A connection per request: llama-server may close a connection after a streamed response, and a client
        # that reuses it then reads "Server disconnected without sending a response" (seen at 1 client).
        async with httpx.AsyncClient(base_url=url, timeout=None,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            return [await one_request(client, prompts[(i + j) % len(prompts)], max_tokens) for j in range(per_client)]

    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*[client_loop(i) for i in range(clients)]) for r in rs]
    return summarise(clients, results, time.perf_counter() - start)


def summarise(clients: int, results: list[dict], wall: float) -> dict:
    tokens = sum(r["completion_tokens"] for r in results)
    drafted = sum(r.get("draft_tokens", 0) for r in results)
    accepted = sum(r.get("accepted_tokens", 0) for r in results)
    return {"clients": clients, "requests": len(results), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall, "requests_per_s": len(results) / wall,
            "latency_s": percentiles([r["latency_s"] for r in results]),
            "ttft_s": percentiles([r["ttft_s"] for r in results]),
            "tpot_s": percentiles([r["tpot_s"] for r in results if r["tpot_s"] is not None]),
            # Pooled over drafted tokens: a mean of per-request rates would count requests that never drafted
            # (the gate closed) as rate 0 and report 0.06 for drafts that were mostly kept.
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_target_pass": mean([r["tokens_per_target_pass"] for r in results]),
            "outputs": {r["prompt"]: r["text"] for r in results}, "requests_detail": results}


def combine(runs: list[dict]) -> dict:
    """A level's repeats of one mode: throughput over their summed wall time, percentiles of every request,
    and each repeat's own throughput (the spread)."""
    if len(runs) == 1:
        return {**runs[0], "throughput_by_repeat": [runs[0]["throughput_tok_s"]]}
    requests = [r for run in runs for r in run["requests_detail"]]
    out = summarise(runs[0]["clients"], requests, sum(run["wall_s"] for run in runs))
    out["throughput_by_repeat"] = [run["throughput_tok_s"] for run in runs]
    out["gate_steps"] = {}
    for run in runs:
        for reason, n in run.get("gate_steps", {}).items():
            out["gate_steps"][reason] = out["gate_steps"].get(reason, 0) + n
    return out


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)

    def at(q: float) -> float:
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(values)}


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def serve_and_measure(decoder, tokenizer, eos, max_context: int, args, prompts: list[str], clients: int) -> dict:
    if isinstance(decoder.target_model, LlamaModel):  # modes share the weights: none starts from another's prompts
        decoder.target_model.clear_prompt_cache()
    engine = Engine(decoder, max_batch_size=args.max_batch_size)
    engine.start()
    server = LiveServer(create_app(engine, tokenizer, MODEL, max_context, eos_token_ids=eos))
    try:
        asyncio.run(run_level(server.url, prompts[:1], 1, 1, 4))  # warm-up
        before = engine.metrics().get("speculation", {}).get("steps_by_reason", {})
        result = asyncio.run(run_level(server.url, prompts, clients, args.requests_per_client, args.max_tokens))
        after = engine.metrics().get("speculation", {}).get("steps_by_reason", {})
        result["gate_steps"] = {reason: n - before.get(reason, 0) for reason, n in after.items()
                                if n > before.get(reason, 0)}
        return result
    finally:
        server.close()
        engine.shutdown()


def measure_llama_server(binary: str, gguf: str, args, prompts: list[str], clients: int, extra: list[str]) -> dict:
    """One level against llama-server (started for it, warm-up request first)."""
    server = LlamaServer(binary, gguf, max(clients, 1), args.llama_ctx or 8192, args.llama_threads or 2, extra)
    try:
        asyncio.run(run_level(server.url, prompts[:1], 1, 1, 4))  # warm-up
        return asyncio.run(run_level(server.url, prompts, clients, args.requests_per_client, args.max_tokens))
    finally:
        server.close()


def free_draft_decoder(speculative: SpeculativeDecoder, name: str, tokenizer) -> SpeculativeDecoder:
    """A decoder on ``speculative``'s target weights with a free draft, calibrated as ``verispec.load`` calibrates:
    ``suffix`` (global scope, with the settings ``verispec serve --draft suffix`` takes on this target), ``ngram``
    (prompt lookup), and their trees as ``--trees`` makes them (``suffix-tree``: a tree where it beats the chain per
    step; ``ngram-tree``: the last matches merged where a wide pass costs little; ``docs/trees.md``)."""
    from verispec.decode.calibrate import CALIBRATION_TEXT, calibrate
    from verispec.drafters import NGramDrafter, SuffixDrafter
    from verispec.factory import lookup_matches, suffix_settings

    backend = speculative.target
    drafters = {
        "suffix": lambda: SuffixDrafter(settings=suffix_settings(backend.pass_cost)),
        "suffix-tree": lambda: SuffixDrafter(settings=suffix_settings(backend.pass_cost,
                                                                      trees=backend.tree_branches > 1)),
        "ngram": NGramDrafter,
        "ngram-tree": lambda: NGramDrafter(matches=lookup_matches(backend)),
    }
    if name not in drafters:
        raise SystemExit(f"--also-drafts: {name!r} is not one of {', '.join(drafters)}")
    decoder = SpeculativeDecoder(speculative.target_model, drafter=drafters[name](), vocab_size=speculative.vocab_size)
    calibrate(decoder, tokenizer(CALIBRATION_TEXT)["input_ids"])
    return decoder


def markdown(results: dict) -> str:
    lines = [
        "# Serving benchmark (`benchmarks/serve.py`)", "",
        f"Prompts: `{results.get('prompts', 'prompts.json')}`.", "",
        f"Target `{results['target']}`, draft `{results['draft']}`, greedy, {results['max_tokens']} tokens per "
        f"request, streamed; {results['requests_per_client']} requests per client; {results['repeats']} repeats per "
        f"mode and level ({results.get('order', 'A B B A')}); target backend: {results.get('backend', 'torch')}; machine: {results['machine']}.",
        f"Command: `{results['command']}`", "",
        "| mode | clients | tok/s | speed-up | latency p50 / p90 / p99 (s) | TTFT p50 / p90 (s) | TPOT p50 / p90 (s) "
        "| acceptance | tokens per pass | tok/s by repeat | controller steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in results["levels"]:
        alone = level["target_alone"]["throughput_tok_s"]
        for mode in [m for m in level if m != "target_alone"] + ["target_alone"]:
            r = level[mode]
            lat, ttft, tpot = r["latency_s"], r["ttft_s"], r["tpot_s"]
            acceptance = "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}"
            name = results["draft"] if mode == "speculative" else mode.partition(":")[2]
            label = f"speculative ({name})"
            label = "target alone" if mode == "target_alone" else label
            label = f"llama-server ({mode.partition(':')[2] or 'plain'})" if mode.startswith("llama_server") else label
            lines.append(
                f"| {label} | {r['clients']} | {r['throughput_tok_s']:.2f} | {r['throughput_tok_s'] / alone:.2f}x | "
                f"{lat['p50']:.2f} / {lat['p90']:.2f} / {lat['p99']:.2f} | {ttft['p50']:.2f} / {ttft['p90']:.2f} | "
                f"{tpot.get('p50', 0):.3f} / {tpot.get('p90', 0):.3f} | "
                f"{acceptance} | "
                f"{(r['tokens_per_target_pass'] or 0):.2f} | "
                f"{' / '.join(f'{t:.2f}' for t in r['throughput_by_repeat'])} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(r.get('gate_steps', {}).items())) or '-'} |")
    servers = [mode for mode in results["levels"][0] if mode.startswith("llama_server")] if results["levels"] else []
    for server in servers:
        lines += ["", f"verispec against `{server}` (tok/s ratio) by clients: " + ", ".join(
            f"{level[server]['clients']}: " + " / ".join(
                f"{mode} {level[mode]['throughput_tok_s'] / level[server]['throughput_tok_s']:.2f}x"
                for mode in level if not mode.startswith("llama_server")) for level in results["levels"])]
    if results.get("llama_server_same_as_alone"):
        lines += ["", "llama-server's greedy outputs equal to verispec's target alone (outputs): "
                  + ", ".join(f"{k}: {v}" for k, v in results["llama_server_same_as_alone"].items())]
    lines += ["", f"Greedy outputs identical between verispec's modes at every level: **{results['identical_outputs']}**.",
              "", "Controller steps: the speculation controller's decisions over each mode's repeats, by reason "
              "(`pays`: a cap > 0 beat the target alone at confidence; `alone`: k = 0 for the whole batch; `explore`: "
              "a neighbouring cap run once to measure it; `none`: no row may draft; `priced`: the backend's pass cost "
              "says no draft can pay). The target alone has no controller. Acceptance: drafts kept over drafts made, "
              "pooled over "
              "the level's requests (`-`: nothing drafted).", "",
              "![speculative / target alone by clients](serve.png)", "",
              "The plot: the pooled ratio (line) and each repeat's pair, speculative over the target alone run beside "
              "it (dots): the spread of the pairs is the noise of this shared machine."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Speculative / target-alone throughput by clients: pooled (line) and per repeat pair (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = results["levels"]
    clients = [level["speculative"]["clients"] for level in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in [m for m in levels[0] if m != "target_alone"]:
        name = results["draft"] if mode == "speculative" else mode.partition(":")[2]
        name = mode.replace("_", "-") if mode.startswith("llama_server") else name
        line, = ax.plot(clients, [level[mode]["throughput_tok_s"] / level["target_alone"]["throughput_tok_s"]
                                  for level in levels], "o-", label=f"{name} (pooled over repeats)")
        for level in levels:
            pairs = zip(level[mode]["throughput_by_repeat"], level["target_alone"]["throughput_by_repeat"])
            ratios = [spec / alone for spec, alone in pairs]
            ax.scatter([level[mode]["clients"]] * len(ratios), ratios, color=line.get_color(), s=10, zorder=3,
                       alpha=0.6)
    ax.scatter([], [], color="grey", s=10, label="one repeat's pair")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(0.97, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("speculative / target alone (tokens/s)")
    ax.set_title(f"verispec serve, {results['target']} ({results.get('backend', 'torch')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--num-draft-tokens", default="auto")
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per mode and level, the modes' order rotated each repeat")
    parser.add_argument("--max-batch-size", type=int, default=32, help="as verispec serve's default")
    parser.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.json")),
                        help="a JSON list of {text}, or 'repetitive': suffix/bench.py's workload in the chat template")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts (smoke runs)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "llama.cpp", "torch"],
                        help="the target's backend, as verispec serve's --backend")
    parser.add_argument("--llama-threads", type=int, default=None, help="as verispec serve's --llama-threads")
    parser.add_argument("--llama-ctx", type=int, default=None, help="as verispec serve's --llama-ctx (KV tokens)")
    parser.add_argument("--llama-streams", action=argparse.BooleanOptionalAction, default=None,
                        help="as verispec serve's --llama-streams / --no-llama-streams (default: a KV stream per row)")
    parser.add_argument("--no-llama-prompt-cache", dest="llama_prompt_cache", action="store_false", default=None,
                        help="as verispec serve's: every prompt evaluated whole (the prompt cache is emptied before "
                             "each mode and level either way, so each starts as cold as a llama-server started "
                             "for it)")
    parser.add_argument("--also-drafts", default="", help="comma-separated free drafts (suffix, ngram) measured as "
                        "further modes on the same target weights")
    parser.add_argument("--llama-server", default=None, metavar="BIN",
                        help="also llama.cpp's llama-server on the same GGUF (a slot per client, --kv-unified, "
                             "--llama-ctx cells) as mode 'llama_server'")
    parser.add_argument("--llama-server-spec", default="", metavar="TYPES",
                        help="comma-separated llama-server --spec-type values measured as further modes")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--replot", action="store_true",
                        help="rewrite SERVE.md and serve.png from the serve.json in --out, without measuring")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before minutes of measuring, not after
    if args.replot:
        results = json.loads((out / "serve.json").read_text())
        (out / "SERVE.md").write_text(markdown(results))
        plot(results, out / "serve.png")
        return 0

    model_args = argparse.Namespace(target=args.target, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                                    dtype="float32", device=args.device, fast=True, backend=args.backend,
                                    llama_threads=args.llama_threads, llama_ctx=args.llama_ctx,
                                    llama_streams=args.llama_streams, max_batch_size=args.max_batch_size,
                                    llama_prompt_cache=args.llama_prompt_cache)
    speculative, tokenizer = build_decoder(model_args, log)
    if args.prompts == "repetitive":  # suffix/bench.py's edits, loops and second turns, in the target's template
        sys.path.insert(0, str(Path(__file__).parent / "suffix"))
        from bench import repetitive_prompts  # noqa: E402

        prompts = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
                   for p in repetitive_prompts()][: args.limit]
    else:
        prompts = [p["text"] for p in json.loads(Path(args.prompts).read_text())][: args.limit]  # every kind, raw
    alone = SpeculativeDecoder(speculative.target_model, None, vocab_size=speculative.vocab_size)  # shared weights
    eos = eos_token_ids(tokenizer, speculative.target_model)
    max_context = speculative.max_positions or 4096
    results = {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
               "requests_per_client": args.requests_per_client, "repeats": args.repeats, "command": " ".join(sys.argv),
               "also_drafts": [d for d in args.also_drafts.split(",") if d], "prompts": Path(args.prompts).name,
               "backend": "torch" if isinstance(speculative.target_model, torch.nn.Module) else "llama.cpp",
               "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
               "order": "the modes' order rotated each repeat",
               "levels": []}
    identical = True
    modes = {"speculative": speculative, "target_alone": alone}
    for name in [d for d in args.also_drafts.split(",") if d]:
        modes[f"speculative:{name}"] = free_draft_decoder(speculative, name, tokenizer)
    global COUNT_TOKENS
    COUNT_TOKENS = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    external = {}  # llama.cpp's own server: mode -> extra flags
    if args.llama_server:
        external["llama_server"] = []
        for spec in [t for t in args.llama_server_spec.split(",") if t]:
            external[f"llama_server:{spec}"] = ["--spec-type", spec]
    gguf = str(getattr(speculative.target_model, "path", ""))
    for clients in [int(c) for c in args.concurrency.split(",")]:
        runs: dict[str, list[dict]] = {mode: [] for mode in [*modes, *external]}
        for repeat in range(args.repeats):  # A B C, B C A, C A B: each mode takes each place once in n repeats,
            order = list(modes)[repeat % len(modes):] + list(modes)[:repeat % len(modes)]  # so a drift in machine
            for mode in order + list(external):  # speed, or the first run after a level's start, hits every
                log(f"{mode}, {clients} clients, repeat {repeat + 1}/{args.repeats}")  # mode alike (2: A B B A)
                if mode in external:
                    runs[mode].append(measure_llama_server(args.llama_server, gguf, args, prompts, clients,
                                                           external[mode]))
                else:
                    runs[mode].append(serve_and_measure(modes[mode], tokenizer, eos, max_context, args, prompts,
                                                        clients))
                log(f"  {runs[mode][-1]['throughput_tok_s']:.2f} tok/s, "
                    f"latency p50 {runs[mode][-1]['latency_s']['p50']:.2f} s")
        level = {mode: combine(rs) for mode, rs in runs.items()}
        reference = runs["target_alone"][0]["outputs"]  # prompt -> text
        ours = {mode: rs for mode, rs in runs.items() if mode not in external}  # llama-server's: reported apart
        differing = sorted({prompts.index(prompt) for rs in ours.values() for r in rs
                            for prompt, text in r["outputs"].items() if text != reference.get(prompt)})
        same = not differing and all(r["outputs"].keys() == reference.keys() for rs in ours.values() for r in rs)
        for mode in external:
            level_outputs = [text == reference.get(prompt) for r in runs[mode] for prompt, text in r["outputs"].items()]
            results.setdefault("llama_server_same_as_alone", {})[f"{mode} {clients}"] = \
                f"{sum(level_outputs)} / {len(level_outputs)}"
        results.setdefault("differing_prompts", {})[str(clients)] = differing  # indices into the prompts
        identical = identical and same
        if not same:
            log(f"outputs differ at {clients} clients (a bug, or a near-tie of two logits: see PITFALLS #1)")
        results["levels"].append(level)
        results["identical_outputs"] = identical
        (out / "serve.json").write_text(json.dumps(results, indent=2))  # each level kept as soon as it is measured
    (out / "SERVE.md").write_text(markdown(results))
    plot(results, out / "serve.png")
    log(f"wrote {out / 'serve.json'}, {out / 'SERVE.md'} and {out / 'serve.png'}")
    print((out / "SERVE.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
