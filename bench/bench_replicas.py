"""Two `specengine serve` replicas on loopback behind nginx, as docs/examples/replicas ships them
(serve-replicas.sh, nginx.conf, prometheus.yml), tried through the official openai client.

  1. both up: --requests greedy completions (half streamed) over --clients clients, with the API
     key, through nginx. Every one must end with its finish reason, every answer to a prompt must
     be the same text whichever replica gave it (the same models, greedy), and both replicas must
     have served some: each replica's /metrics (with the key: --protect-metrics) and nginx's
     access log count them. A request without the key gets the replicas' 401 through nginx, and
     /metrics through nginx is refused (each replica is scraped on its own).
  2. Prometheus (where `prometheus` is installed): the shipped prometheus.yml, its targets set to
     the replicas' ports and the key's bearer on, must find both targets up and read their
     request_success_total.
  3. one killed: --requests more over the same clients; once a few have ended, one replica is
     killed (SIGKILL: no grace, as a crash). A non-streamed request open on it gets 502 from
     nginx, which the openai client retries (on the other replica); a stream open on it ends
     without a finish reason, and its client sends it again. Every request must end answered, and
     after the kill only the other replica serves.

Writes a JSON record (--out, default bench/results/replicas-<date>.json) and exits 1 if a check
fails.

  python bench/bench_replicas.py                               # the default pair
  python bench/bench_replicas.py --target T --draft D --requests 8 --max-tokens 8
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "replicas"
RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["def fibonacci(n):", "import json\n\ndef load(path):", "The capital of France is", "for i in range(10):",
           "class Stack:\n    def __init__(self):", "SELECT name FROM users WHERE", "# Sort a list of numbers\n",
           "Once upon a time,"]


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def replica_counts(port: int, key: str) -> float:
    """Requests a replica has finished (its request_success_total, all reasons), read with the key."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specengine:request_success_total{"))


def access_log_upstreams(run_dir: Path) -> list[str]:
    """The upstream field of each completion in nginx's access log, in order ('a:p, b:p' where
    nginx tried two)."""
    path = run_dir / "access.log"
    if not path.exists():
        return []
    return [m.group(1) for line in path.read_text().splitlines()
            if "/v1/completions" in line and (m := re.search(r"upstream=(.*?) upstream_status=", line))]


async def one_request(client: openai.AsyncOpenAI, prompt: str, stream: bool, max_tokens: int) -> dict:
    """A greedy completion; its text, finish reason (None: a stream that ended without one) and
    how long it took."""
    start = time.perf_counter()
    if not stream:
        response = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0)
        choice = response.choices[0]
        return dict(prompt=prompt, stream=False, text=choice.text, finish_reason=choice.finish_reason,
                    seconds=time.perf_counter() - start)
    text, finish = "", None
    chunks = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return dict(prompt=prompt, stream=True, text=text, finish_reason=finish, seconds=time.perf_counter() - start)


async def run_requests(base_url: str, key: str, count: int, clients: int, max_tokens: int, first: int,
                       after_some=None) -> list[dict]:
    """`count` requests (prompts in turn, every other one streamed) over `clients` clients. A
    request cut off (a stream that ends without a finish reason or breaks, a connection that fails
    after the openai client's own retries: its replica went away) is sent again, up to twice, and
    counted in `resent`; a request that fails otherwise is recorded with its error.
    after_some(done): called as each request ends."""
    # max_retries: the openai client's default (2), which retries a 502 and a refused connection.
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, timeout=300)
    pending = iter(range(first, first + count))
    results: list[dict] = []

    async def worker():
        for i in pending:
            prompt, stream, resent = PROMPTS[i % len(PROMPTS)], i % 2 == 0, 0
            while True:
                try:
                    result = await one_request(client, prompt, stream, max_tokens)
                except (openai.APIConnectionError, httpx.HTTPError) as exc:
                    # nginx ends a stream whose replica died without the last chunk: httpx reads
                    # an incomplete body.
                    result = dict(prompt=prompt, stream=stream, text=None, finish_reason=None,
                                  error=f"{type(exc).__name__}: {exc}")
                except openai.OpenAIError as exc:
                    result = dict(prompt=prompt, stream=stream, text=None, finish_reason=None,
                                  error=f"{type(exc).__name__}: {exc}")
                    break
                if result["finish_reason"] is not None or resent >= 2:
                    break
                resent += 1
            result.update(index=i, resent=resent, ended_at=time.time())
            results.append(result)
            if after_some is not None:
                after_some(len(results))

    async with client:
        await asyncio.gather(*(worker() for _ in range(clients)))
    return sorted(results, key=lambda r: r["index"])


def start_replicas(args, key: str, ports: dict, run_dir: Path) -> subprocess.Popen:
    serve = ["--gamma", args.gamma, "--max-batch-size", str(args.max_batch_size), "--served-model-name", "bench",
             "--protect-metrics", "--log-level", "warning"]
    if args.target:
        serve = ["--target", args.target] + (["--draft", args.draft] if args.draft else []) + serve
    env = dict(os.environ, SPECENGINE_API_KEY=key, ROUTER_PORT=str(ports["router"]),
               REPLICA_PORTS=" ".join(map(str, ports["replicas"])), RUN_DIR=str(run_dir),
               SPECENGINE=f"{sys.executable} -m specengine", READY_TIMEOUT=str(args.ready_timeout))
    # PYTHONPATH: the replicas run this checkout's specengine, as this script does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = open(run_dir / "serve-replicas.log", "w")
    script = subprocess.Popen([str(EXAMPLE / "serve-replicas.sh"), *serve], env=env, stderr=log,
                              stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout + 30
    while "ready:" not in (run_dir / "serve-replicas.log").read_text():
        if script.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("serve-replicas.sh did not get ready:\n" + (run_dir / "serve-replicas.log").read_text())
        time.sleep(0.5)
    return script


def stop_replicas(script: subprocess.Popen):
    """SIGTERM to the script, which stops nginx and the replicas; what it started, if it cannot."""
    if script.poll() is None:
        script.send_signal(signal.SIGTERM)
        try:
            script.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(script.pid, signal.SIGKILL)  # its own session: nginx and the replicas
            script.wait(timeout=10)


def try_prometheus(run_dir: Path, key: str, replica_ports: list[int], port: int) -> dict:
    """Prometheus with the shipped prometheus.yml (the replicas' ports, the key's bearer on, 1 s
    scrapes): both targets up, and each one's request_success_total."""
    binary = shutil.which("prometheus")
    if binary is None:
        return {"ran": False, "why": "prometheus not installed"}
    config = (EXAMPLE / "prometheus.yml").read_text()
    config = config.replace("scrape_interval: 15s", "scrape_interval: 1s")
    config = config.replace('["127.0.0.1:8001", "127.0.0.1:8002"]',
                            json.dumps([f"127.0.0.1:{p}" for p in replica_ports]))
    config = re.sub(r"\n    # authorization:\n    #   type: Bearer\n    #   credentials_file: (\S+)",
                    r"\n    authorization:\n      type: Bearer\n      credentials_file: \1", config)
    if "\n    authorization:" not in config:
        raise RuntimeError("prometheus.yml's authorization block is not where this script looks for it")
    folder = run_dir / "prometheus"
    folder.mkdir()
    (folder / "prometheus.yml").write_text(config)
    (folder / "specengine-api-key").write_text(key)
    log = open(folder / "prometheus.log", "w")
    process = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=log)
    api = f"http://127.0.0.1:{port}/api/v1/query"
    out = {"ran": True, "version": subprocess.run([binary, "--version"], capture_output=True,
                                                  text=True).stdout.splitlines()[0]}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                up = httpx.get(api, params={"query": "up"}, timeout=5).json()["data"]["result"]
                success = httpx.get(api, params={"query": "sum by (instance) (specengine:request_success_total)"},
                                    timeout=5).json()["data"]["result"]
            except (httpx.HTTPError, KeyError, ValueError):
                up, success = [], []
            out["up"] = {r["metric"]["instance"]: float(r["value"][1]) for r in up}
            out["request_success_total"] = {r["metric"]["instance"]: float(r["value"][1]) for r in success}
            if (len(out["up"]) == 2 and all(v == 1 for v in out["up"].values())
                    and len(out["request_success_total"]) == 2):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                out["log_tail"] = (folder / "prometheus.log").read_text()[-2000:]
                break
            time.sleep(1)
    finally:
        process.terminate()
        process.wait(timeout=30)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target folder or GGUF file (default: the default pair)")
    parser.add_argument("--draft", help="draft folder (with --target; none: target-only)")
    parser.add_argument("--gamma", default="2", help="the replicas' --gamma (default 2)")
    parser.add_argument("--max-batch-size", type=int, default=4, help="the replicas' --max-batch-size (default 4)")
    parser.add_argument("--requests", type=int, default=16, help="requests of each phase (default 16)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--kill-after", type=int, default=3, metavar="N",
                        help="kill a replica when N requests of the last phase have ended (default 3)")
    parser.add_argument("--ready-timeout", type=int, default=600, help="seconds a replica may take to start")
    parser.add_argument("--out", help="JSON path (default bench/results/replicas-<date>.json)")
    args = parser.parse_args()
    if args.draft and not args.target:
        parser.error("--draft needs --target")
    for name in ("requests", "clients", "max_tokens", "max_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.kill_after < args.requests:
        parser.error("--kill-after must be in 0 .. --requests - 1")
    for tool in ("nginx", "curl"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (apt-get install {tool})")

    key = "sk-" + secrets.token_hex(12)
    router, first, second, prometheus_port = free_ports(4)
    ports = {"router": router, "replicas": [first, second]}
    base_url = f"http://127.0.0.1:{router}"
    result = {"date": datetime.datetime.now().isoformat(timespec="minutes"),
              "cpus_usable": len(os.sched_getaffinity(0)),
              "nginx": subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip(),
              "target": args.target or "default pair", "draft": args.draft, "gamma": args.gamma,
              "max_batch_size": args.max_batch_size, "requests_per_phase": args.requests, "clients": args.clients,
              "max_tokens": args.max_tokens, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    checks = result["checks"] = {}
    with tempfile.TemporaryDirectory(prefix="specengine-replicas-") as tmp:
        run_dir = Path(tmp)
        started = time.perf_counter()
        script = start_replicas(args, key, ports, run_dir)
        result["seconds_to_ready"] = round(time.perf_counter() - started, 1)
        try:
            # 1. Both replicas up.
            before = {p: replica_counts(p, key) for p in ports["replicas"]}
            start = time.perf_counter()
            both = asyncio.run(run_requests(base_url, key, args.requests, args.clients, args.max_tokens, 0))
            wall = time.perf_counter() - start
            served = {p: replica_counts(p, key) - before[p] for p in ports["replicas"]}
            upstreams = access_log_upstreams(run_dir)
            texts: dict[str, set] = {}
            for r in both:
                texts.setdefault(r["prompt"], set()).add(r["text"])
            no_key = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
            metrics_via_router = httpx.get(base_url + "/metrics", timeout=30).status_code
            result["both_up"] = dict(
                requests=len(both), wall_s=round(wall, 1),
                answered=sum(r["finish_reason"] is not None for r in both),
                errors=[r["error"] for r in both if "error" in r][:5],
                streamed=sum(r["stream"] for r in both),
                finished_per_replica={str(p): served[p] for p in ports["replicas"]},
                nginx_upstreams={str(p): sum(u.endswith(f":{p}") for u in upstreams) for p in ports["replicas"]},
                prompts_with_differing_answers=sum(len(t) > 1 for t in texts.values()),
                without_key_status=no_key.status_code,
                without_key_error_code=(no_key.json().get("error") or {}).get("code")
                if no_key.headers.get("content-type", "").startswith("application/json") else None,
                metrics_via_router_status=metrics_via_router)
            b = result["both_up"]
            checks["all_answered_with_both_up"] = b["answered"] == len(both) == args.requests
            checks["both_replicas_served"] = all(v > 0 for v in served.values())
            checks["metrics_agree_with_nginx"] = all(served[p] == b["nginx_upstreams"][str(p)]
                                                     for p in ports["replicas"])
            checks["same_answer_from_either_replica"] = b["prompts_with_differing_answers"] == 0
            checks["no_key_refused_401_through_nginx"] = (no_key.status_code == 401
                                                          and b["without_key_error_code"] == "invalid_api_key")
            checks["metrics_not_served_through_nginx"] = metrics_via_router == 404

            # 2. Prometheus scraping both.
            prom = result["prometheus"] = try_prometheus(run_dir, key, ports["replicas"], prometheus_port)
            if prom["ran"]:
                checks["prometheus_scrapes_both"] = (len(prom.get("up", {})) == 2
                                                     and all(v == 1 for v in prom["up"].values())
                                                     and len(prom.get("request_success_total", {})) == 2)

            # 3. One replica killed while requests run.
            victim, survivor = ports["replicas"]
            victim_pid = int((run_dir / f"replica-{victim}.pid").read_text())
            before = {p: replica_counts(p, key) for p in ports["replicas"]}
            log_lines = len(access_log_upstreams(run_dir))
            killed = {}

            def kill_when(done: int):
                if done >= args.kill_after and not killed:
                    os.kill(victim_pid, signal.SIGKILL)
                    killed["at"] = time.time()
                    killed["after_requests"] = done

            start = time.perf_counter()
            rest = asyncio.run(run_requests(base_url, key, args.requests, args.clients, args.max_tokens,
                                            args.requests, after_some=kill_when))
            wall = time.perf_counter() - start
            upstreams = access_log_upstreams(run_dir)[log_lines:]
            alive = script.poll() is None
            survivor_served = replica_counts(survivor, key) - before[survivor]
            after_kill = [r for r in rest if r["ended_at"] > killed.get("at", float("inf")) + 10]
            for r in rest:
                texts.setdefault(r["prompt"], set()).add(r["text"])
            result["one_killed"] = dict(
                requests=len(rest), wall_s=round(wall, 1), killed_after_requests=killed.get("after_requests"),
                answered=sum(r["finish_reason"] is not None for r in rest),
                errors=[r["error"] for r in rest if "error" in r][:5],
                streams_resent=sum(r["resent"] for r in rest),
                survivor_finished=survivor_served,
                # Requests nginx logged as tried on the killed replica and then passed to the
                # survivor ("victim, survivor"), or answered 502 from the killed one.
                nginx_upstreams=dict((u, upstreams.count(u)) for u in sorted(set(upstreams))),
                nginx_status_502=sum(1 for line in (run_dir / "access.log").read_text().splitlines()
                                     if '/v1/completions' in line and '" 502 ' in line),
                prompts_with_differing_answers=sum(len(t) > 1 for t in texts.values()),
                ended_10s_after_the_kill=len(after_kill),
                script_still_serving=alive)
            k = result["one_killed"]
            checks["all_answered_with_one_killed"] = k["answered"] == len(rest) == args.requests
            checks["survivor_served_after_the_kill"] = survivor_served > 0
            checks["same_answer_after_the_kill"] = k["prompts_with_differing_answers"] == 0
            checks["script_kept_serving"] = alive
            result["replica_log_tail"] = (run_dir / "serve-replicas.log").read_text()[-1500:]
            # The kill as nginx saw it: which replica each request went to, and what came back.
            log = (run_dir / "access.log").read_text().splitlines()
            result["nginx_access_log_last_phase"] = log[-(args.requests + 8):]
        finally:
            stop_replicas(script)
    result["passed"] = all(checks.values())
    path = Path(args.out) if args.out else RESULTS / f"replicas-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "replica_log_tail"}, indent=2))
    print(f"wrote {path}")
    failed = [name for name, ok in checks.items() if not ok]
    print("PASSED" if not failed else "FAILED: " + ", ".join(failed))
    sys.exit(0 if not failed else 1)


if __name__ == "__main__":
    main()
