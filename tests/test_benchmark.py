"""`specengine bench` (specengine/devtools/benchmark.py) end to end on the tiny text pair: every configuration
runs, the CSV holds what the issue asks for, and greedy outputs equal Hugging Face's."""
import csv
import json
import re
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import specengine
from specengine.cli import main as cli_main
from specengine.devtools.benchmark import BenchOptions, eager_decode, hf_decode, median_alpha, rotated
from specengine.devtools.corpus import heldout_chat_prompts
from specengine.models import load_model

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_pair(text_pair, tmp_path_factory):
    """The tiny pair with a chat template on the target's tokenizer: the benchmark then takes
    held-out chat requests as its prompts, of different lengths, as on the default pair."""
    target, draft = text_pair
    folder = tmp_path_factory.mktemp("chat-pair") / "target"
    shutil.copytree(target, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder, draft


def bench_rows(out_dir) -> dict[str, dict]:
    """The rows of the one CSV a bench run wrote into out_dir, by configuration."""
    (path,) = out_dir.glob("e2e-*.csv")
    return {row["config"]: row for row in csv.DictReader(path.open())}


def expected_configs(drafted: str, gammas: tuple[str, ...]) -> set[str]:
    """The configurations a bench run at T 0 and 1, batches 1 and 2 measures: the baselines, and
    `drafted` (a format with {g}) at each of gammas."""
    expected = set()
    for T in ("0", "1"):
        for B in (1, 2):
            expected |= {f"hf T={T} B={B}", f"eager T={T} B={B}", f"spec target-only T={T} B={B}",
                         f"spec ngram gamma=4 T={T} B={B}"}
            expected |= {drafted.format(g=g) + f" T={T} B={B}" for g in gammas}
    return expected


def test_bench_runs_every_configuration_and_checks_greedy_against_hf(text_pair, tmp_path, capsys):
    target, draft = text_pair
    code = cli_main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", "2", "--new-tokens", "5",
                     "--repeats", "1", "--gammas", "1", "3", "--batches", "1", "2", "--temperatures", "0", "1",
                     "--out-dir", str(tmp_path), "--no-plot"])
    assert code == 0
    rows = bench_rows(tmp_path)
    expected = expected_configs("spec draft gamma={g}", ("1", "3", "auto")) | {
        f"hf-assisted T={T} B=1" for T in ("0", "1")}
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
            # Acceptance at each of the gamma draft positions (every drafting round drafts at the
            # first, so it has a figure; a later one may have none, "n/a")
            by_position = row["alpha_by_position"].split()
            assert len(by_position) == int(row["gamma"]) and 0 <= float(by_position[0]) <= 1, name
            assert all(a == "n/a" or 0 <= float(a) <= 1 for a in by_position), name
        if row["kind"] != "spec" or row["drafter"] == "":
            assert row["alpha_by_position"] == "", name
    out = capsys.readouterr().out
    assert "Paper Table 3 view" in out and "n-gram (prompt lookup)" in out
    assert "Acceptance by draft position" in out
    # The runs as measured, kept beside the table
    (raw,) = tmp_path.glob("e2e-*-runs.json")
    runs = json.loads(raw.read_text())
    assert set(runs) == expected and all(len(r) == 1 and r[0]["tokens"] > 0 for r in runs.values())


def test_bench_quick_path_on_prompts_of_different_lengths(chat_pair, tmp_path):
    """What `specengine bench --quick` runs on the default pair, in miniature: chat prompts of
    different lengths at batch 1 and a larger batch, at T=0 and T=1, through every baseline. A
    batch of them is no rectangle: HF generate and the eager loop each take it padded."""
    target, draft = chat_pair
    prompts = heldout_chat_prompts(AutoTokenizer.from_pretrained(target), 3, max_tokens=256)
    assert len({len(p) for p in prompts}) == 3
    code = cli_main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", "3", "--new-tokens", "4",
                     "--repeats", "1", "--gammas", "2", "--batches", "1", "3", "--temperatures", "0", "1",
                     "--out-dir", str(tmp_path), "--no-plot"])
    assert code == 0
    rows = bench_rows(tmp_path)
    for T in ("0", "1"):
        for B in (1, 3):
            for name in ("hf", "eager", "spec target-only", "spec draft gamma=2", "spec draft gamma=auto",
                         "spec ngram gamma=4"):
                assert float(rows[f"{name} T={T} B={B}"]["tokens_per_s"]) > 0, (name, T, B)
        assert float(rows[f"hf-assisted T={T} B=1"]["tokens_per_s"]) > 0
    # Every row of the ragged batch, HF's left-padded one included, decodes its own prompt greedily.
    for name, row in rows.items():
        if row["kind"] in ("spec", "eager") and row["temperature"] == "0.0":
            assert row["greedy_equals_hf"] == "True", name


def test_baselines_decode_each_prompt_of_a_ragged_batch_as_alone(chat_pair):
    """HF (left-padded, masked) and the eager loop (right-padded in its cache) give each prompt of
    a batch of different lengths the greedy tokens it gets decoded on its own."""
    target, _ = chat_pair
    prompts = heldout_chat_prompts(AutoTokenizer.from_pretrained(target), 3, max_tokens=256)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ours = load_model(target)
    alone = [hf_decode(hf, [p], 6, 0.0)[0] for p in prompts]
    assert hf_decode(hf, prompts, 6, 0.0) == alone
    assert eager_decode(ours, prompts, 6, 0.0, seed=0) == alone


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


def test_bench_runs_on_a_gguf_target(tmp_path):
    """A GGUF file as the target (the default pair's is one): specengine runs it as stored and
    Hugging Face loads the same file, and greedy outputs still equal HF's."""
    from gguf_util import gguf_file
    from specengine.devtools.tiny import make_config, save_random_checkpoint

    target = gguf_file("tiny-llama.Q8_0.gguf")
    eos = load_model(target).config.eos_token_ids[0]
    draft = tmp_path / "draft"  # no tokenizer files: it shares the target's 320 tokens
    save_random_checkpoint(draft, make_config(vocab_size=320, hidden_size=32, num_layers=1, num_heads=2,
                                              num_kv_heads=1, eos_token_id=eos), seed=1, init_std=0.3)
    code = cli_main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", "2", "--new-tokens", "5",
                     "--repeats", "1", "--gammas", "2", "--batches", "1", "--temperatures", "0",
                     "--out-dir", str(tmp_path), "--no-plot"])
    assert code == 0
    rows = bench_rows(tmp_path)
    assert {"hf T=0 B=1", "spec target-only T=0 B=1", "spec draft gamma=2 T=0 B=1"} <= set(rows)
    for name, row in rows.items():
        assert float(row["tokens_per_s"]) > 0, name
        if row["kind"] in ("spec", "eager"):
            assert row["greedy_equals_hf"] == "True", name


def test_bench_refuses_a_missing_target_by_name(tmp_path, text_pair):
    _, draft = text_pair
    for missing in (tmp_path / "nothing", tmp_path / "nothing.gguf"):
        with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor a GGUF file"):
            BenchOptions(missing, draft, tmp_path)


def test_bench_with_an_eagle3_head(text_pair, tmp_path, capsys):
    """`--drafter eagle3` with a head's folder (or the folder alone: its config says what it is):
    the head drafts in place of a draft model at each gamma and auto, greedy outputs equal HF's,
    and there are no assisted rows (HF cannot draft with a head)."""
    from specengine.devtools.tiny import save_random_eagle3_head

    target, draft = text_pair
    head = save_random_eagle3_head(tmp_path / "head", load_model(target).config, seed=3)
    args = ["bench", "--target", str(target), "--draft", str(head), "--prompts", "2", "--new-tokens", "5",
            "--repeats", "1", "--gammas", "2", "--batches", "1", "2", "--temperatures", "0", "1", "--no-plot"]
    for chosen, out in ((["--drafter", "eagle3"], tmp_path / "named"), ([], tmp_path / "by-config")):
        assert cli_main([*args, *chosen, "--out-dir", str(out)]) == 0
        rows = bench_rows(out)
        assert set(rows) == expected_configs("spec eagle3 gamma={g}", ("2", "auto"))
        for name, row in rows.items():
            assert float(row["tokens_per_s"]) > 0, name
            if row["kind"] == "spec" and row["temperature"] == "0.0":
                assert row["greedy_equals_hf"] == "True", name
            if row["drafter"] == "eagle3" and row["gamma"] == "2":
                assert row["vs_hf_assisted"].startswith("n/a") and row["c"] == "" and row["predicted_speedup"] == ""
                assert 0 <= float(row["alpha"]) <= 1 and float(row["draft_ms_per_round"]) > 0, name
                assert len(row["alpha_by_position"].split()) == 2, name
        assert re.search(r"EAGLE-3 head +gamma 2 T=0: alpha", capsys.readouterr().out)
    # A folder that holds no head is refused by name.
    assert cli_main([*args, "--drafter", "eagle3", "--draft", str(draft), "--out-dir", str(tmp_path)]) == 2
    assert "does not say it holds one" in capsys.readouterr().err


def test_a_cpu_figure_names_the_cpu_its_ops_path_and_threads():
    from specengine import _C
    from specengine.devtools.benchmark import machine_name
    from specengine.engine.costs import cpu_name

    name = machine_name("cpu")
    assert cpu_name() in name and f"{_C.cpu_isa()} ops" in name and f"{torch.get_num_threads()} threads" in name
