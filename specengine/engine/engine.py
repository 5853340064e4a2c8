"""The speculative decoding loop (Leviathan et al. Algorithm 1) over a batch of requests.

Requests are added at any time (add_request) and join the running batch at a round boundary.
step() is three calls: the scheduler plans the step (admissions into rows with what the prefix
cache holds of their prompts, a chunk of the prompts being prefilled, the rounds' gamma and how
many rounds before a read), the model runner carries the plan out (the forwards), and what each
row emitted is applied and reported (RequestOutput); abort() ends one at once. generate() and
stream() are loops over them. Each round, for the rows still running:
  1. the drafter proposes up to gamma tokens per row (fewer near a row's limits);
  2. the target scores [last token, drafts] in one forward at each row's cache length;
  3. verify accepts a prefix of the drafts and emits one more token per row;
  4. each cache's length becomes what the sequence holds: that is the whole rollback.
Without a drafter every round is plain target-only decoding through the same code. An
encoder-decoder target (T5) differs only behind the model runner (and in intake).

The parts, one job each: intake (prompts and parameters into requests), scheduler (the plan of
each step, the queue, aborts), runner (the forwards: prefill, staging, prefix-cache copies, the
rounds of engine.rounds), outputs (stop conditions, statistics, text).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from ..drafters.base import Drafter
from ..models.loader import Model
from ..sampling.batch import InvalidLogitsError
from ..sampling.params import SamplingParams
from .config import EngineConfig
from .costs import CostStore, OtherLoad, measure_costs, timed_widths
from .gamma import CostModel, CostTable, GammaController
from .intake import Intake, Prompt
from .outputs import Outputs
from .phases import Phases
from .prefill_budget import PrefillBudget
from .request import DecodeStats, Request, RequestOutput, Result
from .runner import ModelRunner
from .scheduler import Scheduler, StepOutcome, StepPlan

log = logging.getLogger("specengine")

__all__ = ["Engine", "EngineConfig", "Prompt"]


class Engine:
    """Generates with a target model, optionally speculating with a drafter; lossless either way."""

    def __init__(self, target: Model, tokenizer=None, drafter: Drafter | None = None,
                 config: EngineConfig | None = None, *, costs: CostModel | dict[int, CostModel] | None = None,
                 sources: Mapping[str, object] | None = None, **options):
        """config: an EngineConfig, or its fields as keyword options (Engine(target, gamma=3)).
        costs: with gamma="auto", the step costs to choose gamma from (by batch size); measured on
        this machine, on the path the rounds take, when first needed otherwise.
        sources: what the models were loaded from (Engine.from_pretrained gives it: the target's
        and the draft's paths, the drafter, the dtypes); with it, measured costs are kept in the
        cache folder and reused by the next engine of the same models on this machine (CostStore)."""
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise TypeError(f"pass options in the config or as keywords, not both (got {sorted(options)})")
        self.config, self.target, self.tokenizer, self.drafter = config, target, tokenizer, drafter
        self.auto_gamma = drafter is not None and config.gamma == "auto"
        # The most drafts a round may propose.
        self.gamma = 0 if drafter is None else config.max_gamma if self.auto_gamma else config.gamma
        context = target.config.max_position_embeddings
        self.max_seq_len = min(context, config.max_seq_len) if config.max_seq_len else context
        eos_token_ids = config.eos_token_ids
        if eos_token_ids is None:
            eos_token_ids = target.config.eos_token_ids
            if not eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids = (tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset(eos_token_ids)
        # A debug mode for a split target: compare every round's tokens across the ranks.
        self._check_ranks = target.tp is not None and os.environ.get("SPECENGINE_CHECK_RANKS") == "1"
        self.phases = Phases(config.nvtx, config.time_phases)
        self.max_batch_size = config.max_batch_size

        if config.cuda_graphs and target.device.type != "cuda":
            log.info("cuda_graphs: %s is not a CUDA device; the fixed-shape steps run eagerly", target.device)
        self.runner = ModelRunner(target, drafter, max_seq_len=self.max_seq_len, cuda_graphs=config.cuda_graphs,
                                  max_batch_size=config.max_batch_size, verify_impl=config.verify_impl,
                                  rounds_per_read=config.rounds_per_read,
                                  prefix_cache_bytes=config.prefix_cache_bytes, phases=self.phases)
        self.target_steps, self.prefix_cache = self.runner.target_steps, self.runner.prefix_cache
        self.intake = Intake(target, tokenizer, self.max_seq_len, self.gamma)
        self.scheduler = Scheduler(self.runner.batch, config.max_batch_size,
                                   PrefillBudget(config.prefill_chunk_tokens, target.tp, self.runner.chunk_layers),
                                   self.prefix_cache, self.runner.staged_row, self.runner.chunk_layers,
                                   drafter is not None and bool(drafter.feature_layers),
                                   self.max_seq_len, config.rounds_per_read, self.gamma,
                                   lambda: self.gamma_controller, target.tp)
        self.runner.rows_broken = self.scheduler.rows_broken
        self.outputs = Outputs(tokenizer, self.eos_token_ids, self.max_seq_len)
        self._costs = costs
        # Ranks of a split target time their calls together (collectives): a store read by one
        # rank and missed by another would leave the other waiting, so they always measure.
        self._cost_store = (CostStore.for_models(sources, config.max_gamma, target.device, config.cuda_graphs)
                            if self.auto_gamma and costs is None and sources is not None and target.tp is None
                            else None)
        self._gamma_controller: GammaController | None = None
        if self.auto_gamma and costs is not None:
            self._gamma_controller = self._make_gamma_controller()  # given costs: checked now

        self.last_run_phases: dict[str, float] | None = None
        self.last_run_stats: DecodeStats | None = None
        self.last_run_rounds = 0  # rounds of the whole batch (loop iterations) in the last run
        self._run_start, self._run_rounds = 0.0, 0  # see _start_run

    @classmethod
    def from_pretrained(cls, target: str | Path, draft: str | Path | None = None, drafter: str = "model",
                        device: str = "cpu", dtype: str | torch.dtype | None = None,
                        weight_dtype: str | torch.dtype | None = None, tensor_parallel: int = 1,
                        suffix_max_global_tokens: int | None = None, **options) -> "Engine":
        """Load a target (and a draft) from local Hugging Face folders or GGUF files; options are
        EngineConfig's fields (gamma, cuda_graphs, max_batch_size, ...).

        A draft folder without tokenizer files shares the target's tokenizer (its vocab_size must be
        the target's). A draft with a tokenizer of its own drafts the tokens both vocabularies share
        (drafters.cross_vocab); a pair sharing too little is refused.

        dtype is the compute dtype; weight_dtype the matrices' storage (see models.load_model:
        by default a bfloat16 checkpoint on CPU keeps bfloat16 matrices and computes in float32).

        drafter "model" uses the draft folder (none given: target-only decoding); "ngram"
        drafts by prompt lookup and "suffix" by suffix decoding, without a draft folder.
        suffix_max_global_tokens: the suffix drafter's global tree budget (None: its default).

        tensor_parallel=N splits the target over the N ranks of a torch.distributed group (an
        initialised one, or one set up from torchrun's environment: NCCL on CUDA, each rank on the
        GPU of its LOCAL_RANK; gloo on CPU); each rank reads only its part of the checkpoint. The
        draft is replicated. Every rank runs the same loop and emits the same tokens
        (SPECENGINE_CHECK_RANKS=1 checks it every round).
        """
        from .build import load_models

        config = EngineConfig(**options)  # checked before anything loads
        target_model, tokenizer, chosen = load_models(target, draft, drafter, device, dtype, weight_dtype,
                                                      tensor_parallel, suffix_max_global_tokens)
        sources = dict(target=target, draft=draft, drafter=drafter, dtype=dtype, weight_dtype=weight_dtype)
        return cls(target_model, tokenizer, chosen, config, sources=sources)

    @property
    def gamma_controller(self) -> GammaController | None:
        """With gamma="auto", what chooses each round's gamma (its costs measured when first needed)."""
        if self.auto_gamma and self._gamma_controller is None:
            self._gamma_controller = self._make_gamma_controller()
        return self._gamma_controller

    def _make_gamma_controller(self) -> GammaController:
        max_gamma = self.config.max_gamma
        costs = self._costs
        if costs is None:
            # Verification costs grow with the batch on a CPU: a single row's and a batch of 8's
            # (or fewer), each measured when a batch first needs it.
            costs = CostTable(max_gamma, sorted({1, min(8, self.max_batch_size or 8)}), self._measure_costs)
            if self.target_steps is not None:
                # Fixed-shape steps are timed on the persistent caches the requests use: every size
                # now, before any request holds a row (and every width: this also captures their graphs).
                if self.runner.batch.rows_held:
                    raise RuntimeError("costs are measured before the first request runs")
                costs.cover(max(costs.batch_sizes))
                for steps in (self.target_steps, self.drafter.steps):
                    if steps is not None:
                        steps.new_batch(0)  # timing filled their rows: empty them for the requests
        controller = GammaController(costs)
        if controller.max_gamma != max_gamma:
            raise ValueError(f"costs cover gamma up to {controller.max_gamma}, not max_gamma={max_gamma}")
        return controller

    def _measure_costs(self, batch_size: int) -> CostModel:
        """The step costs at this batch size: kept from an earlier process, else measured on the
        path the rounds take (replayed graphs with cuda_graphs)."""
        store = self._cost_store
        stored = store.load(batch_size) if store is not None else None
        if stored is not None:
            log.info("gamma='auto': step costs at batch size %d from %s", batch_size, store.path)
            return stored
        start, load = time.perf_counter(), OtherLoad()
        # On the eager path a few widths are timed and the rest interpolated (timed_widths);
        # fixed-shape steps time every width, which also captures each one's graph ahead of the rounds.
        widths = None if self.target_steps is not None else timed_widths(self.config.max_gamma)
        with torch.inference_mode():
            costs = measure_costs(self.target, self.drafter.model, self.config.max_gamma, batch_size=batch_size,
                                  target_steps=self.target_steps, draft_steps=self.drafter.steps, widths=widths)
        seconds = time.perf_counter() - start
        log.info("gamma='auto': measured draft and verify costs at batch size %d in %.2f s", batch_size, seconds)
        if store is not None:
            store.save(batch_size, costs, seconds, load.cores())
        return costs

    # ---- serving: requests that join and leave a running batch ------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; it joins the running batch at the next step() with a free row
        (max_batch_size rows at most; requests beyond wait in arrival order). Returns its id."""
        (request,) = self.intake.requests([prompt], params, [request_id], self.scheduler.unfinished)
        self.scheduler.add([request])
        return request.request_id

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests to free rows, prefill a chunk of the prompts being prefilled (a request
        whose prefill is done joins the running ones), run the rounds of every running request up
        to the next read (one, or up to rounds_per_read), and report each: the tokens it gained, the
        text they complete, whether it finished. Also reports requests that ended outside a step
        (aborted). A step that only prefilled reports nothing of the requests being prefilled."""
        return self._step(report=True)

    @torch.inference_mode()
    def _step(self, report: bool) -> list[RequestOutput]:
        """step(); report=False builds no outputs (generate() reads whole results at the end, and
        an output decodes its request's text)."""
        scheduler, runner = self.scheduler, self.runner
        outputs = [self.outputs.output(r) for r in scheduler.take_ended()]
        self._cover_costs()
        plan = scheduler.schedule()
        try:
            outcome = runner.run(plan)
        except BaseException as exc:
            # A failed prefill ends the requests being prefilled; a failed round, every row's (their
            # rows are in no known state). The others keep being served.
            runner.release(scheduler.fail(plan, runner.part, exc))
            raise
        failure = self._apply(plan, outcome)
        if not plan.decoding:
            return outputs
        if failure is not None:
            # Only the broken rows ended; what the others gained is reported with the next step.
            runner.release(scheduler.release(report=True))
            raise failure
        if report:
            outputs += [self.outputs.output(r) for r in plan.decoding]
        runner.release(scheduler.release())
        return outputs

    def _cover_costs(self):
        """With gamma="auto", the step costs the next plan prices (batches up to the rows it will
        hold) that are not measured yet are measured now, before it is made and outside a round,
        whose timing would teach the controller a measurement as its overhead."""
        rows = self.scheduler.rows_to_hold()
        if rows is not None and self.gamma_controller is not None:
            self.gamma_controller.costs_by_batch.cover(rows)

    def _apply(self, plan: StepPlan, outcome: StepOutcome) -> InvalidLogitsError | None:
        """What each row emitted, applied to its request; what the step took, to the scheduler. A
        row whose logits broke (NaN, +inf) ends alone, keeping nothing of them: the error is
        returned, to raise once the others' tokens are kept (rows are independent)."""
        start = time.perf_counter()
        if self._check_ranks and outcome.results:
            tokens = [t for result in outcome.results for t in [len(result.tokens), *result.tokens]]
            self.target.tp.check_same(torch.tensor(tokens, device=self.target.tp.device),
                                      f"tokens emitted in round {self.runner.rounds.rounds_run}")
        failure, finished = None, []
        for r, result in zip(plan.decoding, outcome.results):
            if result.failure is not None:
                failure = failure or InvalidLogitsError(result.failure)
                self.scheduler.end(r, f"aborted: its round failed ({result.failure})")
                continue
            r.acceptance.update(result.accepted, result.rejections)
            self.outputs.apply(r, result)
            if r.finish_reason is not None:
                finished.append(r)
        round_s = ((outcome.rounds_s + time.perf_counter() - start) / outcome.rounds if outcome.rounds else None)
        self.scheduler.observe(plan, outcome, round_s, finished)
        return failure

    @torch.inference_mode()
    def abort(self, request_id: str) -> bool:
        """End a request now and free its row; the next step() reports it (finish_reason "abort").
        False when no unfinished request has this id."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        release = self.scheduler.abort(request_id)
        if release is None:
            return False
        self.runner.release(release)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.unfinished)

    def has_pending_outputs(self) -> bool:
        """Whether the next step() reports requests that ended outside a step (by abort(), a failed
        prefill or a failed round)."""
        return bool(self.scheduler.ended)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.unfinished)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free row."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a row of the running batch: decoding, or being prefilled."""
        return self.runner.batch.rows_held

    @property
    def num_prefilling(self) -> int:
        """Requests holding a row whose prompt is still being prefilled (a chunk a step)."""
        return len(self.runner.batch.prefilling)

    @property
    def cache_rows_in_use(self) -> int:
        """Rows of the target's KV cache that hold a request (decoding or being prefilled)."""
        cache = self.runner.batch.cache
        return cache.rows_held if cache is not None else 0

    # ---- offline: whole requests ----------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Result]:
        """Generate for each prompt (a string, or a list of token ids). One Result per prompt."""
        requests = self._start_run(prompts, params, "generate()")
        try:
            while self.scheduler.unfinished:
                self._step(report=False)
        finally:
            self._end_run(requests)
        return [self.outputs.result(r) for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as tokens are accepted."""
        if self.tokenizer is None:
            raise ValueError("stream() needs a tokenizer")
        (request,) = self._start_run([prompt], params, "stream()")
        try:
            while request.finish_reason is None:
                for output in self.step():
                    if output.new_text:
                        yield output.new_text
        finally:  # also when the consumer stops early: the request must not hold its row
            self._end_run([request])

    def _start_run(self, prompts, params, name: str) -> list[Request]:
        if self.scheduler.unfinished:
            raise RuntimeError(f"{name} would also run the {len(self.scheduler.unfinished)} requests in flight "
                               "from add_request(): drive those with step()")
        requests = self.intake.requests(prompts, params, None, self.scheduler.unfinished)
        self.phases.reset()
        self._run_start, self._run_rounds = time.perf_counter(), self.runner.rounds.rounds_run
        self.scheduler.add(requests)
        return requests

    def _end_run(self, requests: list[Request]):
        for r in requests:
            self.abort(r.request_id)  # only those an error or an early stop left unfinished
        self.scheduler.take_ended()
        wall = time.perf_counter() - self._run_start
        self.last_run_rounds = self.runner.rounds.rounds_run - self._run_rounds
        self.last_run_stats = DecodeStats.combine([r.stats for r in requests], wall)
        if self.phases.timed:
            self.last_run_phases = dict(self.phases.seconds, host=wall - sum(self.phases.seconds.values()), total=wall)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of chat messages ({"role", "content"} dicts) through the tokenizer's chat
        template, ending where the assistant's answer starts. Ids, not text: a template's text
        tokenized again could gain a second BOS."""
        return self.intake.chat_prompt(messages)
