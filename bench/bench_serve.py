"""The server under load, on loopback only: `specengine serve` in a child process, driven by the
official openai client.

  phase "one at a time": --sequential requests, each sent when the last ended;
  phase "concurrent":    --clients clients sharing --requests requests;
  phase "soak":          --soak seeded requests over --soak-clients clients; every output is then
                         compared with offline generation (Engine.generate on the same pair), the
                         server's RSS is read after the 100th and the last, and /health must show
                         no request and no cache row left.

Reports total tokens/s, time to first token and time per output token (p50, p99), the gaps
between streamed chunks, and the server's RSS. Every phase is bounded by --time-limit.

  python bench/bench_serve.py                      # the default pair, gamma 2
  python bench/bench_serve.py --soak 1000          # and the 1,000-request soak
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from specengine import Engine, SamplingParams, default_pair
from specengine.benchmark import machine_name
from specengine.corpus import heldout_chat_prompts

from common import write_json


@dataclass
class Sent:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.completion_tokens < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


def requests_for(prompts: list[list[int]], count: int, max_tokens: int, temperature: float,
                 first_seed: int) -> list[Sent]:
    """`count` requests over the prompts in turn, seeded first_seed, first_seed + 1, ..."""
    return [Sent(prompts[i % len(prompts)], max_tokens, temperature, first_seed + i) for i in range(count)]


def percentiles(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"p50": None, "p99": None}
    pick = lambda q: values[min(len(values) - 1, round(q * (len(values) - 1)))]  # noqa: E731
    return {"p50": statistics.median(values), "p99": pick(0.99)}


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory now (VmRSS), or its peak so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


async def send(client: openai.AsyncOpenAI, model: str, request: Sent):
    request.sent_at = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                             temperature=request.temperature, seed=request.seed, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.text:
                request.chunk_times.append(time.perf_counter())
                request.text += choice.text
            request.finish_reason = choice.finish_reason or request.finish_reason
        if chunk.usage:
            request.completion_tokens = chunk.usage.completion_tokens
            request.prompt_tokens = chunk.usage.prompt_tokens


async def run_phase(base_url: str, model: str, requests: list[Sent], clients: int, deadline: float,
                    on_done=None) -> tuple[float, int]:
    """Send the requests over `clients` concurrent clients; (wall seconds, requests completed)."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    pending = iter(requests)
    done = 0

    async def worker():
        nonlocal done
        for request in pending:
            if time.perf_counter() > deadline:
                return
            await send(client, model, request)
            done += 1
            if on_done is not None:
                on_done(done)

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - start, done


def summary(name: str, requests: list[Sent], wall: float, clients: int) -> dict:
    finished = [r for r in requests if r.finish_reason is not None]
    tokens = sum(r.completion_tokens for r in finished)
    gaps = [b - a for r in finished for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out = {"phase": name, "clients": clients, "requests": len(finished), "tokens": tokens, "wall_s": wall,
           "tokens_per_s": tokens / wall if wall else None,
           "ttft_s": percentiles([r.ttft for r in finished]), "tpot_s": percentiles([r.tpot for r in finished]),
           "chunk_gap_s": percentiles(gaps)}
    ms = lambda d: "n/a" if d["p50"] is None else f"{1e3 * d['p50']:.0f}/{1e3 * d['p99']:.0f} ms"  # noqa: E731
    print(f"{name:>13}: {clients} client(s), {len(finished)} requests, {tokens} tokens in {wall:.1f} s = "
          f"{out['tokens_per_s']:.1f} tok/s; TTFT p50/p99 {ms(out['ttft_s'])}, per token {ms(out['tpot_s'])}, "
          f"chunk gaps {ms(out['chunk_gap_s'])}", flush=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, target, draft, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "specengine", "serve", "--target", str(target), "--gamma", str(args.gamma),
               "--max-batch-size", str(args.max_batch_size), "--port", str(port), "--log-level", "warning",
               "--served-model-name", "bench"]
    if draft is not None:
        command += ["--draft", str(draft)]
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not answer /health within 600 s")
        time.sleep(0.5)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target folder (default: the default pair)")
    parser.add_argument("--draft", help="draft folder (with --target; none: target-only)")
    parser.add_argument("--gamma", default="2", help="the server's --gamma (a number keeps seeded outputs "
                                                     "comparable with offline generation; 'auto' adapts)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--sequential", type=int, default=8, help="requests sent one at a time")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests of the concurrent phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--soak", type=int, default=0, help="requests of the soak (0: none)")
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--soak-max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds per phase at most")
    parser.add_argument("--out", help="JSON path (default bench/results/serve-<date>.json)")
    args = parser.parse_args()

    target, draft = (args.target, args.draft) if args.target else default_pair()
    offline = Engine.from_pretrained(target, draft, gamma=int(args.gamma) if args.gamma != "auto" else "auto",
                                     max_batch_size=args.max_batch_size)
    prompts = heldout_chat_prompts(offline.tokenizer, max(args.sequential, args.requests, min(args.soak, 64), 1),
                                   max_tokens=256)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args, target, draft, port)
    result = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "machine": machine_name(),
              "cpu_count": os.cpu_count(), "target": str(target), "draft": str(draft), "gamma": args.gamma,
              "max_batch_size": args.max_batch_size, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "phases": []}
    try:
        warm_up = requests_for(prompts, 2, 8, args.temperature, 10**6)
        asyncio.run(run_phase(base_url, "bench", warm_up, 2, time.perf_counter() + 600))
        result["rss_mib_start"] = rss_mib(server.pid)
        alone = requests_for(prompts, args.sequential, args.max_tokens, args.temperature, 0)
        together = requests_for(prompts, args.requests, args.max_tokens, args.temperature, 1000)
        for name, requests, clients in (("one at a time", alone, 1), ("concurrent", together, args.clients)):
            wall, _ = asyncio.run(run_phase(base_url, "bench", requests, clients,
                                            time.perf_counter() + args.time_limit))
            result["phases"].append(summary(name, requests, wall, clients))
        one, many = result["phases"]
        result["concurrent_over_one_at_a_time"] = many["tokens_per_s"] / one["tokens_per_s"]
        print(f"concurrent / one at a time: {result['concurrent_over_one_at_a_time']:.2f}x", flush=True)
        if args.soak:
            result["soak"] = soak(args, base_url, server, offline, prompts)
        result["rss_mib_end"] = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    write_json(result, args.out, f"serve-{datetime.date.today().isoformat()}.json")


def soak(args, base_url: str, server, offline: Engine, prompts) -> dict:
    requests = requests_for(prompts, args.soak, args.soak_max_tokens, args.temperature, 5000)
    # The RSS at one moment swings by a few tens of MiB (allocations that come and go with a
    # prefill); the peak so far (VmHWM) is what a leak would raise.
    rss, peak = {}, {}

    def on_done(n):
        if n % 100 == 0 or n == args.soak:
            rss[n], peak[n] = rss_mib(server.pid), rss_mib(server.pid, "VmHWM")
            print(f"  soak: {n} done, server RSS {rss[n]:.0f} MiB, peak {peak[n]:.0f} MiB", flush=True)

    wall, done = asyncio.run(run_phase(base_url, "bench", requests, args.soak_clients,
                                       time.perf_counter() + args.time_limit, on_done))
    out = summary("soak", requests, wall, args.soak_clients)
    health = httpx.get(base_url + "/health", timeout=10).json()
    print(f"  offline generation of the {done} requests ...", flush=True)
    want = offline.generate([r.prompt for r in requests[:done]],
                            [SamplingParams(max_new_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed)
                             for r in requests[:done]])
    mismatched = [i for i, (r, w) in enumerate(zip(requests, want))
                  if r.text != w.text or r.completion_tokens != len(w.token_ids)]
    # A lost request never ends its stream; a duplicated one would show as text that is not its own.
    out.update(completed=done, without_finish_reason=sum(r.finish_reason is None for r in requests[:done]),
               mismatched=len(mismatched),
               mismatched_first=mismatched[:10], rss_mib_at=rss, peak_rss_mib_at=peak, health_after=health)
    if 100 in rss and args.soak in rss:
        out["rss_growth_100_to_last"] = rss[args.soak] / rss[100] - 1
        out["peak_rss_growth_100_to_last"] = peak[args.soak] / peak[100] - 1
    print(f"  soak: {done}/{args.soak} completed, {len(mismatched)} differ from offline generation; RSS "
          f"{rss.get(100, float('nan')):.0f} -> {rss.get(args.soak, float('nan')):.0f} MiB, peak "
          f"{peak.get(100, float('nan')):.0f} -> {peak.get(args.soak, float('nan')):.0f} MiB "
          f"(after the 100th and the last); /health after: {health}", flush=True)
    return out


if __name__ == "__main__":
    main()
