"""Measuring the step costs that gamma="auto" decides from (engine/gamma.py holds the policy), and
keeping them per machine.

measure_costs times, on this machine and at one batch size, the target's call on 1..max_gamma+1
tokens and one draft step (with its sampling), and returns them as a gamma.CostModel. The engine
asks for a batch size's costs when a batch first needs them (gamma.CostTable); benchmarks call it
too. CostStore keeps what was measured in the cache folder, keyed by what the costs depend on, so
that the next process starting the same models on the same machine reads them instead of measuring.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..ops.verify import sample_warped
from ..tokenizer import cache_dir
from .gamma import CostModel

log = logging.getLogger("specengine")

CONTEXT = 64  # cached tokens per row while timing
# Timed rounds, one call of each kind a round (the costs are their medians), after untimed ones:
# a fresh process's first calls run slow (see measure_costs). Four after one chose gammas about as
# well as seven after three, in a third of the time; three after one, worse.
REPS = 4
WARMUPS = 1


def timed_widths(max_gamma: int) -> tuple[int, ...]:
    """The verification widths (tokens per row) the engine times the target at on the eager path:
    1 to 5 and the widest (then every fourth below it); measure_costs interpolates the others.
    A target call's cost on a CPU grows with its tokens linearly between steps, where the matrix
    kernels' tiles of rows fill (the default target's steps up between 4 and 5 tokens), so the
    narrow widths are all timed: interpolating across such a step misprices the gammas beside it.
    The wide calls, which take most of the time, are spaced out. Measured: these widths choose as
    well as timing every width, fewer narrow ones worse (bench/results/categories-2026-12-03.md)."""
    top = max_gamma + 1
    return tuple(sorted({k for k in range(1, 6) if k < top} | {top, *range(top, 5, -4)}))


def _seconds(call) -> float:
    """Wall-clock seconds of call(), its GPU work included."""
    t0 = time.perf_counter()
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure_costs(target, draft, max_gamma: int, batch_size: int = 1, context: int = CONTEXT, reps: int = REPS,
                  target_steps=None, draft_steps=None, widths: Sequence[int] | None = None,
                  warmups: int = WARMUPS) -> CostModel:
    """Time the target on 1..max_gamma+1 tokens and one draft step for `batch_size` rows at `context`
    cached tokens (a draft of None costs nothing). A draft step is what a drafter pays per token:
    the forward, and warping and sampling its distribution (no small share of the forward on a CPU).
    target_steps, draft_steps: the engine's FixedShapeSteps when it runs fixed-shape steps; then their
    calls are timed (replayed CUDA graphs on a GPU), since that is what its rounds pay.
    widths: the token counts to time the target at (default: every one; see timed_widths), 1 and
    max_gamma + 1 among them; the costs at the others are interpolated linearly between them."""
    widths = tuple(range(1, max_gamma + 2)) if widths is None else tuple(sorted(set(widths)))
    if widths[0] != 1 or widths[-1] != max_gamma + 1:
        raise ValueError(f"widths must run from 1 to max_gamma + 1 = {max_gamma + 1}, got {widths}")
    if reps < 1 or warmups < 0:
        raise ValueError(f"measuring needs reps >= 1 and warmups >= 0, got {reps} and {warmups}")

    def step(model, tokens: int, steps=None, then=None):
        """A call of `model` on `tokens` new tokens per row (then `then` on its last logits)."""
        if steps is not None:
            cache = steps.new_batch(batch_size)
            cache.lengths.fill_(max(0, min(context, cache.capacity - tokens)))
            forward = lambda x: steps(x, cache.lengths)  # noqa: E731
        else:
            cache = model.new_cache(batch_size, context + tokens)
            cache.pretend_filled(context)
            forward = lambda x: model.logits(model(x, cache.lengths.clone(), cache, kv_len=context + tokens))  # noqa: E731
        x = torch.zeros(batch_size, tokens, dtype=torch.int64, device=model.device)

        def call():
            logits = forward(x)
            if then is not None:
                then(logits[:, -1])
        return call

    def sample(logits):
        rows, device = logits.shape[0], logits.device
        ones, zeros = torch.ones(rows, device=device), torch.zeros(rows, device=device)
        # temperature 1, no top-k / top-p / min-p: the softmax path every sampled row takes
        sample_warped(logits, ones, zeros.long(), ones, zeros, 0.5 * ones)

    target_calls = [step(target, k, target_steps) for k in widths]
    draft_call = step(draft, 1, draft_steps, then=sample) if draft is not None else None
    calls = target_calls + ([draft_call] if draft_call else [])
    # Warm-up rounds: a fresh process's first timings run slow (caches, allocations, lazy
    # initialisation), which would make drafting look cheap.
    for _ in range(warmups):
        for call in calls:
            call()
    # Interleaved, one of each call per round, median over the rounds: timed one after the other,
    # a slow stretch of the machine falls on one call's timings and skews its cost alone (and
    # gamma="auto" then chooses differently from one start-up to the next); interleaved, it spoils
    # a round or two, not the median of one cost.
    target_s: list[list[float]] = [[] for _ in target_calls]
    draft_s: list[float] = []
    for _ in range(reps):
        for call, seconds in zip(target_calls, target_s):
            seconds.append(_seconds(call))
        if draft_call is not None:
            # A round's draft steps run back to back. The first, right after a target call, also
            # reloads the draft's weights into the CPU's caches: a cost per drafting round, which
            # its learned overhead covers (GammaController.observe_round), not per step. So the
            # steps timed follow another (three a round: the draft step is short, and its timings
            # the noisiest).
            draft_call()
            draft_s += [_seconds(draft_call) for _ in range(3)]
    timed = [statistics.median(seconds) for seconds in target_s]
    return CostModel(statistics.median(draft_s) if draft_s else 0.0,
                     tuple(float(t) for t in np.interp(range(1, max_gamma + 2), widths, timed)))


class OtherLoad:
    """The cores other processes (and other virtual machines, as steal time) kept busy from its
    making to a call of cores(), from /proc/stat: timings taken meanwhile are not this machine's
    own speed. None where /proc/stat cannot be read."""

    def __init__(self):
        self._start = self._ticks()

    @staticmethod
    def _ticks() -> tuple[float, float, float] | None:
        """(wall seconds, busy seconds of the machine's CPUs, CPU seconds of this process)."""
        try:
            with open("/proc/stat", encoding="ascii") as f:
                user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return None
        own = os.times()
        return time.perf_counter(), (user + nice + system + irq + softirq + steal) / tick, own.user + own.system

    def cores(self) -> float | None:
        end = self._ticks()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end))
        # /proc/stat and os.times count whole clock ticks (1/SC_CLK_TCK s per CPU): over a short
        # span their rounding alone can exceed the machine's cores, which no load can.
        return min(max(0.0, busy - own) / wall, float(os.cpu_count() or 1))


def files_identity(path: str | Path) -> list[list]:
    """[name, size, modification time] of a model file, or of every file in a model folder."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(p), (st := p.stat()).st_size, st.st_mtime_ns] for p in files]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity(device: torch.device) -> dict:
    """What the step costs depend on besides the models: the processor, its threads, the kernels."""
    from .. import __version__

    identity = {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "specengine": __version__, "device": str(device)}
    try:
        from .. import _C
    except ImportError:
        pass
    else:  # which vector instructions its ops use, and its build (a rebuild may change their speed)
        identity["cpu_isa"] = _C.cpu_isa()
        identity["ops_library"] = files_identity(_C.__file__)
    if device.type == "cuda":
        identity["gpu"] = torch.cuda.get_device_name(device)
    return identity


class CostStore:
    """Measured CostModels kept in the cache folder (tokenizer.cache_dir(): $SPECENGINE_CACHE, else
    ~/.cache/specengine), one JSON file per key in its costs/ folder, an entry per batch size. The
    key holds what the costs depend on: the model files (path, size, modification time), how they
    were loaded, the machine (machine_identity), the widest verification and how costs are
    measured (FORMAT). A file of another key, a corrupt or unreadable one, or an entry older
    than MAX_AGE_S is ignored (the costs are measured again, and the entry rewritten). Costs
    measured while other processes kept the CPUs busy are used but not kept (see save)."""

    FORMAT = 1  # what measure_costs measures: a change of it makes the stored costs another key's
    # A week: a measurement taken while something else loaded the machine is not kept for ever.
    MAX_AGE_S = 7 * 24 * 3600.0
    # Measurements quicker than this are not kept: measuring again costs as little, and models
    # made and thrown away (tests' tiny checkpoints in temporary folders) leave no files.
    STORE_AFTER_S = 0.1
    # Cores other processes may have kept busy while measuring for the costs to be kept: under
    # load a model's step slows by a large factor and not in proportion to its tokens (the
    # threads of its parallel loops wait on each other), so such costs would misprice every
    # gamma (measured: bench/results/host-overheads-2026-11-29-to-12-03.md).
    MAX_OTHER_LOAD = 0.2

    def __init__(self, key: Mapping, folder: Path | None = None):
        self.key = json.loads(json.dumps(key, sort_keys=True))  # as it reads back from the file
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = (cache_dir() / "costs" if folder is None else Path(folder)) / f"{digest}.json"

    @classmethod
    def for_models(cls, sources: Mapping, max_gamma: int, device: torch.device, fixed_shape_steps: bool,
                   folder: Path | None = None) -> "CostStore | None":
        """The store of an engine's costs (None where the model files cannot be read again).
        sources: what Engine.from_pretrained loaded (the target's and the draft's paths, the
        drafter, the dtypes)."""
        try:
            models = {role: files_identity(sources[role]) for role in ("target", "draft") if sources.get(role)}
        except OSError as e:
            log.info("gamma='auto': the measured costs are not kept (%s)", e)
            return None
        load = {name: str(value) for name, value in sources.items() if name not in models}
        return cls({"format": cls.FORMAT, "models": models, "load": load, "max_gamma": max_gamma,
                    "context": CONTEXT, "fixed_shape_steps": fixed_shape_steps,
                    "machine": machine_identity(device)}, folder)

    def _read(self) -> dict:
        """The file's entries by batch size ({} when it is missing or holds another key)."""
        data = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != self.key:
            return {}
        entries = data["costs"]
        if not isinstance(entries, dict):
            raise ValueError(f"its costs are a {type(entries).__name__}, not a mapping")
        return entries

    def load(self, batch_size: int) -> CostModel | None:
        """The costs stored for this batch size, or None (missing, stale or unreadable)."""
        try:
            entry = self._read().get(str(batch_size))
            if entry is None:
                return None
            age = time.time() - float(entry["measured_at"])
            if not 0.0 <= age <= self.MAX_AGE_S:
                log.info("gamma='auto': the costs in %s were measured %.1f days ago: measuring again",
                         self.path, age / 86400)
                return None
            verify_s = tuple(float(t) for t in entry["verify_s"])
            costs = CostModel(float(entry["draft_step_s"]), verify_s)
            width = self.key["max_gamma"] + 1
            if len(verify_s) != width or not all(map(math.isfinite, (costs.draft_step_s,) + verify_s)):
                raise ValueError(f"batch size {batch_size}'s costs are not {width} finite times")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("gamma='auto': ignoring %s (%s: %s)", self.path, type(e).__name__, e)
            return None
        return costs

    def save(self, batch_size: int, costs: CostModel, seconds: float, other_load: float | None = None):
        """Keep this batch size's costs (measured in `seconds`, while other processes kept
        `other_load` cores busy) beside the others of this key. The file is replaced whole, so a
        reader sees the old one or the new one; a cache folder that cannot be written is skipped."""
        if seconds < self.STORE_AFTER_S:
            return
        if other_load is not None and other_load > self.MAX_OTHER_LOAD:
            log.info("gamma='auto': other processes kept %.1f cores busy while measuring: the costs are not kept",
                     other_load)
            return
        try:
            entries = self._read()
        except (OSError, ValueError, KeyError, TypeError):
            entries = {}  # missing or unreadable: this entry starts it afresh
        entries[str(batch_size)] = {"draft_step_s": costs.draft_step_s, "verify_s": list(costs.verify_s),
                                    "measured_at": time.time(), "measure_s": seconds, "other_load": other_load}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, work = tempfile.mkstemp(prefix=f".{self.path.stem}-", suffix=".json", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"key": self.key, "costs": entries}, f, indent=1, sort_keys=True)
                os.replace(work, self.path)
            except BaseException:
                Path(work).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.info("gamma='auto': cannot keep the measured costs in %s (%s)", self.path, e)
