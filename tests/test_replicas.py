"""Two `specengine serve` replicas behind nginx, as docs/examples/replicas ships them: the configuration
is valid, and bench/bench_replicas.py's tryout passes on the tiny pair (both replicas serve, the
same answers from either, 401 through nginx without the key, traffic goes on after one replica is
killed). The tryout needs nginx (`apt-get install nginx`) and is skipped without it."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "replicas"
needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("curl") is None,
                                 reason="needs nginx and curl (apt-get install nginx curl)")


@needs_nginx
def test_the_shipped_nginx_conf_is_valid(tmp_path):
    (tmp_path / "tmp").mkdir()
    check = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(EXAMPLE / "nginx.conf")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus)")
def test_the_shipped_prometheus_yml_is_valid():
    check = subprocess.run(["promtool", "check", "config", str(EXAMPLE / "prometheus.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_serve_replicas_refuses_bad_ports_before_starting_anything(tmp_path):
    env = dict(os.environ, REPLICA_PORTS="8001", RUN_DIR=str(tmp_path), SPECENGINE="false")
    run = subprocess.run([str(EXAMPLE / "serve-replicas.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "REPLICA_PORTS must name two ports" in run.stderr
    env = dict(os.environ, ROUTER_PORT="80000", RUN_DIR=str(tmp_path), SPECENGINE="false")
    run = subprocess.run([str(EXAMPLE / "serve-replicas.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "'80000' is not a port" in run.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@needs_nginx
def test_two_replicas_behind_nginx_serve_and_survive_one_killed(text_pair, tmp_path):
    out = tmp_path / "replicas.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_replicas.py"), "--target", str(text_pair[0]),
                          "--draft", str(text_pair[1]), "--requests", "8", "--clients", "3", "--max-tokens", "6",
                          "--kill-after", "2", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed and run.returncode == 0, (failed, run.stdout[-3000:], run.stderr[-3000:])
    assert result["both_up"]["answered"] == result["one_killed"]["answered"] == 8
    assert all(n > 0 for n in result["both_up"]["finished_per_replica"].values())
