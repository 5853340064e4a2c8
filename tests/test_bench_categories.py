"""bench/bench_categories.py end to end at a tiny size: target-only against the draft model, n-gram,
suffix and EAGLE-3 drafters, at T=0 and T=1, batch 1 and a larger batch, with llama-bench's column
(a stand-in binary that answers as llama-bench does), on a GGUF target; and with a draft that is
its target, whose acceptance is known (everything at T=0)."""
import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from specengine import Engine, SamplingParams
from specengine.devtools.tiny import make_config, save_random_checkpoint, save_random_eagle3_head
from specengine.models import load_model

from gguf_util import gguf_file

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_categories  # noqa: E402


def fake_llama_bench(folder: Path, rate: float) -> tuple[Path, Path]:
    """An executable answering as `llama-bench -o json` does (one row with avg_ts), logging its arguments."""
    log = folder / "llama-bench-args.jsonl"
    path = folder / "llama-bench"
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        print(json.dumps([{{"avg_ts": {rate}, "n_gen": 4}}]))
        """))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, log


def test_every_drafter_at_both_temperatures_and_batch_sizes_beside_llama_cpp(tmp_path):
    target = gguf_file("tiny-llama.Q8_0.gguf")
    config = load_model(target).config
    draft = tmp_path / "draft"  # no tokenizer files: it shares the target's 320 tokens
    save_random_checkpoint(draft, make_config(vocab_size=320, hidden_size=32, num_layers=1, num_heads=2,
                                              num_kv_heads=1, eos_token_id=config.eos_token_ids[0]),
                           seed=1, init_std=0.3)
    head = save_random_eagle3_head(tmp_path / "head", config, seed=2)
    binary, log = fake_llama_bench(tmp_path, 50.0)
    out = tmp_path / "categories.json"
    code = bench_categories.main(["--target", str(target), "--draft", str(draft), "--drafters", "model", "ngram",
                                  "suffix", f"eagle3:{head}", "--temperatures", "0", "1", "--batch", "1", "3",
                                  "--categories", "code", "qa", "--quick", "--new-tokens", "4", "--repeats", "2",
                                  "--llama-bench", str(binary), "--threads", "1", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    engines = ["target-only", "model", "ngram", "suffix", "eagle3:head"]
    assert result["drafters"] == engines[1:] and result["per_category"] == 1  # --quick's one request a kind
    assert result["greedy_identical"] == {name: True for name in engines[1:]}
    # llama-bench ran once a repeat, decoding NEW tokens from an empty context on the same file.
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 and all(c[:8] == ["-m", str(target), "-t", "1", "-p", "0", "-n", "4"] for c in calls)
    assert result["llamacpp_decode_tok_s"] == 50.0
    assert set(result["results"]) == {"T=0 B=1", "T=0 B=3", "T=1 B=1", "T=1 B=3"}
    for setting, by_kind in result["results"].items():
        assert set(by_kind) == {"code", "qa", "all"}
        for kind, figures in by_kind.items():
            assert set(figures) == set(engines)
            base = figures["target-only"]
            assert base["tok_s"] > 0 and base["tokens_per_round"] == 1.0 and base["acceptance"] is None
            for name in engines[1:]:
                f = figures[name]
                assert f["tok_s"] > 0 and f["speedup"] == pytest.approx(f["tok_s"] / base["tok_s"]), (setting, name)
                assert f["tokens_per_round"] >= 1.0
                assert f["acceptance"] is None or 0 <= f["acceptance"] <= 1
                assert all(a is None or 0 <= a <= 1 for a in f["acceptance_by_position"])
            if setting.endswith("B=1"):  # llama.cpp's decode rate beside each engine's
                assert all(figures[n]["vs_llamacpp_decode"] == pytest.approx(figures[n]["decode_tok_s"] / 50.0)
                           for n in engines)
            else:
                assert all("vs_llamacpp_decode" not in figures[n] for n in engines)
    # A batch of 3 holds the kind's one request three times, each with its own seed: 3 x 4 tokens.
    runs = result["runs"]["T=0 B=3"]["target-only"]["code"]
    assert len(runs) == 2 and all(r["tokens"] == 12 for r in runs)
    # gamma "auto" (the default): every drafting engine measured (or read) its step costs.
    assert set(result["costs_s"]) == set(engines[1:]) and set(result["first_token_s"]) == set(engines)


def test_a_draft_equal_to_its_target_accepts_every_draft_at_t0(text_pair, tmp_path, capsys):
    """The draft model is the target itself: at T=0 every draft is accepted, at every position."""
    target = text_pair[0]
    out = tmp_path / "categories.json"
    code = bench_categories.main(["--target", str(target), "--draft", str(target), "--gamma", "3",
                                  "--temperatures", "0", "--batch", "1", "2", "--per-category", "2",
                                  "--categories", "math", "--new-tokens", "9", "--repeats", "1", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    # The same requests offline: the tallies hold their tokens, rounds and drafts.
    engine = Engine.from_pretrained(target, target, gamma=3)
    texts = bench_categories.CATEGORIES["math"][:2]
    offline = engine.generate([engine.tokenizer(t)["input_ids"] for t in texts],
                              SamplingParams(max_new_tokens=9, temperature=0.0))
    for setting in ("T=0 B=1", "T=0 B=2"):
        f = result["results"][setting]["all"]["model"]
        assert f["acceptance"] == 1.0 and f["acceptance_by_position"] == [1.0, 1.0, 1.0], setting
        (run,) = result["runs"][setting]["model"]["math"]
        for name in ("rounds", "drafted", "accepted"):
            assert run[name] == sum(getattr(r.stats, name) for r in offline), (setting, name)
        assert run["tokens"] == sum(len(r.token_ids) for r in offline)
        assert run["drafted_by_position"] == [sum(n) for n in zip(*(r.stats.drafted_by_position for r in offline))]
        assert f["tokens_per_round"] == run["tokens"] / run["rounds"] > 2
    assert "T=0 B=2" in capsys.readouterr().out


def test_bad_drafters_and_llama_bench_are_refused_by_name(tmp_path, capsys):
    for args, words in ((["--drafters", "medusa"], "unknown drafter 'medusa'"),
                        (["--drafters", "eagle3"], "eagle3:PATH"),
                        (["--drafters", f"eagle3:{tmp_path / 'none'}"], "does not exist"),
                        (["--drafters", "ngram:x"], "takes no folder"),
                        (["--target", str(tmp_path), "--drafters", "ngram", "--llama-bench", str(tmp_path / "x")],
                         "does not exist"),
                        (["--target", str(tmp_path), "--drafters", "model"], "needs --draft")):
        with pytest.raises(SystemExit):
            bench_categories.main(args)
        assert words in capsys.readouterr().err, args
    binary, _ = fake_llama_bench(tmp_path, 1.0)
    with pytest.raises(SystemExit):
        bench_categories.main(["--target", str(tmp_path), "--drafters", "ngram", "--llama-bench", str(binary)])
    assert "is not one" in capsys.readouterr().err
