"""The host's part of a round (specengine.devtools.host_ops), held under bounds: a change that adds torch ops or
device reads to every round fails here (bench/bench_host.py reports the counts)."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.devtools.host_ops import HostOps, per_round
from specengine.drafters.model import ModelDrafter

from engine_util import tiny_model

V = 50

# (gamma, rounds_per_read) -> (ops, reads) per round at most, host rounds and blocks together.
# Measured on 2026-12-03 (batch 8): 28.1 and 1, 4.4 and 0.25, 57.0 and 1, 27.1 and 0.56 (blocks shrink
# as rows near their ends, and the last rounds are host rounds). A host round is read once, as a
# block is: its log (tokens, counts, checks) comes back in one read.
BOUNDS = {(0, 1): (29, 1), (0, 4): (12, 1), (3, 1): (58, 1), (3, 4): (28, 1)}


@pytest.fixture(scope="module")
def pair():
    return tiny_model(V, seed=0, hidden_size=32), tiny_model(V, seed=3, num_layers=1, hidden_size=32)


@pytest.mark.parametrize("gamma, rounds_per_read", list(BOUNDS))
@pytest.mark.parametrize("batch", [1, 8])
def test_host_ops_and_reads_per_round_stay_bounded(pair, gamma, rounds_per_read, batch):
    target, draft = pair
    engine = Engine(target, drafter=ModelDrafter(draft, V, V) if gamma else None, gamma=gamma or 5, cuda_graphs=True,
                    max_batch_size=8, rounds_per_read=rounds_per_read)
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(batch)]
    counts = per_round(engine, [[1, 2, 3]] * batch, params)
    ops, reads = BOUNDS[gamma, rounds_per_read]
    assert counts["ops_per_round"] <= ops and counts["reads_per_round"] <= reads, counts
    assert counts["ops_per_round"] > 0  # the counter sees the rounds
    if rounds_per_read > 1:
        # Inside a block a round is one graphed call: the block's setup spread over its rounds, and
        # one read at its end.
        assert counts["block_ops_per_round"] <= 10 and counts["reads_per_block"] == 1, counts


def test_the_counter_leaves_graph_bodies_out_and_counts_reads():
    from specengine.steps.graphs import CapturedCalls

    calls = CapturedCalls(use_graphs=False)
    calls.buffers("k", lambda: dict(x=torch.ones(3)))
    counter = HostOps()
    with counter, counter.count():
        y = torch.ones(3) + 1                                   # 2 ops: ones, add
        calls.run("k", lambda x: (x * 2 + 1,))                  # a replay on a GPU: not counted
        float(y.sum())                                          # sum and a read
        y.tolist()                                              # a read
    assert (counter.ops, counter.reads) == (4, 2)
