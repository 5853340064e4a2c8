"""One line per GPU goal, PASS / FAIL / NOT MEASURED, from the files bench/gpu_check.sh writes.

    python bench/gpu_verdicts.py RESULTS        # the run's folder, or its gpu-results.tar.gz
    python bench/gpu_verdicts.py bench/results/gpu-h200-2026-11-29.md   # an earlier run's report

Each line gives the measured value and the goal's threshold. A goal is NOT MEASURED when its file
is missing, its step was cut before the figure was written, or the run measured something else
than the goal names (another model, another cadence, c from other graphs). The report of an
earlier run (a .md file, from before gpu_check.sh wrote these files) is read with its CSV and JSON
files beside it (*-cuda-*-<date>*): what it states in prose (bandwidth, launches per layer, test
counts) is taken from its text.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"

VERIFY_B1_US = 25.0           # verify at B=1, G=4, V=32k: microseconds
VERIFY_B64_FLOOR = 2.0        # verify at B=64, G=4, V=128k: times its memory floor
STEP_FLOOR = 1.3              # the 1B target's replayed step: times its weight-read floor
LAUNCHES_PER_LAYER = 10
# The 1B target with its matrices stored as Q4_K (bench_step_stored.py): its replayed step, times
# the weight-read floor of the bytes it holds (0.56 bytes a weight). Not 1.3x as the bfloat16
# step: dequantizing in registers costs about six integer and float operations a weight, and the
# H200 streams 8.5e12 Q4_K weights a second against about 3.4e13 operations a second, so the
# kernels' own issue rate is near 1.5x the floor (more at the half-rate integer operations);
# 2x leaves the rest for launches. At 2x (about 0.3 ms) the Q4_K step would still be twice as fast
# as the bfloat16 step at its own goal (1.3x its 0.5 ms floor): what running a file's precision on a
# GPU is for.
STORED_STEP_FLOOR = 2.0
STORED_TYPE, STORED_LAYERS = "Q4_K", 22
SPEEDUP = 1.5                 # speculative over target-only, batch 1, graphs, same read-back cadence
THEOREM_TOLERANCE = 0.10      # Theorem 3.8's prediction against the measured speedup
FALLBACK_LOG_LINE = "the Triton step kernels failed"  # models.llama's warning when it falls back
TEST_FALLBACK_MESSAGE = "the Triton kernels fell back"  # tests/engine_util.assert_kernels_ran's failure
KERNEL_TEST_FILES = ("test_verify_kernels", "test_sample_warped")  # the exact-distribution tests
EAGLE3_TEST_FILES = ("test_eagle3",)  # its GPU tests: the head's draft phases captured, in blocks too


@dataclass
class Verdict:
    goal: str
    status: str
    measured: str = "-"
    threshold: str = ""
    note: str = ""

    def line(self) -> str:
        note = f"  [{self.note}]" if self.note else ""
        return f"{self.status:13s} {self.goal:52s} {self.measured:>14s}  (goal {self.threshold}){note}"


@dataclass
class Results:
    """What a run left: files by name (text), and the steps' exit codes and seconds."""
    files: dict[str, str] = field(default_factory=dict)
    steps: dict[str, tuple[int, float]] = field(default_factory=dict)
    legacy: dict = field(default_factory=dict)   # an earlier run's figures, already in the verdicts' terms

    def json(self, name: str) -> dict | None:
        text = self.files.get(name)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # written as it went, cut mid-write: nothing to read
            return None

    def step_cut(self, name: str) -> bool:
        """The step ran past its timeout or was interrupted (timeout's 124, or a signal's 128 + n)."""
        rc = self.steps.get(name, (None, 0))[0]
        return rc is not None and (rc == 124 or rc > 128)


def load(path: Path) -> Results:
    """A results folder, its tar.gz, or an earlier run's .md report."""
    if path.suffix == ".md":
        return load_report(path)
    files = {}
    if path.is_dir():
        for f in path.rglob("*"):
            if f.is_file():
                files[f.name] = f.read_text(errors="replace")
    else:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    files[Path(member.name).name] = tar.extractfile(member).read().decode(errors="replace")
    results = Results(files=files)
    for row in csv.DictReader(io.StringIO(files.get("steps.tsv", "")), delimiter="\t"):
        results.steps[row["step"]] = (int(row["rc"]), float(row["seconds"]))
    return results


# ---- the goals ----------------------------------------------------------------------------------

def verify_rows(results: Results) -> list[dict] | None:
    if "verify_rows" in results.legacy:
        return results.legacy["verify_rows"]
    text = results.files.get("verify-gpu.csv")
    return None if text is None else list(csv.DictReader(io.StringIO(text)))


def verify_row(rows, B: int, G: int, V_range: tuple[int, int]) -> dict | None:
    """The Triton kernel's row at temperature 1 alone (the engine's filters=False call), float32 logits."""
    for r in rows or []:
        if (r["impl"] == "triton" and int(r["B"]) == B and int(r["G"]) == G
                and V_range[0] <= int(r["V"]) <= V_range[1] and r.get("warp", "T=1") == "T=1"
                and r.get("dtype", "float32") == "float32"):
            return r
    return None


def best_us(row: dict) -> float:
    """Eager or replayed from a graph, whichever was faster (the engine replays it)."""
    times = [float(row[k]) for k in ("eager_us", "replayed_us", "median_us") if row.get(k) not in (None, "")]
    return min(times)


def verify_verdicts(results: Results) -> list[Verdict]:
    rows = verify_rows(results)
    cut = " (step cut short)" if results.step_cut("verify-bench") else ""
    out = []
    goal = "verify kernel, B=1 G=4 V=32k"
    r = verify_row(rows, 1, 4, (32000, 32768))
    if r is None:
        out.append(Verdict(goal, NOT_MEASURED, threshold=f"<= {VERIFY_B1_US:g} us", note="no row" + cut))
    else:
        us = best_us(r)
        out.append(Verdict(goal, PASS if us <= VERIFY_B1_US else FAIL, f"{us:.1f} us", f"<= {VERIFY_B1_US:g} us"))
    goal = "verify kernel, B=64 G=4 V=128k, x memory floor"
    r = verify_row(rows, 64, 4, (128000, 131072))
    if r is None:
        out.append(Verdict(goal, NOT_MEASURED, threshold=f"<= {VERIFY_B64_FLOOR:g}x", note="no row" + cut))
    else:
        ratio = best_us(r) / float(r["floor_us"])
        out.append(Verdict(goal, PASS if ratio <= VERIFY_B64_FLOOR else FAIL, f"{ratio:.2f}x",
                           f"<= {VERIFY_B64_FLOOR:g}x", f"{best_us(r):.0f} us, floor {float(r['floor_us']):.1f} us"))
    return out


def step_entry(results: Results) -> tuple[dict | None, str | None]:
    """(the 1B target's Triton step at batch 1, the fallback reason if its kernels fell back)."""
    if "step" in results.legacy:
        return results.legacy["step"], None
    data = results.json("step-gpu.json")
    model = (data or {}).get("models", {}).get("widened target")
    if model is None:
        return None, None
    entry = model.get("paths", {}).get("triton", {}).get("1")
    if entry is not None:
        entry = dict(entry, floor_ms=model["floor_ms"])
    return entry, model.get("triton_fallback_reason")


def step_verdicts(results: Results) -> list[Verdict]:
    entry, fallback = step_entry(results)
    cut = "step cut short" if results.step_cut("step-bench") else ""
    goals = [("1B target, replayed step, x weight-read floor", "ratio_to_floor", f"<= {STEP_FLOOR:g}x", STEP_FLOOR,
              lambda v: f"{v:.2f}x"),
             ("1B target, launches per decoder layer", "launches_per_layer", f"<= {LAUNCHES_PER_LAYER}",
              LAUNCHES_PER_LAYER, lambda v: f"{v:.1f}")]
    out = []
    for goal, key, threshold, limit, shown in goals:
        value = None if entry is None else entry.get(key)
        if fallback:
            out.append(Verdict(goal, FAIL, "-" if value is None else shown(value), threshold,
                               f"measured the torch path: the Triton kernels fell back ({fallback[:80]})"))
        elif value is None:
            note = (entry or {}).get("error", cut or "no figure")
            out.append(Verdict(goal, NOT_MEASURED, threshold=threshold, note=note[:120]))
        else:
            note = entry.get(f"{key}_note", "")
            if key == "ratio_to_floor":
                note = note or f"{entry['step_ms']:.3f} ms against {entry['floor_ms']:.3f} ms"
            out.append(Verdict(goal, PASS if value <= limit else FAIL, shown(value), threshold, note))
    return out


def stored_run(results: Results) -> tuple[dict | None, str]:
    """(bench_step_stored.py's results on the GPU, a note on where they came from): the timed step's
    file, else (for correctness only) its one-layer warm-up's."""
    data = results.json("step-stored-gpu.json")
    if data is not None:
        return data, ""
    data = results.json("warm-stored.json")
    return data, "" if data is None else "from the one-layer warm-up run"


def stored_verdicts(results: Results) -> list[Verdict]:
    cut = "step cut short" if results.step_cut("step-stored") else ""
    out = []
    goal, threshold = f"1B {STORED_TYPE} target, replayed step, x weight-read floor", f"<= {STORED_STEP_FLOOR:g}x"
    data = results.json("step-stored-gpu.json")
    entry = ((data or {}).get("models") or {}).get(STORED_TYPE)
    batch = ((entry or {}).get("batches") or {}).get("1")
    if data is None:
        out.append(Verdict(goal, NOT_MEASURED, threshold=threshold, note=cut or "no file"))
    elif data.get("device") != "cuda" or data.get("small") or data.get("layers") != STORED_LAYERS:
        out.append(Verdict(goal, NOT_MEASURED, threshold=threshold,
                           note=f"ran {'small ' if data.get('small') else ''}on {data.get('device')}, "
                                f"{data.get('layers')} layers"))
    elif entry is not None and entry.get("triton_fallback_reason"):
        out.append(Verdict(goal, FAIL, threshold=threshold, note="measured the torch path: the Triton kernels fell "
                                                                 f"back ({entry['triton_fallback_reason'][:80]})"))
    elif batch is None:
        out.append(Verdict(goal, NOT_MEASURED, threshold=threshold,
                           note=((entry or {}).get("error") or cut or "no batch-1 figure")[:120]))
    else:
        ratio = batch["ratio_to_floor"]
        launches = entry.get("launches_per_layer")
        others = [f"{t} {b['1']['ratio_to_floor']:.2f}x" for t, e in data["models"].items()
                  if t != STORED_TYPE and "1" in (b := e.get("batches") or {})]
        note = "; ".join([f"{batch['step_ms']:.3f} ms against {entry['floor_ms']:.3f} ms"]
                         + ([f"{launches:.0f} launches/layer"] if launches is not None else []) + others)
        if not batch.get("replays"):
            out.append(Verdict(goal, FAIL, f"{ratio:.2f}x", threshold, "no graph replayed (graphs fell back: "
                                                                       f"{batch.get('graphs_fallback_reason')})"[:120]))
        else:
            out.append(Verdict(goal, PASS if ratio <= STORED_STEP_FLOOR else FAIL, f"{ratio:.2f}x", threshold, note))

    goal, threshold = "stored matrices on the GPU: logits = torch path's", "float32 order, bit-equal batches"
    data, origin = stored_run(results)
    checked = {t: e["correctness"] for t, e in ((data or {}).get("models") or {}).items() if e.get("correctness")}
    if data is None or data.get("device") != "cuda" or not checked:
        errors = [f"{t}: {e['error']}" for t, e in ((data or {}).get("models") or {}).items() if e.get("error")]
        note = (f"ran on {data.get('device')}" if data is not None and data.get("device") != "cuda"
                else "; ".join(errors) or cut or "no file")
        out.append(Verdict(goal, NOT_MEASURED, threshold=threshold, note=note[:120]))
        return out
    worst = max(c.get(f"{n}_rel_error", float("inf")) for c in checked.values() for n in ("prefill", "verify", "step"))
    bad = [t for t, c in checked.items() if not c.get("ok") or data["models"][t].get("triton_fallback_reason")]
    parts = [f"{t}{'' if c.get('batch_invariant') else ' not batch-invariant'}" for t, c in checked.items()]
    note = ", ".join(parts) + (f"; {origin}" if origin else "")
    if bad:
        note = "failed: " + ", ".join(bad) + "; " + note
    out.append(Verdict(goal, FAIL if bad else PASS, f"{worst:.1e} rel", threshold, note[:160]))
    return out


def e2e_rows(results: Results) -> tuple[list[dict], dict | None]:
    data = results.json("graphs-widened.json")
    return (data or {}).get("e2e", []), data


def same_cadence_speedups(rows: list[dict], batch: int = 1, temperature: float = 0.0) -> list[dict]:
    """Each speculative row over target-only read back at the same cadence (every round: "graphs";
    every rounds_per_read rounds: "blocks")."""
    rate = {(r["kind"], r["gamma"]): r["tokens_per_s"] for r in rows
            if r["batch"] == batch and r["temperature"] == temperature}
    return [dict(kind=kind, gamma=g, speedup=tps / rate[(kind, 0)]) for (kind, g), tps in rate.items()
            if kind in ("graphs", "blocks") and g != 0 and (kind, 0) in rate]


def speedup_verdict(results: Results) -> Verdict:
    goal = "speculative / target-only, 1B, batch 1, graphs"
    threshold = f">= {SPEEDUP:g}x, same cadence"
    if "speedup" in results.legacy:
        return results.legacy["speedup"]
    rows, _ = e2e_rows(results)
    speedups = same_cadence_speedups(rows)
    if not speedups:
        note = "step cut short" if results.step_cut("graphs-widened") else "no batch-1 rows with their target-only row"
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note=note)
    best = max(speedups, key=lambda s: s["speedup"])
    others = ", ".join(f"{s['kind']} g{s['gamma']} {s['speedup']:.2f}x" for s in speedups if s is not best)
    return Verdict(goal, PASS if best["speedup"] >= SPEEDUP else FAIL, f"{best['speedup']:.2f}x", threshold,
                   f"{best['kind']} gamma {best['gamma']}; {others}")


def theorem_verdict(results: Results) -> Verdict:
    goal = "Theorem 3.8 prediction / measured speedup"
    threshold = f"within {THEOREM_TOLERANCE:.0%}, c on the engine's graphs"
    if "theorem" in results.legacy:
        return results.legacy["theorem"]
    _, data = e2e_rows(results)
    rows = [r for r in (data or {}).get("theorem_3_8_engine", []) if r.get("temperature", 0.0) == 0.0]
    if not rows:
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note="no rows with c from the engine's own graphs")
    best = max(rows, key=lambda r: r["measured"])  # the configuration one would run
    error = best["predicted"] / best["measured"] - 1
    return Verdict(goal, PASS if abs(error) <= THEOREM_TOLERANCE else FAIL, f"{error:+.1%}", threshold,
                   f"{best['kind']} gamma {best['gamma']}: predicted {best['predicted']:.2f}x, measured "
                   f"{best['measured']:.2f}x (alpha {best['alpha']:.3f}, c {best['c']:.3f})")


def greedy_verdict(results: Results) -> Verdict:
    goal = "greedy output = transformers', on the GPU"
    threshold = "identical tokens"
    if "greedy" in results.legacy:
        return results.legacy["greedy"]
    data = results.json("greedy-vs-hf-gpu.json")
    if not data or not data.get("runs"):
        note = "step cut short" if results.step_cut("greedy-vs-hf") else "no file"
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note=note)
    if data.get("device") != "cuda":
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note=f"ran on {data.get('device')}")
    checks = [k for k in data["runs"][0] if k.startswith("same_")]
    same = sum(all(r[k] for k in checks) for r in data["runs"])
    n = len(data["runs"])
    return Verdict(goal, PASS if same == n else FAIL, f"{same}/{n} prompts", threshold, " and ".join(
        k.removeprefix("same_") for k in checks))


def junit_counts(results: Results, prefix: str, files: tuple[str, ...]) -> dict | None:
    """Test counts over the junit files junit-<prefix>*.xml, of tests in the named test files."""
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed, found = [], False
    for name, text in results.files.items():
        if not (name.startswith(f"junit-{prefix}") and name.endswith(".xml")):
            continue
        found = True
        try:
            root = ET.fromstring(text)
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            if not any(f in case.get("classname", "") + case.get("file", "") for f in files):
                continue
            counts["tests"] += 1
            for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
                if case.find(kind) is not None:
                    counts[key] += 1
                    if key != "skipped":
                        failed.append(case.get("name"))
    return dict(counts, failed=failed) if found else None


def kernel_tests_verdict(results: Results) -> Verdict:
    if "kernel_tests" in results.legacy:
        return results.legacy["kernel_tests"]
    return tests_verdict(results, "compiled Triton exact-distribution tests", "kernels", KERNEL_TEST_FILES,
                         "kernels-verify")


def eagle3_verdict(results: Results) -> Verdict:
    return tests_verdict(results, "EAGLE-3 head in captured rounds: greedy = target-only, sampling = eager",
                         "tests-engine", EAGLE3_TEST_FILES, "tests-engine")


def tests_verdict(results: Results, goal: str, prefix: str, files: tuple[str, ...], steps: str) -> Verdict:
    """The goal of the tests of `files` in the junit files junit-<prefix>*: all that ran passed,
    some ran, and the steps that ran them (named `steps`...) were not cut short."""
    threshold = "all pass"
    counts = junit_counts(results, prefix, files)
    cut = any(results.step_cut(s) for s in results.steps if s.startswith(steps))
    if counts is None or counts["tests"] == 0:
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note="step cut short" if cut else "no junit XML")
    ran = counts["tests"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    measured = f"{ran - bad}/{ran} passed"
    if bad:
        return Verdict(goal, FAIL, measured, threshold, "failed: " + ", ".join(counts["failed"][:4]))
    if ran == 0:
        return Verdict(goal, NOT_MEASURED, measured, threshold, "all skipped (no CUDA device?)")
    if cut:
        return Verdict(goal, NOT_MEASURED, measured, threshold, "step cut short: the rest did not run")
    return Verdict(goal, PASS, measured, threshold, f"{counts['skipped']} skipped" if counts["skipped"] else "")


def fallback_verdict(results: Results) -> Verdict:
    goal = "no Triton fallback anywhere"
    threshold = "none"
    if "fallback" in results.legacy:
        return results.legacy["fallback"]
    recorded, fallbacks = 0, []
    for name, text in results.files.items():
        if name.endswith(".json"):
            for key, value in _items(results.json(name)):
                if key == "triton_fallback_reason" or key.endswith("_triton_fallback"):
                    recorded += 1
                    if value:
                        fallbacks.append(f"{name}: {str(value)[:60]}")
        elif (name.endswith(".log") and f"junit-{name.removesuffix('.log')}.xml" not in results.files
              and FALLBACK_LOG_LINE in text):
            # A test step's log is left out: one test makes the kernels fail on purpose, and the GPU
            # tests assert no fallback themselves (a failure in their junit XML).
            fallbacks.append(f"{name}: logged a fallback")
        elif name.endswith(".xml") and TEST_FALLBACK_MESSAGE in text:
            fallbacks.append(f"{name}: a test's kernels fell back")
    if fallbacks:
        return Verdict(goal, FAIL, f"{len(fallbacks)} found", threshold, "; ".join(fallbacks[:3]))
    if not recorded:
        return Verdict(goal, NOT_MEASURED, threshold=threshold, note="no benchmark recorded triton_fallback_reason")
    return Verdict(goal, PASS, "0 found", threshold, f"{recorded} records and the benchmarks' logs searched")


def _items(data, depth: int = 0):
    """Every (key, value) in a JSON tree."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield k, v
            if depth < 8:
                yield from _items(v, depth + 1)
    elif isinstance(data, list) and depth < 8:
        for v in data:
            yield from _items(v, depth + 1)


def verdicts(results: Results) -> list[Verdict]:
    return [kernel_tests_verdict(results), *verify_verdicts(results), *step_verdicts(results),
            *stored_verdicts(results), speedup_verdict(results), theorem_verdict(results), greedy_verdict(results),
            eagle3_verdict(results), fallback_verdict(results)]


# ---- an earlier run's report -----------------------------------------------------------------------

def load_report(md: Path) -> Results:
    """The verdicts' inputs from a report written before gpu_check.sh recorded them as files: its
    verify CSV and bench_graphs JSON beside it, and what its text states."""
    text = md.read_text()
    date = re.search(r"\d{4}-\d{2}-\d{2}", md.name).group(0)
    folder = md.parent
    results = Results(files={md.name: text})
    legacy = results.legacy
    for csv_path in sorted(folder.glob(f"verify-cuda-*{date}*.csv")):
        legacy["verify_rows"] = [dict(r, warp="T=1" if float(r.get("top_p", 1.0)) == 1.0 else f"top-p {r['top_p']}")
                                 for r in csv.DictReader(csv_path.open())]
    runs = {p.name: json.loads(p.read_text()) for p in sorted(folder.glob(f"graphs-*-cuda-*{date}*.json"))}
    widened = [(n, d) for n, d in runs.items() if d.get("target") == "widened" and "costs_batch1" in d]
    bandwidth = re.search(r"copy bandwidth of ([\d.]+) GB/s", text)
    launches = re.search(r"about (\d+) small kernels per layer", text)
    if widened and bandwidth:
        name, d = widened[0]  # the report's figures are its first run's
        floor_ms = 2 * d["target_parameters"] / (float(bandwidth.group(1)) * 1e9) * 1e3  # bfloat16 weights
        step_ms = d["costs_batch1"]["graphs"]["target_ms"][0]
        legacy["step"] = dict(step_ms=step_ms, floor_ms=floor_ms, ratio_to_floor=step_ms / floor_ms,
                              launches_per_layer=float(launches.group(1)) if launches else None,
                              ratio_to_floor_note=f"{step_ms:.3f} ms against {floor_ms:.3f} ms ({name}; torch ops, "
                                                  f"before the step kernels)",
                              launches_per_layer_note="from the report's text")
    shipped = [d for d in runs.values() if d.get("e2e")]
    same_cadence = [s for d in shipped for s in same_cadence_speedups(d["e2e"])]
    note = "no 1B end-to-end rows"
    if same_cadence:
        best = max(same_cadence, key=lambda s: s["speedup"])
        note += f"; the shipped 28M target showed {best['speedup']:.2f}x (gamma {best['gamma']}, every round)"
    legacy["speedup"] = Verdict("speculative / target-only, 1B, batch 1, graphs", NOT_MEASURED,
                                threshold=f">= {SPEEDUP:g}x, same cadence", note=note)
    theorem = [t for d in shipped for t in d.get("theorem_3_8_graphs", [])]
    note = "c was measured on capacity-256 graphs, not the engine's"
    if theorem:
        t = max(theorem, key=lambda t: t["measured"])
        note += (f"; those predicted {t['theorem_3_8']:.2f}x against {t['measured']:.2f}x measured "
                 f"(gamma {t['gamma']}, shipped target)")
    legacy["theorem"] = Verdict("Theorem 3.8 prediction / measured speedup", NOT_MEASURED,
                                threshold=f"within {THEOREM_TOLERANCE:.0%}, c on the engine's graphs", note=note)
    legacy["greedy"] = Verdict("greedy output = transformers', on the GPU", NOT_MEASURED, threshold="identical tokens",
                               note="compared only with the eager loop" if "eager loop" in text else "")
    passed = re.search(r"test_verify_kernels\.py[^\n]*?: (\d+) passed", text)
    failed = re.search(r"test_verify_kernels\.py[^\n]*?: \d+ passed, (\d+) failed", text)
    if passed:
        legacy["kernel_tests"] = Verdict("compiled Triton exact-distribution tests", FAIL if failed else PASS,
                                         f"{passed.group(1)} passed", "all pass", "from the report's text")
    legacy["fallback"] = Verdict("no Triton fallback anywhere", NOT_MEASURED, threshold="none",
                                 note="not recorded (the step kernels came later)")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="gpu_check.sh's folder or tar.gz, or an earlier run's .md")
    args = parser.parse_args(argv)
    if not args.results.exists():
        print(f"no such file or folder: {args.results}", file=sys.stderr)
        return 2
    results = load(args.results)
    for v in verdicts(results):
        print(v.line())
    if results.steps:
        print("steps: " + ", ".join(f"{name} {'ok' if rc == 0 else f'exit {rc}'} {seconds:.0f}s"
                                    for name, (rc, seconds) in results.steps.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
