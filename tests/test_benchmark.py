"""`specengine bench` (specengine/benchmark.py) end to end on the tiny text pair: every configuration
runs, the CSV holds what the issue asks for, and greedy outputs equal Hugging Face's."""
import csv
import json

import pytest
import torch
import transformers

import specengine
from specengine.benchmark import BenchOptions, median_alpha, rotated
from specengine.cli import main as cli_main


def test_bench_runs_every_configuration_and_checks_greedy_against_hf(text_pair, tmp_path, capsys):
    target, draft = text_pair
    code = cli_main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", "2", "--new-tokens", "5",
                     "--repeats", "1", "--gammas", "1", "3", "--batches", "1", "2", "--temperatures", "0", "1",
                     "--out-dir", str(tmp_path), "--no-plot"])
    assert code == 0
    (path,) = tmp_path.glob("e2e-*.csv")
    rows = {row["config"]: row for row in csv.DictReader(path.open())}
    expected = set()
    for T in ("0", "1"):
        for B in (1, 2):
            expected |= {f"hf T={T} B={B}", f"eager T={T} B={B}", f"spec target-only T={T} B={B}",
                         f"spec ngram gamma=4 T={T} B={B}"}
            expected |= {f"spec draft gamma={g} T={T} B={B}" for g in ("1", "3", "auto")}
        expected.add(f"hf-assisted T={T} B=1")
    assert set(rows) == expected
    assert all(float(row["tokens_per_s"]) > 0 for row in rows.values())
    # What measured it, on every row
    assert all(row["torch"] == torch.__version__ and row["transformers"] == transformers.__version__
               and row["specengine"] == specengine.__version__ and row["python"] for row in rows.values())
    # HF assisted generation cannot batch: the table says so instead of dropping the ratio.
    assert rows["spec draft gamma=1 T=0 B=2"]["vs_hf_assisted"].startswith("n/a")
    assert float(rows["spec draft gamma=1 T=0 B=1"]["vs_hf_assisted"]) > 0
    for name, row in rows.items():
        if row["kind"] in ("spec", "eager") and row["temperature"] == "0.0":
            assert row["greedy_equals_hf"] == "True", name
        if row["drafter"] == "model" and row["gamma"] != "auto":
            alpha, predicted = float(row["alpha"]), float(row["predicted_speedup"])
            assert 0 <= alpha <= 1 and predicted > 0 and float(row["c"]) > 0, name
            for column in ("round_ms", "draft_ms_per_round", "verify_ms_per_round", "ops_ratio"):
                assert float(row[column]) > 0, (name, column)
    out = capsys.readouterr().out
    assert "Paper Table 3 view" in out and "n-gram (prompt lookup)" in out
    # The runs as measured, kept beside the table
    (raw,) = tmp_path.glob("e2e-*-runs.json")
    runs = json.loads(raw.read_text())
    assert set(runs) == expected and all(len(r) == 1 and r[0]["tokens"] > 0 for r in runs.values())


def test_median_alpha_skips_runs_that_tested_no_drafts():
    """gamma="auto" may decode a whole run without drafting (batch 8 on a CPU): that run has no
    alpha, and the others' still give the configuration's."""
    assert median_alpha([{"alpha": None}, {"alpha": 0.8}, {"alpha": 0.6}]) == pytest.approx(0.7)
    assert median_alpha([{"alpha": None}, {"alpha": None}]) is None
    assert median_alpha([{"seconds": 1.0}]) is None  # HF and eager runs record none


def test_configurations_take_turns_running_first():
    """Every batch runs every configuration once, and over as many batches as configurations
    each runs first once: whatever running in a given place costs or saves falls on all alike."""
    configs = ["hf", "target-only", "gamma 3", "auto"]
    turns = [rotated(configs, turn) for turn in range(len(configs))]
    assert all(sorted(order) == sorted(configs) for order in turns)
    assert sorted(order[0] for order in turns) == sorted(configs)
    assert rotated(configs, 5) == rotated(configs, 1) == ["target-only", "gamma 3", "auto", "hf"]


def test_bench_rejects_bad_options(text_pair, tmp_path, capsys):
    target, draft = text_pair
    assert cli_main(["bench", "--target", str(target), "--out-dir", str(tmp_path)]) == 2
    assert "both --target and --draft" in capsys.readouterr().err
    assert cli_main(["bench", "--target", str(target), "--draft", str(tmp_path / "missing")]) == 2
    assert "draft folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="gammas must be"):
        BenchOptions(target, draft, tmp_path, gammas=(0, 2))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        BenchOptions(target, draft, tmp_path, repeats=0)
