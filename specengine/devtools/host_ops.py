"""What the host does per round, outside graph replays: the torch ops it dispatches and its reads
from the device. On a GPU each dispatched op is a launch (or at least a dispatch) the round pays
on top of its replays, and each read is a synchronisation; on a CPU the fixed-shape path runs the
same host code with the graphs' bodies eager, so the counts are the same. bench/bench_host.py
reports them; tests/test_host_ops.py holds them under a bound. Development code: the runtime
never imports it (it patches the engine's methods for the length of a count).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..steps.graphs import CapturedCalls

# Ops whose result the host reads: int(t), float(t), bool(t), t.item() (t.tolist() is counted
# apart: on a CPU tensor it reads without dispatching).
_READ_OPS = {torch.ops.aten._local_scalar_dense.default}


class HostOps(TorchDispatchMode):
    """Counts, while `counting`, the ops dispatched outside CapturedCalls.run and the reads."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.ops = 0
        self.reads = 0
        self.graphed = 0  # CapturedCalls.run calls in progress: what they dispatch, a GPU replays

    def _counts(self) -> bool:
        return self.counting and self.graphed == 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._counts():
            self.ops += 1
            self.reads += func in _READ_OPS
        return func(*args, **(kwargs or {}))

    @contextmanager
    def count(self):
        """Count inside this block (and count each tensor.tolist() there as a read). CapturedCalls.run
        is wrapped meanwhile, so that what runs inside it (a graph's body) is left out."""
        tolist, graphed_run = torch.Tensor.tolist, CapturedCalls.run
        mode = self

        def counted_tolist(t):
            if mode._counts():
                mode.reads += 1
            return tolist(t)

        def uncounted_run(calls, *args, **kwargs):
            mode.graphed += 1
            try:
                return graphed_run(calls, *args, **kwargs)
            finally:
                mode.graphed -= 1

        torch.Tensor.tolist = counted_tolist
        CapturedCalls.run = uncounted_run
        self.counting = True
        try:
            yield self
        finally:
            self.counting = False
            torch.Tensor.tolist = tolist
            CapturedCalls.run = graphed_run


def per_round(engine, prompts, params) -> dict[str, float]:
    """Host ops and reads per round of engine.generate(prompts, params), its prefill left out
    (only the rounds' own work, the model runner's RoundRunner.run, is counted); and of the rounds run in blocks
    from device state (engine.rounds.RoundRunner._block), their ops per round and reads per block,
    the block's setup and its one read included."""
    counter = HostOps()
    round_runner = engine.runner.rounds
    run_rounds = round_runner.run
    blocks = dict(blocks=0, rounds=0, ops=0, reads=0)

    def counted(*args):
        ops, reads = counter.ops, counter.reads
        with counter.count():
            results, gamma = run_rounds(*args)
        rounds = results[0].rounds
        if rounds > 1:  # a block (one round before the read: a host round)
            blocks["blocks"] += 1
            blocks["rounds"] += rounds
            blocks["ops"] += counter.ops - ops
            blocks["reads"] += counter.reads - reads
        return results, gamma

    round_runner.run = counted
    try:
        with counter:
            engine.generate(prompts, params)
    finally:
        del round_runner.run
    rounds = engine.last_run_rounds
    result = dict(rounds=rounds, ops_per_round=counter.ops / rounds, reads_per_round=counter.reads / rounds)
    if blocks["blocks"]:
        result.update(block_rounds=blocks["rounds"], block_ops_per_round=blocks["ops"] / blocks["rounds"],
                      reads_per_block=blocks["reads"] / blocks["blocks"])
    return result
