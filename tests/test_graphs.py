"""Fixed-shape steps on persistent caches (steps.graphs): on CPU the static-shape path runs
eagerly, which tests its bookkeeping (buckets, padding rows, static buffers); on a GPU the same
steps replay from CUDA graphs and must decode exactly as the eager engine does."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.steps.graphs import FixedShapeSteps, batch_bucket
from specengine.steps.feed import feed
from specengine.sampling.batch import SamplingBatch

from bounds import Float64Llama
from engine_util import assert_kernels_ran, device_head_dims, join, tiny_model

V = 40
PROMPTS = [[1, 2, 3, 4, 5], [7, 7], [3, 9, 27, 1, 3, 9, 27], [11, 5, 2]]
GPU = torch.cuda.is_available()


def test_batch_buckets():
    assert [batch_bucket(b, 8) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(b, 6) for b in (3, 5, 6)] == [4, 6, 6]  # the cache's rows are a bucket of their own
    with pytest.raises(ValueError, match="does not fit the 8 rows"):
        batch_bucket(9, 8)
    with pytest.raises(ValueError, match="does not fit"):
        batch_bucket(0, 8)


def test_static_steps_give_the_eager_logits_and_touch_only_their_own_slots():
    """Three rows padded to a bucket of four (after a batch of four used it, leaving stale
    entries): the rows' logits are the model's (within float32's bound of the exact ones); the
    step writes each row's new positions, and the padding row writes only the spill slot."""
    model = tiny_model(V, seed=1, hidden_size=32)
    steps = FixedShapeSteps(model, max_batch_size=8, capacity=24)
    steps.new_batch(4)
    with torch.no_grad():
        steps(torch.full((4, 2), 9), torch.full((4,), 5))
    prompts = PROMPTS[:3]
    cache = steps.new_batch(3)
    with torch.no_grad():
        feed(model, cache, prompts)
        before_k = cache.k.clone()
        tokens = torch.tensor([[4, 8], [1, 2], [30, 31]])
        got = steps(tokens, cache.lengths)
    exact = Float64Llama.from_specengine(model)  # both within float32's bound of the exact logits
    for b, p in enumerate(prompts):
        exact.logits(p + tokens[b].tolist())[-2:].check(got[b], f"row {b}")
    changed = (cache.k != before_k).any(-1).any(-1).any(0)  # [rows, slots]: written in some layer or head
    for b, p in enumerate(prompts):
        assert changed[b].nonzero().flatten().tolist() == [len(p), len(p) + 1]
    assert changed[3].nonzero().flatten().tolist() == [24]  # the padding row: spill slot only
    assert not changed[4:].any()
    assert steps.replays == 0 and not steps.use_graphs  # CPU: the eager static-shape path


def test_graphs_refuse_a_cpu_model():
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        FixedShapeSteps(tiny_model(V), 2, 16, use_graphs=True)


def engines(device, head_dim=None):
    target = tiny_model(V, seed=0, logit_scale=3.0, head_dim=head_dim).to(device)
    draft = tiny_model(V, seed=5, num_layers=1, logit_scale=3.0, head_dim=head_dim).to(device)
    eager = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3)
    static = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, cuda_graphs=True, max_batch_size=4)
    return eager, static


def decode_both(eager, static):
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=s)
              for n, t, s in [(12, 0.0, 1), (20, 1.0, 2), (7, 0.8, 3), (16, 0.0, 4)]]
    for prompts in (PROMPTS, PROMPTS[1:3], PROMPTS[:1]):  # buckets 4, 2, 1, and a persistent cache reused
        want = [r.token_ids for r in eager.generate(prompts, params[:len(prompts)])]
        got = [r.token_ids for r in static.generate(prompts, params[:len(prompts)])]
        assert got == want


def test_static_engine_decodes_as_the_eager_engine_on_cpu():
    """Greedy and seeded sampling, rows finishing at different rounds, three runs on one engine."""
    eager, static = engines("cpu")
    decode_both(eager, static)


def test_static_engine_queues_requests_past_its_rows():
    """Six requests on four rows: the last two wait for rows that free up, and every request gets
    the tokens it gets in the eager engine's one batch of six."""
    eager, static = engines("cpu")
    prompts = PROMPTS + PROMPTS[:2]
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=s) for s, n in enumerate([5, 9, 14, 7, 11, 6])]
    want = [r.token_ids for r in eager.generate(prompts, params)]
    assert [r.token_ids for r in static.generate(prompts, params)] == want
    assert static.target_steps.cache.allocated_rows == 4
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        Engine(tiny_model(V), cuda_graphs=True, max_batch_size=0)


@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_graph_replay_decodes_as_the_eager_engine(device, head_dim):
    """On CUDA: graphs replayed over the compiled step kernels (head sizes they are built for),
    token for token as the eager engine; on a CPU the same decoding on the CPU path, eagerly."""
    eager, static = engines(device, head_dim)
    decode_both(eager, static)
    assert_kernels_ran(static.target, static.drafter.model)
    for steps in (static.target_steps, static.drafter.steps):
        assert steps.fallback_reason is None
        assert steps.use_graphs == (device == "cuda") and (steps.replays > 0) == (device == "cuda")


def test_auto_gamma_times_the_static_steps_its_rounds_take():
    """gamma="auto" with cuda_graphs measures its costs on the engine's fixed-shape steps (graph
    replays on a GPU, what its rounds pay), for one row and for max_batch_size rows, and still
    decodes as the eager engine does."""
    target = tiny_model(V, seed=0, logit_scale=3.0)
    draft = tiny_model(V, seed=5, num_layers=1, logit_scale=3.0)
    static = Engine(target, drafter=ModelDrafter(draft, V, V), gamma="auto", max_gamma=3, cuda_graphs=True,
                    max_batch_size=2)
    assert sorted(static.gamma_controller.costs_by_batch) == [1, 2]
    # every verification width 1..max_gamma+1 ran as a static target step, in both buckets
    assert sorted(static.target_steps.graphs.entries) == [(b, k) for b in (1, 2) for k in range(1, 5)]
    assert sorted(static.drafter.steps.graphs.entries) == [(1, 1), (2, 1)]
    eager = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3)
    params = [SamplingParams(max_new_tokens=15, temperature=0.0), SamplingParams(max_new_tokens=9, temperature=0.0)]
    want = [r.token_ids for r in eager.generate(PROMPTS[:2], params)]
    assert [r.token_ids for r in static.generate(PROMPTS[:2], params)] == want


def test_static_draft_phase_is_one_fixed_shape_computation_and_decodes_as_eager():
    """With static steps the whole draft phase (the catch-up, which always feeds the last two
    tokens, one of them again after a rejection; the draft steps; the samplings) is one
    fixed-shape computation per (bucket, gamma); a one-token prompt feeds its token and a padding
    slot. Outputs equal the eager engine's (which feeds 1 or 2 tokens as needed)."""
    eager, static = engines("cpu")
    prompts = [[4], [7, 7], [3, 9, 27, 1, 3]]
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=s) for n, t, s in [(14, 0.0, 1), (18, 1.0, 2),
                                                                                       (11, 0.9, 3)]]
    want = [r.token_ids for r in eager.generate(prompts, params)]
    assert [r.token_ids for r in static.generate(prompts, params)] == want
    # one fixed-shape draft phase per (bucket, gamma) in use, no separate draft steps
    keys = static.drafter.steps.graphs.entries
    assert ("draft phase", 4, 3, False) in keys and all(k[0] == "draft phase" for k in keys)  # False: no filters
    # The first draft distribution of each row is the draft model's on its whole prompt.
    drafter, model = static.drafter, static.drafter.model
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 3, [1, 2, 3], "cpu")
    drafter.keep_rows([])  # rows of its own, not the engine's
    join(drafter, prompts)
    with torch.inference_mode():  # as the engine runs (its static buffers are inference tensors)
        first = drafter.propose(prompts, [2, 2, 2], sampling).logits[:, 0]
        # as the eager path leaves it: the catch-up and one draft step fed, the last draft not
        assert drafter.cache.lengths.tolist() == [len(p) + 1 for p in prompts]
    exact = Float64Llama.from_specengine(model)
    for row, prompt in enumerate(prompts):
        exact.logits(prompt)[-1].check(first[row], f"row {row}")


def test_drafter_catch_up_after_rounds_without_drafts_takes_the_eager_feed():
    """gamma="auto" may draft 0 for a few rounds: the drafter then lacks more than the static
    width. Its first draft distribution must still be the draft model's on the whole sequence."""
    _, static = engines("cpu")
    drafter, model = static.drafter, static.drafter.model
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.0)], [1], "cpu")
    drafter.keep_rows([])
    join(drafter, [[1, 2, 3]])  # caches [1, 2]
    assert drafter.cache.lengths.tolist() == [2]
    sequence = [1, 2, 3, 5, 6, 7]  # three target-only rounds later: 4 tokens to catch up on
    with torch.no_grad():
        proposal = drafter.propose([sequence], [2], sampling)
    Float64Llama.from_specengine(model).logits(sequence)[-1].check(proposal.logits[0, 0])
    assert drafter.cache.lengths.tolist() == [len(sequence) + 1]  # the gap, then one draft step



@pytest.mark.parametrize("static_steps", [False, True])
def test_drafter_catch_up_after_a_rejection_then_rounds_without_drafts(static_steps):
    """A round drafts 3 and its first draft is rejected (verification clips the draft cache to the
    target's length); then rounds at gamma 0. The next catch-up must feed what the cache lost
    with the rejection: its first draft distribution is the draft model's on the whole sequence."""
    eager, static = engines("cpu")
    engine = static if static_steps else eager
    drafter, model = engine.drafter, engine.drafter.model
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.0)], [1], "cpu")
    drafter.keep_rows([])
    join(drafter, [[1, 2, 3]])  # caches [1, 2]
    with torch.inference_mode():
        drafts = drafter.propose([[1, 2, 3]], [3], sampling).tokens[0].tolist()
        rejected = (drafts[0] + 1) % V
        drafter.cache.lengths.clamp_(max=3)  # verification: the target emitted one token, not drafts[0]
        drafter.verified([3], 3, [4])         # the engine says so after the round
        sequence = [1, 2, 3, rejected, 5, 6]  # two target-only rounds later
        proposal = drafter.propose([sequence], [2], sampling)
    Float64Llama.from_specengine(model).logits(sequence)[-1].check(proposal.logits[0, 0])


@pytest.mark.parametrize("static_steps", [False, True])
def test_the_drafters_host_lengths_follow_verification_through_rounds_without_drafts(static_steps):
    """gamma changing between 3 and 0 round by round (as gamma="auto" does): after every step the
    draft cache's lengths are what the drafter believes they are, or more (a row fed beyond)."""
    target = tiny_model(V, seed=0, logit_scale=3.0)
    draft = tiny_model(V, seed=5, num_layers=1, logit_scale=3.0)
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, cuda_graphs=static_steps, max_batch_size=4)
    gammas = iter([3, 0, 0, 3, 3, 0, 3, 0, 0, 0, 3] * 4)
    engine.scheduler.choose_gamma = lambda decoding: next(gammas)
    for seed in range(3):
        engine.add_request([1 + seed, 2, 3], SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        drafter = engine.drafter
        if engine.scheduler.decoding:
            rows = len(drafter.fed)
            held = drafter.cache.lengths[:rows].tolist()
            assert all(fed <= n for fed, n in zip(drafter.fed, held)), (drafter.fed, held)
            checked += 1
    assert checked > 10


def test_eager_draft_steps_see_their_whole_prefix_and_name_their_keys():
    """The eager drafter on ragged rows: every draft distribution is the draft model's on the whole
    sequence so far, and each draft step tells the model its kv_len (known on the host: reading
    it from the positions would synchronise a GPU every step)."""
    model = tiny_model(V, seed=3, hidden_size=32)
    drafter = ModelDrafter(model, V, V)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 7], [3, 9, 27, 1]]
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 3, [1, 2, 3], "cpu")
    join(drafter, prompts)
    kv_lens, forward = [], model.forward

    def spy(tokens, start_pos, cache, kv_len=None):
        kv_lens.append(kv_len)
        return forward(tokens, start_pos, cache, kv_len)

    model.forward = spy
    with torch.no_grad():
        proposal = drafter.propose(prompts, [4, 4, 4], sampling)
    del model.forward
    assert kv_lens[1:] == [len(prompts[0]) + i + 1 for i in range(3)]  # after the catch-up
    exact = Float64Llama.from_specengine(model)
    for row, prompt in enumerate(prompts):
        sequence = prompt + proposal.tokens[row].tolist()
        exact.logits(sequence)[len(prompt) - 1: len(prompt) + 3].check(proposal.logits[row], f"row {row}")
