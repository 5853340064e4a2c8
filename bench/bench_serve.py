"""The server under load, on loopback only: `specengine serve` in a child process, driven by the
official openai client.

  phase "one at a time": --sequential requests, each sent when the last ended;
  phase "concurrent":    --clients clients sharing --requests requests;
  phase "soak":          --soak seeded requests over --soak-clients clients; every output is then
                         compared with offline generation (Engine.generate on the same pair), the
                         server's RSS is read at its start, every tenth of it and after the last,
                         and /health must show no request and no cache row left.

In the soak, --disconnect-fraction of the clients go away before their answer ends: a streamed one
closes its stream after a random number of chunks, a non-streamed one (--non-streaming-fraction
of the requests are) closes its connection after a random part of a request's usual time. The
server has no other way to end a request early: a disconnect is its abort. Then every request that
stayed must have ended with its seeded offline output, every streamed part a prefix of its offline
output, and the server must go idle (/health empty, no steps, near no CPU) with its memory flat.
The soak's verdict is in the JSON and a markdown summary beside it; the script exits 1 if it fails.

  phase "joins" (--joins N): prompts of --join-prompt-tokens tokens (distinct) joining while others
                         decode: first N one at a time (the single-stream figures), then N over
                         --clients clients that start --join-stagger seconds apart. Reported: the
                         gaps between a running stream's chunks and the time to first token, p50 and
                         p99, and their ratios to the single-stream figures (chunked prefill's
                         targets: p99 gap at most 2x the single-stream gap, TTFT p50 at most 2x);
  phase "prefix" (--prefix-pairs N): N pairs of requests on an idle server, each pair sharing a
                         --prefix-tokens-token prefix of its own: the first computes it, the second
                         finds it in the prefix cache. Reported: both times to first token and their
                         ratio (target: the second at least 4x sooner).

--api-key KEY serves with the key (given to the server in SPECENGINE_API_KEY, out of the process
list) and sends it; --max-waiting N caps the server's queue, so that with more clients than
--max-batch-size + N some requests get 503. In the soak, a client refused with 503 waits the
Retry-After it was given and sends the same request again (--max-refusals times at most), as the
openai client does; --wrong-key-fraction of the requests carry a key the server does not hold
and must get 401. Every refusal must be clean (503 with Retry-After, 401 with WWW-Authenticate,
both in OpenAI's error shape), the server's requests_refused_total must count each one, and every
request accepted must end with its offline output, as above.

--soak-shared-prefixes K builds the soak's prompts as one of K shared prefixes (32 to
--prefix-tokens tokens, mixed) followed by a held-out chat prompt: the prefix cache then serves
(and evicts, and is aborted with) most of them, and every output must still equal offline
generation.

Reports total tokens/s, time to first token and time per output token (p50, p99), the gaps
between streamed chunks, and the server's RSS. Every phase is bounded by --time-limit.

  python bench/bench_serve.py                      # the default pair, gamma 2
  python bench/bench_serve.py --soak 1000          # and the 1,000-request soak
  python bench/bench_serve.py --gamma 2 --soak 1000 --disconnect-fraction 0.2 --non-streaming-fraction 0.25
  python bench/bench_serve.py --gamma 2 --soak-only --soak 40 --soak-max-tokens 16 --disconnect-fraction 0.3 \
      --non-streaming-fraction 0.25                # the same in miniature (a minute or two)
  python bench/bench_serve.py --sequential 0 --requests 0 --joins 16 --prefix-pairs 4   # chunked prefill, prefix cache
  python bench/bench_serve.py --gamma 2 --soak-only --soak 1000 --soak-shared-prefixes 8 --disconnect-fraction 0.2 \
      --non-streaming-fraction 0.25                # the soak with shared prefixes
  python bench/bench_serve.py --gamma 2 --soak-only --soak 120 --soak-clients 10 --max-batch-size 4 --max-waiting 2 \
      --api-key sk-soak --wrong-key-fraction 0.05 --disconnect-fraction 0.2 --non-streaming-fraction 0.25 \
      --prefix-cache-mib 0                         # with a key and a full queue
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import torch

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.devtools.corpus import heldout_chat_prompts, is_held_out, read, stdlib_files

from common import RESULTS, write_json

# What "flat" and "idle" mean for the soak's verdict. The RSS at one moment swings by a few tens of
# MiB with the prefills under way, against about 1 GiB for the default pair; a leak of a request's
# state or a cache row per request would grow it by far more over hundreds of requests.
RSS_GROWTH_LIMIT = 0.05           # RSS after the last request against after the middle one
IDLE_CPU_LIMIT = 0.05             # the server's CPU, in cores, over IDLE_WINDOW_S after it went idle
IDLE_WINDOW_S = 3.0
IDLE_WAIT_S = 60.0                # how long the server may take to end the requests left behind


@dataclass
class Sent:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool = True
    # A client that goes away before its answer ends: a streamed one closes its stream after this
    # many text chunks; a non-streamed one closes its connection after this fraction of a
    # request's usual time (leave_after_s, set when it is sent).
    leave_after_chunks: int | None = None
    leave_at_fraction: float | None = None
    leave_after_s: float | None = None
    left: bool = False        # it did go away before the end (else it ended, and stayed)
    error: str | None = None  # what failed, where the soak keeps going past a failed request
    wrong_key: bool = False   # sent with a key the server does not hold: it must be refused (401)
    refusals: list = field(default_factory=list)  # a Refusal for each time the server refused it
    refused: bool = False     # refused for good: 401, or 503 more than --max-refusals times
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    sent_at: float = 0.0
    ended_at: float | None = None
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


@dataclass
class Refusal:
    status: int
    retry_after: str | None
    problems: list[str]       # how the answer differs from a clean refusal; empty: clean


def refusal_of(exc: openai.APIStatusError) -> Refusal:
    """A 401 or 503 as the client got it, and whether it was clean: OpenAI's error shape, a
    Retry-After of whole seconds on a 503 (what a client waits before trying again), a Bearer
    challenge and the code invalid_api_key on a 401."""
    response, problems = exc.response, []
    try:
        error = response.json()["error"]
        if not isinstance(error.get("message"), str) or not error["message"]:
            problems.append("no error message")
    except (ValueError, KeyError, TypeError, AttributeError):
        error = {}
        problems.append(f"not OpenAI's error shape: {response.text[:200]!r}")
    retry_after = response.headers.get("retry-after")
    if exc.status_code == 503:
        if not (retry_after or "").isdigit() or int(retry_after) < 1:
            problems.append(f"Retry-After {retry_after!r}")
        if error and error.get("type") != "server_error":
            problems.append(f"type {error.get('type')!r}")
    elif exc.status_code == 401:
        if response.headers.get("www-authenticate") != "Bearer":
            problems.append(f"WWW-Authenticate {response.headers.get('www-authenticate')!r}")
        if error and error.get("code") != "invalid_api_key":
            problems.append(f"code {error.get('code')!r}")
    return Refusal(exc.status_code, retry_after, problems)


def requests_for(prompts: list[list[int]], count: int, max_tokens: int, temperature: float,
                 first_seed: int) -> list[Sent]:
    """`count` requests over the prompts in turn, seeded first_seed, first_seed + 1, ..."""
    return [Sent(prompts[i % len(prompts)], max_tokens, temperature, first_seed + i) for i in range(count)]


def code_tokens(tokenizer, count: int, start: int) -> list[int]:
    """`count` token ids of held-out standard-library source, from the start-th held-out file on
    (distinct starts give distinct texts, so no prompt shares a prefix block with another by chance)."""
    files = [p for p in stdlib_files() if is_held_out(p)]
    out: list[int] = []
    for path in files[start % len(files):] + files[:start % len(files)]:
        out += tokenizer(read(path), add_special_tokens=False)["input_ids"]
        if len(out) >= count:
            return out[:count]
    raise ValueError(f"the held-out files hold fewer than {count} tokens")


def long_prompts(tokenizer, count: int, tokens: int, first: int) -> list[list[int]]:
    """`count` distinct prompts of `tokens` tokens: a held-out chat prompt after source code."""
    chats = heldout_chat_prompts(tokenizer, count, max_tokens=min(tokens // 2, 256))
    return [code_tokens(tokenizer, tokens - len(chat), first + i) + chat for i, chat in enumerate(chats)]


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
    if not request.stream:
        await send_unstreamed(client, model, request)
        request.ended_at = time.perf_counter()
        return
    stream = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                             temperature=request.temperature, seed=request.seed, stream=True,
                                             stream_options={"include_usage": True})
    if request.leave_after_chunks == 0:
        await stream.close()  # gone before the first token: the request may still be waiting
        request.left = True
        return
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
        if (request.leave_after_chunks is not None and request.finish_reason is None
                and len(request.chunk_times) >= request.leave_after_chunks):
            # Closing a response before its end closes its connection (httpx cannot reuse it):
            # to the server, the client is gone.
            await stream.close()
            request.left = True
            return
    request.ended_at = time.perf_counter()


async def send_unstreamed(client: openai.AsyncOpenAI, model: str, request: Sent):
    """One request without streaming; a leaving client cancels it mid-flight, which closes its
    connection while the server still works on the answer (or has it waiting)."""
    answer = client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                       temperature=request.temperature, seed=request.seed, stream=False)
    try:
        response = await asyncio.wait_for(answer, request.leave_after_s)
    except asyncio.TimeoutError:
        request.left = True
        return
    choice = response.choices[0]  # no chunks: no time to first token, nor per token
    request.text, request.finish_reason = choice.text, choice.finish_reason
    request.completion_tokens, request.prompt_tokens = response.usage.completion_tokens, response.usage.prompt_tokens


# The key a --wrong-key-fraction request carries: not the server's, whatever that is.
WRONG_KEY = "sk-not-the-servers-key"


async def run_phase(base_url: str, model: str, requests: list[Sent], clients: int, deadline: float,
                    on_done=None, before_send=None, keep_going: bool = False,
                    stagger: float = 0.0, api_key: str | None = None,
                    max_refusals: int = 0) -> tuple[float, int]:
    """Send the requests over `clients` concurrent clients; (wall seconds, requests sent and ended,
    answered or not). keep_going: a request that fails is recorded (request.error) and the next
    sent, instead of ending the phase. stagger: client k sends its first request k * stagger
    seconds after the first client. api_key: the key the requests carry (a request.wrong_key one
    carries another). max_refusals: a request refused with 503 is sent again after its Retry-After,
    this many times at most; a 401 is final; each refusal is recorded in request.refusals (with
    max_refusals 0 a refusal fails the request as any error does)."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    wrong = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=WRONG_KEY, max_retries=0, timeout=600)
    pending = iter(requests)
    done = 0

    async def worker(k: int):
        nonlocal done
        await asyncio.sleep(k * stagger)
        for request in pending:
            if time.perf_counter() > deadline:
                return
            if before_send is not None:
                before_send(request)
            while True:
                try:
                    await send(wrong if request.wrong_key else client, model, request)
                except openai.APIStatusError as exc:
                    if not max_refusals or exc.status_code not in (401, 503):
                        if not keep_going:
                            raise
                        request.error = f"{type(exc).__name__}: {exc}"
                        break
                    refusal = refusal_of(exc)
                    request.refusals.append(refusal)
                    if exc.status_code == 401 or len(request.refusals) > max_refusals:
                        request.refused = True
                        break
                    # The wait the server asked for; a missing or bad Retry-After is recorded as
                    # unclean above, and waited as one second.
                    await asyncio.sleep(int(refusal.retry_after) if not refusal.problems else 1)
                    continue
                except (openai.OpenAIError, httpx.HTTPError) as exc:
                    if not keep_going:
                        raise
                    request.error = f"{type(exc).__name__}: {exc}"
                break
            done += 1
            if on_done is not None:
                on_done(done)

    start = time.perf_counter()
    async with client, wrong:
        await asyncio.gather(*(worker(k) for k in range(clients)))
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


def without_key(argv: list[str]) -> list[str]:
    """The command line with --api-key's value masked, for the record."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "KEY"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=KEY"
    return out


def access(args) -> dict:
    """run_phase's key and refusal handling, from the command line."""
    return dict(api_key=args.api_key, max_refusals=args.max_refusals)


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
    command += ["--prefill-chunk-tokens", str(args.prefill_chunk_tokens), "--prefix-cache-mib",
                str(args.prefix_cache_mib)]
    if args.max_waiting is not None:
        command += ["--max-waiting", str(args.max_waiting)]
    env = dict(os.environ)
    env.pop("SPECENGINE_API_KEY", None)  # a key of the caller's must not close a server meant to be open
    if args.api_key is not None:
        env["SPECENGINE_API_KEY"] = args.api_key  # in the environment: out of the process list
    server = subprocess.Popen(command, env=env)
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


def cpu_description() -> dict:
    """The CPU as lscpu names it (its model, CPUs, cores per socket, sockets), with the CPUs this
    process may use; /proc/cpuinfo's model name where lscpu is missing."""
    out = {"cpus_usable": len(os.sched_getaffinity(0))}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    for name, key in (("Model name", "model"), ("CPU(s)", "cpus"), ("Core(s) per socket", "cores_per_socket"),
                      ("Socket(s)", "sockets"), ("Thread(s) per core", "threads_per_core")):
        if name in fields:
            out[key] = fields[name].strip()
    if "model" not in out:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["model"] = line.split(":", 1)[1].strip()
                break
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


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
    parser.add_argument("--soak-only", action="store_true", help="the soak alone, without the first two phases")
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--soak-max-tokens", type=int, default=32)
    parser.add_argument("--disconnect-fraction", type=float, default=0.0,
                        help="soak requests whose client goes away before the answer ends (default 0)")
    parser.add_argument("--non-streaming-fraction", type=float, default=0.0,
                        help="soak requests sent without streaming (default 0: all streamed)")
    parser.add_argument("--soak-seed", type=int, default=0, help="seeds which clients go away, and when")
    parser.add_argument("--soak-shared-prefixes", type=int, default=0, metavar="K",
                        help="soak prompts start with one of K shared prefixes of mixed lengths (default 0: none)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="the server needs this key, and the requests carry it (default: no key)")
    parser.add_argument("--max-waiting", type=int, metavar="N", help="the server's --max-waiting (default: no limit)")
    parser.add_argument("--max-refusals", type=int, default=30, metavar="N",
                        help="a request refused with 503 is sent again after its Retry-After, N times at most "
                             "(default 30)")
    parser.add_argument("--wrong-key-fraction", type=float, default=0.0,
                        help="soak requests sent with a key the server does not hold, which must get 401 (needs "
                             "--api-key; default 0)")
    parser.add_argument("--joins", type=int, default=0, metavar="N",
                        help="requests of the joins phase, one at a time and then concurrent (default 0: none)")
    parser.add_argument("--join-prompt-tokens", type=int, default=500)
    parser.add_argument("--join-max-tokens", type=int, default=64)
    parser.add_argument("--join-stagger", type=float, default=1.0, metavar="SECONDS",
                        help="between the concurrent clients' first requests (default 1)")
    parser.add_argument("--prefix-pairs", type=int, default=0, metavar="N",
                        help="request pairs of the prefix phase (default 0: none)")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefill-chunk-tokens", default="auto", help="the server's --prefill-chunk-tokens")
    parser.add_argument("--prefix-cache-mib", default="auto", help="the server's --prefix-cache-mib")
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds per phase at most")
    parser.add_argument("--out", help="JSON path (default bench/results/serve-<date>.json, serve-soak-<date>.json "
                                      "with --soak-only); a soak's markdown summary goes beside it")
    args = parser.parse_args()
    for name in ("disconnect_fraction", "non_streaming_fraction", "wrong_key_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.soak_only and args.soak < 1:
        parser.error("--soak-only needs --soak N")
    if args.wrong_key_fraction and args.api_key is None:
        parser.error("--wrong-key-fraction needs --api-key: without a key every key is accepted")
    if args.api_key is not None and (not args.api_key or args.api_key == WRONG_KEY):
        parser.error(f"--api-key must be a key other than {WRONG_KEY!r} (the wrong key's)")
    if args.max_waiting is not None and args.max_waiting < 0:
        parser.error(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.max_refusals < 0:
        parser.error(f"--max-refusals must be >= 0, got {args.max_refusals}")

    target, draft = (args.target, args.draft) if args.target else default_pair()
    offline = Engine.from_pretrained(target, draft, gamma=int(args.gamma) if args.gamma != "auto" else "auto",
                                     max_batch_size=args.max_batch_size)
    prompts = heldout_chat_prompts(offline.tokenizer, max(args.sequential, args.requests, min(args.soak, 64), 1),
                                   max_tokens=256)
    if args.soak_shared_prefixes:
        # Prefixes of mixed lengths, 32 tokens to --prefix-tokens, each shared by a share of the prompts.
        k = args.soak_shared_prefixes
        lengths = [32 + (args.prefix_tokens - 32) * i // max(k - 1, 1) for i in range(k)]
        prefixes = [code_tokens(offline.tokenizer, n, 1000 + i) for i, n in enumerate(lengths)]
        prompts = [prefixes[i % k] + p for i, p in enumerate(prompts)]
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args, target, draft, port)
    result = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "machine": machine_name(),
              "cpu": cpu_description(), "cpu_count": os.cpu_count(), "target": str(target), "draft": str(draft),
              "gamma": args.gamma, "max_batch_size": args.max_batch_size, "max_tokens": args.max_tokens,
              "api_key": "set" if args.api_key is not None else None, "max_waiting": args.max_waiting,
              "temperature": args.temperature,
              "command": " ".join([Path(sys.argv[0]).name] + without_key(sys.argv[1:])),
              "phases": []}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    try:
        warm_up = requests_for(prompts, 2, 8, args.temperature, 10**6)
        asyncio.run(run_phase(base_url, "bench", warm_up, 2, time.perf_counter() + 600, **access(args)))
        result["rss_mib_start"] = rss_mib(server.pid)
        if not args.soak_only and (args.sequential or args.requests):
            alone = requests_for(prompts, args.sequential, args.max_tokens, args.temperature, 0)
            together = requests_for(prompts, args.requests, args.max_tokens, args.temperature, 1000)
            for name, requests, clients in (("one at a time", alone, 1), ("concurrent", together, args.clients)):
                wall, _ = asyncio.run(run_phase(base_url, "bench", requests, clients,
                                                time.perf_counter() + args.time_limit, **access(args)))
                result["phases"].append(summary(name, requests, wall, clients))
            one, many = result["phases"]
            if one["tokens_per_s"] and many["tokens_per_s"]:
                result["concurrent_over_one_at_a_time"] = many["tokens_per_s"] / one["tokens_per_s"]
                print(f"concurrent / one at a time: {result['concurrent_over_one_at_a_time']:.2f}x", flush=True)
        if args.joins and not args.soak_only:
            result["joins"] = joins(args, base_url, offline.tokenizer)
        if args.prefix_pairs and not args.soak_only:
            result["prefix"] = prefix_pairs(args, base_url, offline.tokenizer)
        if args.soak:
            result["soak"] = soak(args, base_url, server, offline, prompts)
        result["rss_mib_end"] = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    date = datetime.date.today().isoformat()
    path = Path(args.out) if args.out else RESULTS / f"serve{'-soak' if args.soak_only else ''}-{date}.json"
    write_json(result, str(path), path.name)
    if args.soak:
        markdown = path.with_suffix(".md")
        markdown.write_text(soak_markdown(result))
        print(f"wrote {markdown}")
        if not result["soak"]["passed"]:
            sys.exit(1)


def joins(args, base_url: str, tokenizer) -> dict:
    """Prompts of --join-prompt-tokens joining while others decode: one at a time, then over
    --clients clients starting --join-stagger s apart (each sends its requests back to back)."""
    n, deadline = args.joins, lambda: time.perf_counter() + args.time_limit  # noqa: E731
    prompts = long_prompts(tokenizer, 2 * n, args.join_prompt_tokens, first=0)
    alone = [Sent(p, args.join_max_tokens, args.temperature, 20000 + i) for i, p in enumerate(prompts[:n])]
    wall, _ = asyncio.run(run_phase(base_url, "bench", alone, 1, deadline(), **access(args)))
    single = summary("joins, alone", alone, wall, 1)
    together = [Sent(p, args.join_max_tokens, args.temperature, 30000 + i) for i, p in enumerate(prompts[n:])]
    wall, _ = asyncio.run(run_phase(base_url, "bench", together, args.clients, deadline(),
                                    stagger=args.join_stagger, **access(args)))
    many = summary(f"joins, {args.clients} streams", together, wall, args.clients)
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    out = dict(prompt_tokens=args.join_prompt_tokens, max_tokens=args.join_max_tokens, stagger_s=args.join_stagger,
               alone=single, concurrent=many,
               # Chunked prefill's targets: a running stream's p99 gap and the p50 time to first token
               # at most 2x the single-stream figures.
               p99_gap_over_single_p50_gap=ratio(many["chunk_gap_s"]["p99"], single["chunk_gap_s"]["p50"]),
               p99_gap_over_single_p99_gap=ratio(many["chunk_gap_s"]["p99"], single["chunk_gap_s"]["p99"]),
               p99_gap_over_p50_gap=ratio(many["chunk_gap_s"]["p99"], many["chunk_gap_s"]["p50"]),
               ttft_p50_over_single=ratio(many["ttft_s"]["p50"], single["ttft_s"]["p50"]))
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
    print(f"        joins: p99 gap / single-stream p50 gap {fmt(out['p99_gap_over_single_p50_gap'])}, / single-stream "
          f"p99 gap {fmt(out['p99_gap_over_single_p99_gap'])}, / p50 gap at {args.clients} streams "
          f"{fmt(out['p99_gap_over_p50_gap'])}; TTFT p50 / single {fmt(out['ttft_p50_over_single'])}", flush=True)
    return out


def prefix_pairs(args, base_url: str, tokenizer) -> dict:
    """Pairs of requests on an idle server, each pair sharing a prefix of --prefix-tokens tokens:
    the first prefills it, the second finds it in the prefix cache."""
    chats = heldout_chat_prompts(tokenizer, 2 * args.prefix_pairs, max_tokens=128)
    pairs = []
    for i in range(args.prefix_pairs):
        prefix = code_tokens(tokenizer, args.prefix_tokens, 500 + i)
        first, second = (Sent(prefix + chats[2 * i + j], 8, args.temperature, 40000 + 2 * i + j) for j in range(2))
        for request in (first, second):
            asyncio.run(run_phase(base_url, "bench", [request], 1, time.perf_counter() + args.time_limit,
                                  **access(args)))
        pairs.append((first.ttft, second.ttft))
    cold = statistics.median(a for a, _ in pairs)
    warm = statistics.median(b for _, b in pairs)
    out = dict(prefix_tokens=args.prefix_tokens, pairs=len(pairs), ttft_first_s=[a for a, _ in pairs],
               ttft_second_s=[b for _, b in pairs], ttft_first_p50_s=cold, ttft_second_p50_s=warm,
               speedup=cold / warm if warm else None)
    print(f"       prefix: {len(pairs)} pairs sharing {args.prefix_tokens} tokens: TTFT p50 {1e3 * cold:.0f} ms first, "
          f"{1e3 * warm:.0f} ms second ({out['speedup']:.1f}x sooner)", flush=True)
    return out


def plan_departures(requests: list[Sent], args):
    """Which soak clients stream, which go away before their answer ends, and when (seeded by
    --soak-seed: a rerun sends the same mix)."""
    rng = random.Random(args.soak_seed)
    for request in requests:
        request.stream = rng.random() >= args.non_streaming_fraction
        request.wrong_key = rng.random() < args.wrong_key_fraction
        # A wrong key's client stays to read its 401 (that it gets one is what it is sent for).
        if rng.random() < args.disconnect_fraction and not request.wrong_key:
            if request.stream:
                # Up to half the tokens in chunks (a round sends one to gamma + 1 tokens): most
                # leave before the end, some before the first token.
                request.leave_after_chunks = rng.randint(0, request.max_tokens // 2)
            else:
                request.leave_at_fraction = rng.random()


def soak(args, base_url: str, server, offline: Engine, prompts) -> dict:
    requests = requests_for(prompts, args.soak, args.soak_max_tokens, args.temperature, 5000)
    plan_departures(requests, args)
    # The RSS at one moment swings by a few tens of MiB (allocations that come and go with a
    # prefill); the peak so far (VmHWM) is what a leak would raise.
    rss, peak = {0: rss_mib(server.pid)}, {0: rss_mib(server.pid, "VmHWM")}
    every = max(1, args.soak // 10)
    middle = args.soak // 2

    def before_send(request: Sent):
        # A non-streamed client leaves within a request's usual time so far (1 s before any ended):
        # some while theirs waits for a row, most while it decodes.
        if request.leave_at_fraction is not None:
            times = [r.ended_at - r.sent_at for r in requests if r.ended_at is not None]
            request.leave_after_s = request.leave_at_fraction * (statistics.median(times) if times else 1.0)

    def on_done(n):
        if n % every == 0 or n in (middle, args.soak):
            rss[n], peak[n] = rss_mib(server.pid), rss_mib(server.pid, "VmHWM")
            print(f"  soak: {n} done, server RSS {rss[n]:.0f} MiB, peak {peak[n]:.0f} MiB", flush=True)

    wall, done = asyncio.run(run_phase(base_url, "bench", requests, args.soak_clients,
                                       time.perf_counter() + args.time_limit, on_done, before_send, keep_going=True,
                                       **access(args)))
    out = summary("soak", requests, wall, args.soak_clients)
    idle = wait_until_idle(base_url, server)
    sent_all = [r for r in requests if r.sent_at]
    # The requests the server accepted, in the end (some after 503s): the others never reached it.
    sent = [r for r in sent_all if not r.refused]
    print(f"  offline generation of the {len(sent)} requests accepted ...", flush=True)
    want = offline.generate([r.prompt for r in sent],
                            [SamplingParams(max_new_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed)
                             for r in sent])
    stayed = [(i, r, w) for i, (r, w) in enumerate(zip(sent, want)) if not r.left and r.error is None]
    # A lost request never ends its stream (or its answer); a duplicated one would show as text
    # that is not its own.
    lost = [i for i, r, _ in stayed if r.finish_reason is None]
    mismatched = [i for i, r, w in stayed
                  if r.finish_reason is not None and (r.text != w.text or r.completion_tokens != len(w.token_ids))]
    # What a client read before it left was the start of its answer: the batch it left did not
    # change it, nor did the others leaving.
    partial = [(i, r, w) for i, (r, w) in enumerate(zip(sent, want)) if r.left and r.stream]
    not_prefix = [i for i, r, w in partial if not w.text.startswith(r.text)]
    errors = [(i, r.error) for i, r in enumerate(sent_all) if r.error is not None]
    left = [r for r in sent if r.left]
    refusals = [f for r in sent_all for f in r.refusals]
    unclean = [(i, f.status, f.problems) for i, r in enumerate(sent_all) for f in r.refusals if f.problems]
    # A request sent with the wrong key that was served, or a right one refused with 401: the key
    # check let through what it should not, or shut out what it should not.
    key_wrongly_handled = [i for i, r in enumerate(sent_all)
                           if r.wrong_key != any(f.status == 401 for f in r.refusals)]
    counted = refused_counts(base_url)
    seen = {"queue_full": sum(f.status == 503 for f in refusals),
            "unauthorized": sum(f.status == 401 for f in refusals)}
    out.update(
        parameters=dict(requests=args.soak, clients=args.soak_clients, max_tokens=args.soak_max_tokens,
                        disconnect_fraction=args.disconnect_fraction,
                        non_streaming_fraction=args.non_streaming_fraction, soak_seed=args.soak_seed,
                        shared_prefixes=args.soak_shared_prefixes),
        prompt_tokens_by_source=prompt_tokens_by_source(base_url),
        completed=done, sent=len(sent_all), not_sent=args.soak - len(sent_all),
        streamed=sum(r.stream for r in sent_all), non_streamed=sum(not r.stream for r in sent_all),
        planned_to_leave=sum(r.leave_after_chunks is not None or r.leave_at_fraction is not None for r in sent),
        left=len(left), left_streamed=sum(r.stream for r in left),
        left_before_first_chunk=sum(r.stream and not r.chunk_times for r in left),
        left_non_streamed=sum(not r.stream for r in left), stayed=len(stayed),
        without_finish_reason=len(lost), lost_first=lost[:10], mismatched=len(mismatched),
        mismatched_first=mismatched[:10], partial_not_prefix=len(not_prefix),
        partial_not_prefix_first=not_prefix[:10], errors=len(errors), errors_first=errors[:5],
        rss_mib_at=rss, peak_rss_mib_at=peak, **idle,
        api_key="set" if args.api_key is not None else None, max_waiting=args.max_waiting,
        wrong_key_fraction=args.wrong_key_fraction, max_refusals=args.max_refusals,
        wrong_key_requests=sum(r.wrong_key for r in sent_all),
        refused_503=seen["queue_full"], refused_401=seen["unauthorized"],
        requests_refused_503_at_least_once=sum(any(f.status == 503 for f in r.refusals) for r in sent_all),
        most_503s_of_a_request=max((sum(f.status == 503 for f in r.refusals) for r in sent_all), default=0),
        gave_up_after_503s=sum(r.refused and not r.wrong_key for r in sent_all),
        accepted=len(sent), unclean_refusals=len(unclean), unclean_refusals_first=unclean[:10],
        key_wrongly_handled=len(key_wrongly_handled), key_wrongly_handled_first=key_wrongly_handled[:10],
        requests_refused_total=counted)
    out["rss_mib_start"], out["rss_mib_middle"], out["rss_mib_end"] = rss[0], rss.get(middle), rss.get(done)
    if out["rss_mib_middle"] and out["rss_mib_end"]:
        out["rss_growth_middle_to_end"] = out["rss_mib_end"] / out["rss_mib_middle"] - 1
        out["peak_rss_growth_middle_to_end"] = peak[done] / peak[middle] - 1
    if 100 in rss and args.soak in rss:
        out["rss_growth_100_to_last"] = rss[args.soak] / rss[100] - 1
        out["peak_rss_growth_100_to_last"] = peak[args.soak] / peak[100] - 1
    health = idle["health_after"]
    empty = health is not None and health["running"] == health["waiting"] == health["cache_rows_in_use"] == 0
    out["checks"] = checks = {
        "all_sent": out["not_sent"] == 0,
        "no_errors": not errors,
        "none_lost": not lost,
        "outputs_equal_offline": not mismatched,
        "partial_outputs_are_prefixes": not not_prefix,
        "memory_flat": out.get("rss_growth_middle_to_end", 0.0) <= RSS_GROWTH_LIMIT,
        "refusals_clean": not unclean,
        "keys_checked": not key_wrongly_handled,
        # The warm-up's two requests are never refused: every refusal counted is the soak's. A
        # non-streamed client that went away may have left before its refusal came (a refusal
        # waits for the event loop like any answer): the server counted it, the client never read it.
        "refusals_counted": counted is not None and counted.get("unauthorized") == seen["unauthorized"]
        and 0 <= counted.get("queue_full", 0) - seen["queue_full"] <= out["left_non_streamed"],
        "server_idle": empty,
        "no_steps_when_idle": idle["steps_while_idle"] == 0,
        "cpu_idle": idle["idle_cpu_cores"] is not None and idle["idle_cpu_cores"] <= IDLE_CPU_LIMIT,
    }
    if args.max_waiting is not None:
        checks["queue_filled"] = seen["queue_full"] > 0  # else the run did not test a full queue
    if args.wrong_key_fraction:
        checks["wrong_keys_sent"] = out["wrong_key_requests"] > 0
    out["passed"] = all(checks.values())
    print(f"  soak: {len(sent_all)}/{args.soak} sent, {len(sent)} accepted, {len(left)} left early "
          f"({out['left_streamed']} streamed, "
          f"{out['left_non_streamed']} not), {len(stayed)} stayed: {len(lost)} lost, {len(mismatched)} differ from "
          f"offline generation, {len(not_prefix)} partial outputs not a prefix of offline, {len(errors)} errors; "
          f"RSS {rss[0]:.0f} -> {rss.get(middle, float('nan')):.0f} -> {rss.get(done, float('nan')):.0f} MiB "
          f"(start, middle, end), peak {peak.get(done, float('nan')):.0f} MiB; idle after "
          f"{idle['seconds_to_idle']} s, CPU {idle['idle_cpu_cores']} cores over {IDLE_WINDOW_S:g} s; "
          f"/health after: {health}", flush=True)
    if args.api_key is not None or args.max_waiting is not None:
        print(f"  soak: refusals {seen['queue_full']} x 503 ({out['requests_refused_503_at_least_once']} requests, "
              f"at most {out['most_503s_of_a_request']} each, {out['gave_up_after_503s']} gave up), "
              f"{seen['unauthorized']} x 401 of {out['wrong_key_requests']} wrong keys; {len(unclean)} unclean; "
              f"server counted {counted}", flush=True)
    failed = [name for name, ok in checks.items() if not ok]
    print(f"  soak: {'PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}", flush=True)
    return out


def counts_by_label(base_url: str, metric: str, label: str) -> dict | None:
    """A labelled counter of the server's so far, by the label's value (GET /metrics)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith(f"specengine:{metric}{{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = float(line.rsplit(" ", 1)[1])
    return out


def prompt_tokens_by_source(base_url: str) -> dict | None:
    """The server's prompt tokens so far, computed and from the prefix cache."""
    return counts_by_label(base_url, "prompt_tokens_by_source_total", "source")


def refused_counts(base_url: str) -> dict | None:
    """The server's refusals so far by reason."""
    return counts_by_label(base_url, "requests_refused_total", "reason")


def wait_until_idle(base_url: str, server) -> dict:
    """Wait (up to IDLE_WAIT_S) for /health to show no request and no cache row, then measure the
    server's CPU over IDLE_WINDOW_S without asking it anything: a driver left spinning, or a step
    loop that never sleeps, shows there, and as steps counted while nothing ran."""
    start = time.perf_counter()
    health = None
    while time.perf_counter() - start < IDLE_WAIT_S:
        try:
            health = httpx.get(base_url + "/health", timeout=10).json()
        except httpx.HTTPError:
            health = None
        if health and health["running"] == health["waiting"] == health["cache_rows_in_use"] == 0:
            break
        time.sleep(0.2)
    seconds_to_idle = round(time.perf_counter() - start, 2)
    cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
    time.sleep(IDLE_WINDOW_S)
    cpu = (cpu_seconds(server.pid) - cpu0) / (time.perf_counter() - t0)
    after = httpx.get(base_url + "/health", timeout=10).json()
    steps = after["steps"] - health["steps"] if health else None
    return dict(seconds_to_idle=seconds_to_idle, idle_cpu_cores=round(cpu, 4), steps_while_idle=steps,
                health_after=after, rss_mib_idle=rss_mib(server.pid))


def soak_markdown(result: dict) -> str:
    """The soak's record: machine, date, parameters, what happened, and its verdict."""
    s, cpu = result["soak"], result["cpu"]
    nan = float("nan")
    cores = (f"{cpu.get('cpus', '?')} CPUs ({cpu.get('sockets', '?')} socket(s) x {cpu.get('cores_per_socket', '?')} "
             f"cores x {cpu.get('threads_per_core', '?')} threads), {cpu['cpus_usable']} usable")
    lines = [
        f"# The serving soak, {result['date']}",
        "",
        f"- Machine: {cpu.get('model', 'unknown CPU')}, {cores}; torch sees: {result['machine']}"
        + (f"; GPU {result['gpu']}" if result.get("gpu") else ""),
        f"- Command: `{result['command']}`",
        f"- Pair: {result['target']} / {result['draft']}, gamma {result['gamma']}, "
        f"max batch {result['max_batch_size']}",
        f"- {s['sent']} of {s['sent'] + s['not_sent']} requests sent over {s['clients']} clients, "
        f"{s['parameters']['max_tokens']} new tokens at most, T={result['temperature']:g}, each seeded; "
        f"{s['streamed']} streamed, {s['non_streamed']} not",
        f"- Prompts: held-out chat prompts" + (f" after one of {s['parameters']['shared_prefixes']} shared prefixes "
                                                 "of mixed lengths" if s['parameters'].get('shared_prefixes') else "")
        + (f"; prompt tokens by source (server's /metrics, whole run): {s['prompt_tokens_by_source']}"
           if s.get("prompt_tokens_by_source") else ""),
        f"- Clients going away: {s['parameters']['disconnect_fraction']:g} of them planned (seed "
        f"{s['parameters']['soak_seed']}), a streamed one after 0 to max_tokens / 2 chunks, a non-streamed one "
        "within a request's usual time",
    ]
    if s.get("api_key") or s.get("max_waiting") is not None:
        lines += [
            f"- Access: {'an API key' if s.get('api_key') else 'no key'}, {s.get('wrong_key_requests', 0)} requests "
            f"sent with a wrong one; --max-waiting {s.get('max_waiting')}, a request refused with 503 sent again "
            f"after its Retry-After, {s.get('max_refusals')} times at most",
        ]
    lines += [
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| left early (planned {s['planned_to_leave']}) | {s['left']}: {s['left_streamed']} streamed "
        f"({s['left_before_first_chunk']} before the first chunk), {s['left_non_streamed']} not streamed |",
        *([f"| refused with 503 (queue full) | {s['refused_503']} times, {s['requests_refused_503_at_least_once']} "
           f"requests at least once (at most {s['most_503s_of_a_request']} times one), {s['gave_up_after_503s']} "
           "gave up |",
           f"| refused with 401 (wrong key) | {s['refused_401']} of {s['wrong_key_requests']} |",
           f"| refusals not clean | {s['unclean_refusals']} |",
           f"| the server's requests_refused_total | {s['requests_refused_total']} |",
           f"| accepted (in the end) | {s['accepted']} |"]
          if "refused_503" in s else []),
        f"| stayed | {s['stayed']} |",
        f"| lost (no finish reason) | {s['without_finish_reason']} |",
        f"| differ from offline generation | {s['mismatched']} |",
        f"| partial outputs not a prefix of offline | {s['partial_not_prefix']} |",
        f"| errors | {s['errors']} |",
        f"| throughput | {s['tokens']} tokens in {s['wall_s']:.1f} s = {s['tokens_per_s']:.1f} tok/s |",
        f"| server RSS start / middle / end / idle | {s['rss_mib_start']:.0f} / {s['rss_mib_middle'] or nan:.0f} / "
        f"{s['rss_mib_end'] or nan:.0f} / {s['rss_mib_idle']:.0f} MiB |",
        f"| RSS growth middle to end (limit {RSS_GROWTH_LIMIT:.0%}) | {s.get('rss_growth_middle_to_end', nan):+.1%} "
        f"(peak {s.get('peak_rss_growth_middle_to_end', nan):+.1%}) |",
        f"| idle after the last request | {s['seconds_to_idle']} s; then {s['idle_cpu_cores']} cores of CPU over "
        f"{IDLE_WINDOW_S:g} s (limit {IDLE_CPU_LIMIT}), {s['steps_while_idle']} steps |",
        f"| /health at the end | {s['health_after']} |",
        "",
        "Checks: " + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in s["checks"].items()),
        "",
        f"Verdict: {'passed' if s['passed'] else 'FAILED'}.",
    ]
    if s["errors_first"]:
        lines += ["", "First errors:", *(f"- request {i}: {e}" for i, e in s["errors_first"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
