"""Python API, CLI, stop conditions, statistics and bad input on a tiny pair with a real tokenizer."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.cli import main as cli_main
from specengine.sampling.batch import InvalidLogitsError

from engine_util import tiny_model


@pytest.fixture(scope="module")
def engine(text_pair):
    target, draft = text_pair
    return Engine.from_pretrained(target, draft, gamma=3)


# ---- SamplingParams -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(seed=-3), "seed must be an integer"),
    (dict(stop=("",)), "stop must hold non-empty strings"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_a_single_stop_string():
    assert SamplingParams(stop="\n").stop == ("\n",)


# ---- generate / stream ----------------------------------------------------------------------

def test_generate_text_and_token_prompts(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    by_text, by_ids = engine.generate(["def add(a, b):", engine.tokenizer("def add(a, b):")["input_ids"]], params)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 12
    assert by_text.text == engine.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.finish_reason == "length"
    s = by_text.stats
    assert s.generated_tokens == 12 and s.rounds == sum(s.accepted_histogram) >= 12 / 4
    assert s.target_calls == s.rounds + 1 and s.draft_calls > 0 and s.tokens_per_s > 0
    # A single prompt need not be wrapped in a list.
    assert engine.generate("def add(a, b):", params)[0].token_ids == by_text.token_ids


def test_stream_yields_the_generated_text(engine):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    pieces = list(engine.stream("import os\n", params))
    (result,) = engine.generate(["import os\n"], params)
    assert len(pieces) > 1 and "".join(pieces) == result.text


def test_stop_string_ends_text_before_it(engine):
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    (full,) = engine.generate(["x = 1\n"], params)
    stop = full.text[5:7]
    assert stop
    (cut,) = engine.generate(["x = 1\n"], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True,
                                                          stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop in engine.tokenizer.decode(cut.token_ids)
    assert stop not in engine.tokenizer.decode(cut.token_ids[:-1])
    streamed = "".join(engine.stream("x = 1\n", SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True,
                                                               stop=(stop,))))
    assert streamed == cut.text


def test_eos_ends_generation_exactly():
    target = tiny_model(32, seed=0, logit_scale=3.0)
    free = Engine(target).generate([[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0))[0].token_ids
    eos = free[4]
    first = free.index(eos)
    from specengine.drafters.model import ModelDrafter
    for drafter in (None, ModelDrafter(target, 32, 32)):
        engine = Engine(target, drafter=drafter, gamma=6, eos_token_ids=[eos])
        (r,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0))
        assert r.token_ids == free[: first + 1] and r.finish_reason == "stop"
        (r,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
        assert r.token_ids == free


def test_context_capacity_stops_with_message_and_keeps_output():
    target = tiny_model(32, seed=0, max_positions=256)
    from specengine.drafters.model import ModelDrafter
    engine = Engine(target, drafter=ModelDrafter(target, 32, 32), gamma=4, max_seq_len=12)
    (r,) = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=50, temperature=0))
    assert r.finish_reason == "capacity" and len(r.token_ids) == 7
    assert "context of 12 tokens is full" in r.message
    free = Engine(target).generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=7, temperature=0))[0]
    assert r.token_ids == free.token_ids


# ---- bad input --------------------------------------------------------------------------------

def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(ValueError, match="prompt has 600 tokens but the context holds 512"):
        engine.generate([[1] * 600])


@pytest.mark.parametrize("prompts, message", [("", "prompt is empty"), ([[]], "prompt is empty"),
                                              ([], "no prompts given"),
                                              ([1, 99999], r"token ids must be integers in \[0, 300\)")])
def test_bad_prompts(engine, prompts, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts)


def test_one_bad_prompt_fails_the_batch_before_any_work(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(["fine", ""])
    assert engine.generate(["fine"], SamplingParams(max_new_tokens=2))[0].token_ids


def test_params_list_must_match_prompts(engine):
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(["a", "b"], [SamplingParams()])


def test_nan_logits_are_reported():
    target = tiny_model(32, seed=0)
    with torch.no_grad():
        target.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(InvalidLogitsError, match="target logits contain NaN"):
        Engine(target).generate([[1, 2]], SamplingParams(max_new_tokens=3))


def test_nan_draft_logits_are_reported_before_any_token_is_kept():
    """Logits are checked when a round's results are read (no synchronisation per step): a broken
    draft still raises, naming the draft, and the engine's loop keeps nothing from that round."""
    from specengine.drafters.model import ModelDrafter

    target, draft = tiny_model(32, seed=0), tiny_model(32, seed=1, num_layers=1)
    with torch.no_grad():
        draft.lm_head.weight[3, 0] = float("nan")
    engine = Engine(target, drafter=ModelDrafter(draft, 32, 32), gamma=3)
    engine.add_request([1, 2], SamplingParams(max_new_tokens=8), request_id="broken")
    with pytest.raises(InvalidLogitsError, match="draft logits contain NaN"):
        engine.step()
    # The failed round's request ended (its row freed) with nothing kept; the engine still serves.
    (aborted,) = engine.step()
    assert aborted.request_id == "broken" and aborted.finish_reason == "abort" and aborted.new_token_ids == []
    assert "draft logits contain NaN" in aborted.message and not engine.has_unfinished_requests()
    assert engine.num_running == 0 and Engine(target).generate([[1, 2]], SamplingParams(max_new_tokens=3))


def test_a_draft_with_another_tokenizer_drafts_through_a_vocabulary_map(text_pair, tmp_path):
    """(tests/test_cross_vocab.py checks the map and the drafter.)"""
    from specengine.devtools.tiny import train_tokenizer
    from specengine.drafters.cross_vocab import CrossVocabDrafter

    target, draft = text_pair
    other = tmp_path / "draft"
    shutil.copytree(draft, other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    train_tokenizer(vocab_size=290).save_pretrained(other)
    assert isinstance(Engine.from_pretrained(target, other).drafter, CrossVocabDrafter)


def test_padded_draft_vocabulary_is_accepted_and_never_proposes_padding(text_pair):
    from specengine.drafters.model import ModelDrafter

    engine = Engine.from_pretrained(*text_pair)
    real = len(engine.tokenizer)
    draft_model = engine.drafter.model
    padded = tiny_model(real + 13, seed=2, hidden_size=32)
    with torch.no_grad():
        padded.lm_head.weight[real:] = 0
        padded.lm_head.weight[real:, 0] = 100.0  # padding ids would dominate if not masked
    engine = Engine(engine.target, engine.tokenizer, ModelDrafter(padded, draft_model.config.vocab_size, real))
    (r,) = engine.generate(["a = "], SamplingParams(max_new_tokens=10, seed=1))
    assert all(t < real for t in r.token_ids)


def test_ngram_drafter_takes_no_draft_model(text_pair):
    with pytest.raises(ValueError, match="ngram drafter takes no draft model"):
        Engine.from_pretrained(*text_pair, drafter="ngram")
    with pytest.raises(ValueError, match="drafter must be"):
        Engine.from_pretrained(text_pair[0], drafter="eagle")


def test_cuda_request_without_cuda(text_pair):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Engine.from_pretrained(text_pair[0], device="cuda")


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_json(text_pair, capsys):
    target, draft = text_pair
    code = cli_main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def f(x):",
                     "--temperature", "0", "--max-new-tokens", "8", "--gamma", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 8 and isinstance(out["text"], str)
    assert out["stats"]["rounds"] >= 1 and "acceptance_rate" in out["stats"]


def test_cli_streams_text_and_prints_stats_line(text_pair):
    target, _ = text_pair
    proc = subprocess.run([sys.executable, "-m", "specengine", "generate", "--target", str(target), "--drafter",
                           "ngram", "--prompt", "class A:", "--max-new-tokens", "6", "--seed", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")
    assert "[specengine] " in proc.stderr and "tok/s" in proc.stderr and "alpha" in proc.stderr


def test_cli_reports_bad_input_cleanly(tmp_path, capsys):
    assert cli_main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["generate", "--target", str(tmp_path), "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p must be in" in capsys.readouterr().err


def test_cli_serve_answers_an_openai_client_and_stops_cleanly(text_pair, tmp_path, capsys):
    import signal
    import time

    import httpx
    import openai

    from server_util import free_port

    target, draft = text_pair
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "specengine", "serve", "--target", str(target), "--draft",
                               str(draft), "--gamma", "2", "--port", str(port), "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "specengine serve did not start"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == target.name
        want = Engine.from_pretrained(target, draft, gamma=2).generate(["def f("], SamplingParams(
            max_new_tokens=6, temperature=0))[0].text
        assert client.completions.create(model=target.name, prompt="def f(", max_tokens=6,
                                         temperature=0).choices[0].text == want
    finally:
        server.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status says why
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    # A target without a tokenizer (the server takes and returns text) is refused before anything listens.
    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    assert cli_main(["serve", "--target", str(bare), "--port", str(port)]) == 2
    assert "cannot load a tokenizer" in capsys.readouterr().err


def test_nvtx_ranges_bracket_each_phase(monkeypatch):
    """With nvtx=True every round pushes and pops draft, verify and accept ranges (recorded here
    in place of CUDA's NVTX); with nvtx=False nothing is marked."""
    from specengine.drafters.model import ModelDrafter

    marks = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: marks.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: marks.append(("pop",)))
    target = tiny_model(32, seed=0)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    Engine(target, drafter=ModelDrafter(target, 32, 32), gamma=2).generate([[1, 2]], params)
    assert marks == []
    (r,) = Engine(target, drafter=ModelDrafter(target, 32, 32), gamma=2, nvtx=True).generate([[1, 2]], params)
    pushes = [m[1] for m in marks if m[0] == "push"]
    assert pushes == ["prefill"] + ["draft", "verify", "accept"] * r.stats.rounds
    assert len([m for m in marks if m[0] == "pop"]) == len(pushes)


def test_timed_phases_add_up_to_the_run():
    from specengine.drafters.model import ModelDrafter

    target = tiny_model(32, seed=0)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    untimed = Engine(target, drafter=ModelDrafter(target, 32, 32), gamma=2)
    untimed.generate([[1, 2]], params)
    assert untimed.last_run_phases is None
    engine = Engine(target, drafter=ModelDrafter(target, 32, 32), gamma=2, time_phases=True)
    results = engine.generate([[1, 2], [3, 4, 5]], params)
    phases = engine.last_run_phases
    assert set(phases) == {"prefill", "draft", "verify", "accept", "host", "total"}
    assert all(phases[k] > 0 for k in ("prefill", "draft", "verify", "accept"))
    assert phases["host"] >= 0
    parts = sum(v for k, v in phases.items() if k != "total")
    assert parts == pytest.approx(phases["total"]) and phases["total"] == engine.last_run_stats.wall_time_s
    # Two rows decode side by side: the batch's rounds are the longer row's, not their sum.
    assert engine.last_run_rounds == max(r.stats.rounds for r in results)
