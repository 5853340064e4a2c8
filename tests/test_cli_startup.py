"""`specengine serve` from the outside: what it refuses before loading the model (one line on
stderr, exit status 2, no traceback), what it says while it starts, and how it stops: SIGTERM
or Ctrl-C lets open streams run for --shutdown-grace seconds, ends the rest with finish_reason
"abort", and exits."""
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specengine.cli import main as cli_main

from server_util import free_port


def test_a_port_out_of_range_is_refused_before_loading(text_pair):
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "specengine", "serve", "--target", str(text_pair[0]), "--port",
                          "99999"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "loading" not in run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("specengine")]
    assert said == ["specengine: error: --port must be in 1..65535, got 99999"]
    assert time.monotonic() - started < 60  # imports only


@pytest.fixture
def listening():
    """A port some other server holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--port", "65536"], "--port must be in 1..65535, got 65536"),
    (["--port", "{listening}"], "port {listening} on 127.0.0.1 is already in use (another server?); "
                                "choose another with --port"),
    (["--host", "203.0.113.7"], "cannot listen on 203.0.113.7:{free}: "),
    (["--target", "{missing}"], "--target {missing} does not exist"),
    (["--draft", "{missing}"], "--draft {missing} does not exist"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be a number of seconds >= 0, got -1.0"),
])
def test_serve_refuses_at_once_what_it_could_only_fail_on_after_loading(text_pair, tmp_path, listening, capsys,
                                                                         monkeypatch, argv, message):
    from specengine import Engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    names = dict(listening=listening, missing=tmp_path / "missing", free=free_port())
    argv = [a.format(**names) for a in argv]
    if "--port" not in argv:
        argv += ["--port", str(names["free"])]
    if "--target" not in argv:
        argv += ["--target", str(text_pair[0])]
    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specengine: error: " + message.format(**names)) and err.count("\n") == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_serve_says_what_it_does_and_stops_within_the_grace_period(long_context_target, sig):
    grace = 1.5
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "specengine", "serve", "--target", str(long_context_target),
                               "--gamma", "2", "--port", str(port), "--shutdown-grace", str(grace),
                               "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        said = []
        deadline = time.monotonic() + 180
        while not said or "serving" not in said[-1]:
            line = server.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(said) + server.stderr.read()
            said.append(line)
        progress = [line.split(" ", 2)[1] for line in said if line.startswith("specengine: ")]
        assert progress == ["loading", "loaded", "serving"] and "warming up" in said[1]
        assert f"serving target on http://127.0.0.1:{port}/v1" in said[-1]

        events = []
        body = dict(prompt="def f(", max_tokens=6000, ignore_eos=True, seed=1, stream=True)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append((time.monotonic(), line[6:]))
                if len(events) == 6:
                    at = [a for a, _ in events[1:]]
                    pace = max(b - a for a, b in zip(at, at[1:]))  # this machine's time between chunks
                    stopped = time.monotonic()
                    server.send_signal(sig)
        assert server.wait(timeout=60) == 0
        exited = time.monotonic()
    finally:
        if server.poll() is None:
            server.kill()
    rest = server.stderr.read()
    *chunks, done = events
    assert done[1] == "[DONE]"
    reasons = [json.loads(data)["choices"][0]["finish_reason"] for _, data in chunks]
    assert reasons[-1] == "abort" and set(reasons[:-1]) == {None}
    # It ran on through the grace period: as many chunks after the signal as this machine's pace
    # gives in it (one may have been in flight), and was ended when it ran out, not before, and
    # within a few of its own gaps after.
    ran_on = [at for at, _ in chunks[:-1] if at > stopped]
    assert len(ran_on) >= min(3, int(grace / pace) - 1), (len(ran_on), pace)
    slack = max(0.5, 5 * max([pace] + [b - a for a, b in zip(ran_on, ran_on[1:])]))  # (0.5: a busy scheduler)
    assert grace <= chunks[-1][0] - stopped < grace + slack, (chunks[-1][0] - stopped, slack)
    assert exited - stopped < grace + 30  # it exits (Python's own teardown included), rather than hang
    assert "Traceback" not in rest and rest.rstrip().endswith("specengine: stopped")


def _options_named(text: str, start: str = r"^\s*") -> dict[str, set[str]]:
    """The options each `specengine <command> ...` line (continued with backslashes) of the sh blocks
    in `text` names, by command; `start` is what may come before `specengine` on its line."""
    import re

    named: dict[str, set[str]] = {}
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for command in re.findall(start + r"specengine (\w+)((?:.*\\\n)*.*)$", block, re.M):
            named.setdefault(command[0], set()).update(re.findall(r"--[a-z][a-z-]*", command[1].split("#")[0]))
    return named


def test_the_readme_synopses_name_every_option():
    """The README's `specengine <command> ...` lines name every option --help lists, and no other."""
    import argparse
    from pathlib import Path

    from specengine.cli import build_parser

    named = _options_named((Path(__file__).parents[1] / "README.md").read_text())
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(named) == set(commands)
    for command, parser in commands.items():
        options = {o for action in parser._actions if action.help != argparse.SUPPRESS  # not in --help
                   for o in action.option_strings if o.startswith("--")} - {"--help"}
        if command == "serve":
            options -= {"--tensor-parallel"}  # accepted, to refuse it with a reason
        assert named[command] == options, command


def test_the_docs_commands_name_only_options_help_lists():
    """The `specengine <command> ...` lines of docs/*.md (examples, also after `torchrun ... -m` or
    `nsys profile ...`) name commands and options that --help lists."""
    from pathlib import Path

    from specengine.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    docs = sorted((Path(__file__).parents[1] / "docs").glob("*.md"))
    assert docs
    for doc in docs:
        for command, named in _options_named(doc.read_text(), start=r"(?:^\s*|-m )").items():
            assert command in commands, f"{doc.name}: specengine {command}"
            options = {o for action in commands[command]._actions for o in action.option_strings}
            assert named <= options, f"{doc.name}: specengine {command} {sorted(named - options)}"
