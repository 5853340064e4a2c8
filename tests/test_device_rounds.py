"""Engine(rounds_per_read=N): blocks of rounds run from device state and read back once. They
must give exactly the tokens of round-by-round decoding, stop exactly, keep statistics consistent
and refuse what they cannot do. On CPU the fixed-shape steps run eagerly; on a GPU the same code
replays graphs."""
from typing import NamedTuple

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.cli import build_parser
from specengine.drafters.model import ModelDrafter
from specengine.engine.config import EngineConfig
from specengine.engine.rounds import RoundRunner, rounds_that_fit
from specengine.sampling.batch import InvalidLogitsError, SamplingBatch
from specengine.shipped import shipped_pair

from bounds import Float64Llama
from engine_util import assert_blocks_ran_on_their_path, device_head_dims, tiny_model

V = 40
PROMPTS = [[1, 2, 3, 4, 5], [7, 7], [3, 9, 27, 1, 3, 9, 27], [4]]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=t, seed=s)
          for n, t, s in [(30, 0.0, 1), (41, 1.0, 2), (17, 0.8, 3), (26, 0.0, 4)]]


def models(device="cpu", head_dim=None):
    return (tiny_model(V, seed=0, logit_scale=3.0, head_dim=head_dim).to(device),
            tiny_model(V, seed=5, num_layers=1, logit_scale=3.0, head_dim=head_dim).to(device))


def engine(target, draft, rounds_per_read=1, gamma=3, **kw):
    drafter = ModelDrafter(draft, V, V) if draft is not None else None
    return Engine(target, drafter=drafter, gamma=gamma, cuda_graphs=True, max_batch_size=4,
                  rounds_per_read=rounds_per_read, **kw)


class Block(NamedTuple):
    rounds: int
    starts: list[int]  # each row's length before the block
    ends: list[int]    # ... and after it, every token the block computed kept


@pytest.fixture
def block_spy(monkeypatch):
    """Records every block the engine runs from device state."""
    blocks = []
    real = RoundRunner.run

    def spy(runner, batch, gamma, rounds_per_read):
        starts = [len(r.tokens) for r in batch.requests]
        results, made = real(runner, batch, gamma, rounds_per_read)
        if results[0].rounds > 1:  # a block (one round: a host round)
            blocks.append(Block(results[0].rounds, starts, [n + len(r.tokens) for n, r in zip(starts, results)]))
        return results, made
    monkeypatch.setattr(RoundRunner, "run", spy)
    return blocks


def test_rounds_that_fit():
    # a round drafts gamma only while gamma + 1 tokens remain, and emits at most gamma + 1
    assert rounds_that_fit([4], 3) == 1
    assert rounds_that_fit([8], 3) == 2
    assert rounds_that_fit([3], 3) == 0
    assert rounds_that_fit([100, 9, 50], 3) == 2
    assert rounds_that_fit([5], 0) == 5  # target-only: one token a round


@pytest.mark.parametrize("rounds_per_read", [2, 5, 64])
@pytest.mark.parametrize("draft_kind", ["weak", "perfect"])
def test_blocks_decode_exactly_as_round_by_round(rounds_per_read, draft_kind, block_spy, rehearsed_captures):
    """Greedy and seeded sampling, rows of different lengths and limits (one one-token prompt),
    rows finishing inside blocks: the same tokens as the engine that reads every round. The
    perfect draft (the target itself) accepts everything: every round emits gamma + 1 tokens.
    Each captured call's first run follows a capture's warm-ups and their undoing, as on a GPU."""
    target, draft = models()
    if draft_kind == "perfect":
        draft = target
    want = [r.token_ids for r in engine(target, draft).generate(PROMPTS, PARAMS)]
    blocks = engine(target, draft, rounds_per_read)
    results = blocks.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == want
    assert block_spy and 1 < max(b.rounds for b in block_spy) <= rounds_per_read
    for r, p in zip(results, PARAMS):
        s = r.stats
        assert len(r.token_ids) == p.max_new_tokens == s.generated_tokens
        assert sum(s.accepted_histogram) == s.rounds and s.accepted <= s.drafted <= 3 * s.rounds
        assert s.accepted == sum(k * n for k, n in enumerate(s.accepted_histogram))
        if draft_kind == "perfect":
            assert s.accepted == s.drafted and s.rejections == 0
        assert s.rounds >= -(-p.max_new_tokens // 4)  # at most gamma + 1 tokens a round


def test_blocks_stop_exactly_at_eos_and_stop_strings(block_spy):
    """A block computes past a row's EOS; what the user gets still ends exactly at it."""
    target, draft = models()
    free = engine(target, draft).generate(PROMPTS[:2], PARAMS[:2])
    eos = free[0].token_ids[9]  # a token the first row emits as its 10th
    want = engine(target, draft, eos_token_ids=[eos]).generate(PROMPTS[:2], PARAMS[:2])
    got = engine(target, draft, 16, eos_token_ids=[eos]).generate(PROMPTS[:2], PARAMS[:2])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == eos
    assert len(got[0].token_ids) == free[0].token_ids.index(eos) + 1
    assert block_spy


@pytest.mark.skipif(shipped_pair() is None, reason="the pycode pair is not installed")
def test_a_stop_string_inside_a_block_ends_the_output_where_target_only_decoding_does(block_spy):
    """With a real tokenizer (the shipped pycode pair's): a block computes past the token that
    completes a stop string; the output still ends exactly where target-only decoding, read every
    round, ends it: the same tokens, the same text (cut before the stop string)."""
    target_dir, draft_dir = shipped_pair()
    prompt, greedy = "def fibonacci(n):", SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    plain = Engine.from_pretrained(target_dir, prefix_cache_bytes=0)
    free = plain.generate([prompt], greedy)[0]
    decode = plain.tokenizer.decode
    # Four characters across a token boundary past the first block's start (the first round drafts
    # from the host: its catch-up feeds the draft model), the first place they occur in the text.
    ends = [len(decode(free.token_ids[:n], skip_special_tokens=True)) for n in range(1, 48)]
    stop = next(free.text[e - 2:e + 2] for e in ends[16:] if free.text.find(free.text[e - 2:e + 2]) == e - 2)
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate([prompt], params)[0]
    blocks = Engine.from_pretrained(target_dir, draft_dir, gamma=3, cuda_graphs=True, max_batch_size=2,
                                    rounds_per_read=8, prefix_cache_bytes=0)
    got = blocks.generate([prompt], params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert len(want.token_ids) < len(free.token_ids) and stop not in got.text
    # The block that reached the stop string computed tokens past it, which were dropped.
    end = len(want.prompt_token_ids) + len(want.token_ids)
    assert any(b.rounds > 1 and b.starts[0] < end < b.ends[0] for b in block_spy), (end, block_spy)


def test_target_only_and_auto_gamma_blocks(block_spy):
    target, draft = models()
    plain = Engine(target, cuda_graphs=True, max_batch_size=4)
    want = [r.token_ids for r in plain.generate(PROMPTS, PARAMS)]
    blocked = Engine(target, cuda_graphs=True, max_batch_size=4, rounds_per_read=8)
    assert [r.token_ids for r in blocked.generate(PROMPTS, PARAMS)] == want
    assert max(b.rounds for b in block_spy) == 8
    # auto: one gamma per block; greedy rows still give the target's greedy tokens
    auto = engine(target, draft, 6, gamma="auto", max_gamma=4)
    greedy = [SamplingParams(max_new_tokens=25, temperature=0.0)] * 3
    assert ([r.token_ids for r in auto.generate(PROMPTS[:3], greedy)]
            == [r.token_ids for r in plain.generate(PROMPTS[:3], greedy)])


def test_broken_logits_inside_a_block_are_named_and_nothing_is_kept():
    target, draft = models()
    with torch.no_grad():
        draft.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(InvalidLogitsError, match=r"draft logits contain NaN or infinite entries \(round 1 of 4 read "):
        engine(target, draft, 4).generate(PROMPTS[:1], PARAMS[:1])


def test_a_row_whose_logits_break_inside_a_block_ends_alone(monkeypatch):
    """Logits are checked per row inside a block as in a host round: the broken row ends with the
    reason and keeps nothing of the block; the row beside it keeps every token."""
    target, draft = models()
    want = [r.token_ids for r in engine(target, draft).generate(PROMPTS[:2], PARAMS[:2])]
    real = ModelDrafter.draft_phase_in_round

    def second_row_broken(self, *args):
        drafts, logits = real(self, *args)
        if logits.shape[0] > 1:  # the second row of the batch, whichever request holds it
            logits[1, 0, 0] = float("nan")
        return drafts, logits
    monkeypatch.setattr(ModelDrafter, "draft_phase_in_round", second_row_broken)
    blocks = engine(target, draft, 4)
    ids = [blocks.add_request(p, s) for p, s in zip(PROMPTS[:2], PARAMS[:2])]
    tokens, ends, errors = {i: [] for i in ids}, {}, []
    while blocks.has_unfinished_requests() or blocks.has_pending_outputs():
        try:
            for output in blocks.step():
                tokens[output.request_id] += output.new_token_ids
                if output.finished:
                    ends[output.request_id] = (output.finish_reason, output.message)
        except InvalidLogitsError as exc:
            errors.append(str(exc))
    assert errors == ["draft logits contain NaN or infinite entries (round 1 of 4 read together); nothing of those "
                      "rounds was kept"]
    (broken,) = [i for i in ids if ends[i][0] == "abort"]
    assert errors[0] in ends[broken][1] and tokens[broken] == []
    (kept,) = [n for n, i in enumerate(ids) if i != broken]
    assert ends[ids[kept]][0] == "length" and tokens[ids[kept]] == want[kept]


def test_rounds_per_read_is_validated():
    target, draft = models()
    with pytest.raises(ValueError, match="rounds_per_read must be a positive integer"):
        engine(target, draft, 0)
    with pytest.raises(ValueError, match="needs cuda_graphs=True"):
        Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, rounds_per_read=4)


def test_check_every_the_old_name_still_works_with_a_deprecation_warning(block_spy):
    """check_every, rounds_per_read's old name: accepted by EngineConfig, Engine (and so
    Engine.from_pretrained) and the CLI, and read, each with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="check_every is now called rounds_per_read"):
        config = EngineConfig(cuda_graphs=True, check_every=4)
    assert config == EngineConfig(cuda_graphs=True, rounds_per_read=4)
    with pytest.warns(DeprecationWarning, match="rounds_per_read"):
        assert config.check_every == 4
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        EngineConfig(cuda_graphs=True, check_every=4, rounds_per_read=4)
    target, draft = models()
    want = [r.token_ids for r in engine(target, draft, 4).generate(PROMPTS, PARAMS)]
    with pytest.warns(DeprecationWarning, match="check_every") as caught:
        old = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, cuda_graphs=True, max_batch_size=4,
                     check_every=4)
    assert caught[0].filename == __file__  # pointed at the caller's line, not at specengine's
    assert old.config.rounds_per_read == 4 and [r.token_ids for r in old.generate(PROMPTS, PARAMS)] == want
    assert max(b.rounds for b in block_spy) == 4
    with pytest.warns(DeprecationWarning, match="--check-every is now --rounds-per-read"):
        assert build_parser().parse_args(["generate", "--prompt", "x", "--check-every", "4"]).rounds_per_read == 4
    assert build_parser().parse_args(["generate", "--prompt", "x", "--rounds-per-read", "3"]).rounds_per_read == 3


@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_blocks_replay_graphs_and_decode_as_eager(block_spy, device, head_dim):
    """On CUDA: blocks of rounds replayed from captured graphs over the compiled step kernels; on a
    CPU the same blocks run eagerly on the CPU path."""
    target, draft = models(device, head_dim)
    eager = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3)
    want = [r.token_ids for r in eager.generate(PROMPTS, PARAMS)]
    blocks = engine(target, draft, 8)
    assert [r.token_ids for r in blocks.generate(PROMPTS, PARAMS)] == want
    assert block_spy
    assert_blocks_ran_on_their_path(blocks, device)


def test_drafter_state_after_a_block_serves_a_later_catch_up():
    """After a block the drafter knows only that all but each row's last two tokens are cached (a
    fully accepted last round leaves exactly that). A later catch-up over a longer gap (rounds of
    gamma="auto" at 0) must then feed from there: its first draft distribution is the draft
    model's on the whole sequence."""
    target, _ = models()
    blocks = engine(target, target, 64)  # the perfect draft: every round accepts all 3 drafts
    # One step: a block of three full rounds (12 tokens); the request, one token short, keeps its row.
    blocks.add_request(PROMPTS[0], SamplingParams(max_new_tokens=13, temperature=0.0))
    (output,) = blocks.step()
    assert not output.finished and output.stats.rounds == 3 and output.stats.accepted == 9
    sequence = PROMPTS[0] + output.new_token_ids + [5, 6, 7]
    drafter = blocks.drafter
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.0)], [1], "cpu")
    with torch.inference_mode():
        first = drafter.propose([sequence], [2], sampling).logits[0, 0]
    Float64Llama.from_specengine(target).logits(sequence)[-1].check(first)


def test_auto_gamma_drafts_from_device_state_only_once_the_draft_cache_has_caught_up(monkeypatch):
    """After rounds at gamma 0 the draft cache lacks more than the last two tokens that a round run
    from device state feeds it: the first drafting round is a host round (its catch-up feeds the
    whole gap), and only then may blocks draft. A perfect draft then accepts every greedy draft."""
    target, _ = models()
    auto = engine(target, target, 6, gamma="auto", max_gamma=3)
    script = iter([0, 0] + [3] * 100)  # two blocks of 6 target-only rounds, then drafting
    monkeypatch.setattr(auto.gamma_controller, "choose", lambda estimates: next(script))
    lags = []  # per drafting block: the most tokens a row's draft cache lacks when it starts
    real = RoundRunner._block

    def spy(runner, sampling, sequences, gamma, rounds):
        if gamma > 0:
            lags.append(max(len(s) - min(fed, len(s) - 1) for s, fed in zip(sequences, runner.drafter.fed)))
        return real(runner, sampling, sequences, gamma, rounds)
    monkeypatch.setattr(RoundRunner, "_block", spy)
    (result,) = auto.generate([PROMPTS[0]], SamplingParams(max_new_tokens=40, temperature=0.0))
    assert lags and max(lags) <= auto.drafter.CATCH_UP_WIDTH
    assert result.stats.drafted > 0 and result.stats.accepted == result.stats.drafted
    assert result.token_ids == Engine(target).generate([PROMPTS[0]], SamplingParams(max_new_tokens=40,
                                                                                     temperature=0.0))[0].token_ids


@pytest.mark.parametrize("rounds_per_read", [1, 4])
def test_after_every_read_the_drafter_knows_its_cache_exactly(rounds_per_read, block_spy):
    """Host rounds and blocks end alike: the drafter's hook after the read (Drafter.verified, told
    where each row's last round started and where it ended) leaves its host lengths equal to the
    draft cache's, rejected drafts clipped, through blocks and rounds at gamma 0 alike."""
    target, draft = models()
    blocks = engine(target, draft, rounds_per_read)
    gammas = iter([3, 3, 0, 3, 0, 0, 3, 3, 3, 0] * 20)
    blocks.scheduler.choose_gamma = lambda decoding: next(gammas)
    for p, s in zip(PROMPTS, PARAMS):
        blocks.add_request(p, s)
    checked = 0
    while blocks.has_unfinished_requests():
        blocks.step()
        drafter = blocks.drafter
        if blocks.scheduler.decoding:
            held = drafter.cache.lengths[:len(drafter.fed)].tolist()
            assert drafter.fed == held
            checked += 1
    assert checked > 10 and (rounds_per_read == 1) == (not block_spy)
