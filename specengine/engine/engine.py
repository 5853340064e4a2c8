"""The speculative decoding loop (Leviathan et al. Algorithm 1) over a batch of requests.

Requests are added at any time (add_request) and join the running batch at a round boundary;
step() runs one round for every running request and reports what each gained (RequestOutput);
abort() ends one at once. generate() and stream() are loops over them. Each round, for the
rows still running:
  1. the drafter proposes up to gamma tokens per row (fewer near a row's limits);
  2. the target scores [last token, drafts] in one forward at each row's cache length;
  3. verify accepts a prefix of the drafts and emits one more token per row;
  4. each cache's length becomes what the sequence holds: that is the whole rollback.
Without a drafter every round is plain target-only decoding through the same code. With an
encoder-decoder target (T5) the prompt is the encoder's input: each model encodes it once, when
its row joins, and the sequence the rounds extend starts at the decoder's start token.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..drafters.base import Drafter, Proposal
from ..layers.parallel import init_tensor_parallel
from ..models.loader import Model
from ..ops.verify import IMPLEMENTATIONS, verify
from ..sampling.batch import SamplingBatch, check_logits, logits_valid
from ..sampling.params import SamplingParams
from .batch import RunningBatch
from .device_rounds import RowRounds, rounds_that_fit, run_block
from .gamma import CostModel, GammaController, measure_costs
from .graphs import StepGraphs
from .phases import Phases
from .request import DecodeStats, Request, RequestOutput, Result
from .runner import to_device
from .text import settled_length, utf8_text

log = logging.getLogger("specengine")

Prompt = str | bytes | Sequence[int]


class Engine:
    """Generates with a target model, optionally speculating with a drafter; lossless either way."""

    def __init__(self, target: Model, tokenizer=None, drafter: Drafter | None = None,
                 gamma: int | str = 5, max_seq_len: int | None = None, eos_token_ids: Sequence[int] | None = None,
                 verify_impl: str = "auto", max_gamma: int = 8,
                 costs: CostModel | dict[int, CostModel] | None = None, nvtx: bool = False,
                 time_phases: bool = False, cuda_graphs: bool = False, max_batch_size: int | None = None,
                 check_every: int = 1):
        """gamma: draft tokens per round, or "auto" to choose it every round (up to max_gamma, one
        value for the batch) from costs measured now (or given as `costs`) and each request's
        running acceptance rate.
        verify_impl: "auto" (C++ on CPU, Triton on CUDA), "cpp", "triton" or "reference" (plain torch).
        nvtx: mark the prefill, draft, verify (target forward) and accept phases for Nsight Systems.
        time_phases: time those phases; each run's totals land in last_run_phases (with "host",
        the rest of the loop: bookkeeping, stop checks, reading results back), over
        last_run_rounds rounds of the batch.
        cuda_graphs: run the target's verifications and the draft model's steps as fixed-shape
        steps on persistent caches of max_batch_size rows (see engine.graphs), replayed from CUDA
        graphs on a GPU; on a CPU the same path runs eagerly.
        max_batch_size: the most requests decoding at once (default 8 with cuda_graphs, otherwise
        no limit: the cache grows as requests join); the others wait in arrival order.
        check_every: with cuda_graphs, run up to this many rounds from device state before reading
        the results back (engine.device_rounds): one synchronisation per block instead of per
        round; output is streamed a block at a time, tokens are the same as round by round, and
        stop conditions stay exact (rows are trimmed when the block is read)."""
        if verify_impl not in IMPLEMENTATIONS:
            raise ValueError(f"verify_impl must be one of {IMPLEMENTATIONS}, got {verify_impl!r}")
        self.gamma_controller: GammaController | None = None
        auto_gamma = False
        if drafter is not None and gamma == "auto":
            if not isinstance(max_gamma, int) or not 1 <= max_gamma <= 64:
                raise ValueError(f"max_gamma must be an integer in [1, 64], got {max_gamma!r}")
            auto_gamma = True
            gamma = max_gamma
        elif drafter is not None and (not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= 64):
            raise ValueError(f"gamma must be an integer in [1, 64] or 'auto' when drafting, got {gamma!r}")
        draft_model = getattr(drafter, "model", None)
        if draft_model is not None and draft_model.is_encoder_decoder != target.is_encoder_decoder:
            kinds = {True: "an encoder-decoder model", False: "a decoder-only model"}
            raise ValueError(f"the target is {kinds[target.is_encoder_decoder]} but the draft is "
                             f"{kinds[draft_model.is_encoder_decoder]}: a draft must read the prompt as its target "
                             "does (pair T5 with T5, or use the ngram drafter)")
        if target.is_encoder_decoder and cuda_graphs:
            raise ValueError("cuda_graphs runs decoder-only targets; an encoder-decoder target decodes eagerly "
                             "(drop cuda_graphs)")
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.gamma = gamma if drafter is not None else 0  # the most drafts a round may propose
        context = target.config.max_position_embeddings
        if max_seq_len is not None and not 2 <= max_seq_len:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.max_seq_len = min(context, max_seq_len) if max_seq_len else context
        if eos_token_ids is None:
            eos_token_ids = target.config.eos_token_ids
            if not eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids = (tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.verify_impl = verify_impl
        # A debug mode for a split target: compare every round's tokens across the ranks.
        self._check_ranks = target.tp is not None and os.environ.get("SPECENGINE_CHECK_RANKS") == "1"
        self.phases = Phases(nvtx, time_phases)
        self.last_run_phases: dict[str, float] | None = None
        self.last_run_stats: DecodeStats | None = None
        self.last_run_rounds = 0  # rounds of the whole batch (loop iterations) in the last run
        self.target_steps: StepGraphs | None = None
        self._empty_proposals: dict[tuple[int, str], Proposal] = {}  # see _no_drafts
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"check_every must be a positive integer, got {check_every!r}")
        if check_every > 1 and not cuda_graphs:
            raise ValueError("check_every > 1 runs rounds from device state on the fixed-shape steps: "
                             "it needs cuda_graphs=True")
        self.check_every = check_every
        if max_batch_size is None and cuda_graphs:
            max_batch_size = 8
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool)
                                           or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        if cuda_graphs:
            if target.device.type != "cuda":
                log.info("cuda_graphs: %s is not a CUDA device; the fixed-shape steps run eagerly", target.device)
            self.target_steps = StepGraphs(target, max_batch_size, self.max_seq_len)
            if hasattr(drafter, "use_static_steps"):
                drafter.use_static_steps(max_batch_size, self.max_seq_len)
        if auto_gamma:
            # Measured on the path the rounds take (replayed graphs with cuda_graphs). Verification
            # costs grow with the batch on a CPU: measure a single row and a batch of 8 (or fewer).
            draft_model, draft_steps = getattr(drafter, "model", None), getattr(drafter, "steps", None)
            batches = sorted({1, min(8, max_batch_size or 8)})
            costs = costs or {b: measure_costs(target, draft_model, max_gamma, batch_size=b,
                                               target_steps=self.target_steps, draft_steps=draft_steps)
                              for b in batches}
            self.gamma_controller = GammaController(costs)
            if self.gamma_controller.max_gamma != max_gamma:
                raise ValueError(f"costs cover gamma up to {self.gamma_controller.max_gamma}, "
                                 f"not max_gamma={max_gamma}")
        # Serving state: requests by id until they finish, those waiting for a row, the running
        # batch, and the outputs of aborted requests that the next step() reports.
        self._unfinished: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._batch = RunningBatch(target, drafter, self.target_steps, self.max_seq_len)
        self._aborted: list[RequestOutput] = []
        self.rounds = 0  # rounds of the running batch so far
        self._previous_gamma = 0  # the last round's drafts (before the first: none, and the draft model unfed)
        self._run_start, self._run_rounds = 0.0, 0  # see _start_run

    @classmethod
    def from_pretrained(cls, target: str | Path, draft: str | Path | None = None, drafter: str = "model",
                        gamma: int | str = 5, device: str = "cpu", dtype: str | torch.dtype | None = None,
                        max_seq_len: int | None = None, verify_impl: str = "auto", max_gamma: int = 8,
                        nvtx: bool = False, weight_dtype: str | torch.dtype | None = None,
                        time_phases: bool = False, cuda_graphs: bool = False, max_batch_size: int | None = None,
                        check_every: int = 1, tensor_parallel: int = 1) -> "Engine":
        """Load a target (and a draft) from local Hugging Face folders or GGUF files.

        A draft folder without tokenizer files shares the target's tokenizer (its vocab_size must be
        the target's); otherwise both tokenizers must be one vocabulary.

        dtype is the compute dtype; weight_dtype the matrices' storage (see models.load_model:
        by default a bfloat16 checkpoint on CPU keeps bfloat16 matrices and computes in float32).

        drafter "model" uses the draft folder (none given: target-only decoding); "ngram"
        drafts by prompt lookup and takes no draft folder.

        tensor_parallel=N splits the target over the N ranks of a torch.distributed group (an
        initialised one, or one set up from torchrun's environment: NCCL on CUDA, each rank on the
        GPU of its LOCAL_RANK; gloo on CPU); each rank reads only its part of the checkpoint. The
        draft is replicated. Every rank runs the same loop and emits the same tokens
        (SPECENGINE_CHECK_RANKS=1 checks it every round).
        """
        from ..drafters.model import ModelDrafter
        from ..drafters.ngram import NgramDrafter
        from ..models.loader import load_model
        from ..tokenizer import TokenizerMismatchError, check_same_vocabulary, has_tokenizer, load_tokenizer

        if drafter not in ("model", "ngram"):
            raise ValueError(f"drafter must be 'model' or 'ngram', got {drafter!r}")
        if drafter == "ngram" and draft is not None:
            raise ValueError("the ngram drafter takes no draft model; drop `draft` or use drafter='model'")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
        tp = None
        if tensor_parallel > 1:
            tp, device = init_tensor_parallel(tensor_parallel, device)
        target_model = load_model(target, device, dtype, weight_dtype, tp)
        tokenizer = load_tokenizer(target)
        chosen: Drafter | None = None
        if drafter == "ngram":
            chosen = NgramDrafter()
        elif draft is not None:
            draft_model = load_model(draft, device, dtype, weight_dtype)
            if has_tokenizer(draft):
                check_same_vocabulary(tokenizer, load_tokenizer(draft), target, draft)
            elif draft_model.config.vocab_size != target_model.config.vocab_size:
                # A draft folder without tokenizer files is made for a target's tokenizer (as the
                # default pair's draft is): its logits must be as wide as the target's.
                raise TokenizerMismatchError(
                    f"{draft} has no tokenizer files, so it must share {target}'s tokenizer, but its vocab_size "
                    f"{draft_model.config.vocab_size} is not the target's {target_model.config.vocab_size}")
            chosen = ModelDrafter(draft_model, target_model.config.vocab_size, len(tokenizer))
        return cls(target_model, tokenizer, chosen, gamma, max_seq_len, verify_impl=verify_impl, max_gamma=max_gamma,
                   nvtx=nvtx, time_phases=time_phases, cuda_graphs=cuda_graphs, max_batch_size=max_batch_size,
                   check_every=check_every)

    # ---- serving: requests that join and leave a running batch ------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; it joins the running batch at the next step() with a free row
        (max_batch_size rows at most; requests beyond wait in arrival order). Returns its id."""
        (request,) = self._make_requests([prompt], params, [request_id])
        self._enqueue([request])
        return request.request_id

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefilled now), run one round for every running request (a block
        of rounds with check_every > 1), and report each: the tokens it gained, the text they
        complete, whether it finished. Also reports requests aborted since the last step."""
        return self._step(report=True)

    @torch.inference_mode()
    def _step(self, report: bool) -> list[RequestOutput]:
        """step(); report=False builds no outputs (generate() reads whole results at the end, and
        an output decodes its request's text)."""
        outputs, self._aborted = self._aborted, []
        joined = self._admit()
        if not self._batch.requests:
            return outputs
        try:
            self._decode_round(joined)
        except BaseException as exc:
            # The round's rows are in no known state: end them all, and keep serving the rest.
            self._end_running(f"aborted: the round failed ({type(exc).__name__}: {exc})")
            raise
        if report:
            outputs += [self._output(r) for r in self._batch.requests]
        keep = [i for i, r in enumerate(self._batch.requests) if r.finish_reason is None]
        for r in self._batch.requests:
            if r.finish_reason is not None:
                del self._unfinished[r.request_id]
        if len(keep) < len(self._batch):
            self._batch.keep(keep)
        return outputs

    def abort(self, request_id: str) -> bool:
        """End a request now and free its row; the next step() reports it (finish_reason "abort").
        False when no unfinished request has this id."""
        request = self._unfinished.get(request_id)
        if request is None:
            return False
        if request in self._waiting:
            self._waiting.remove(request)
        else:
            self._batch.keep([i for i, r in enumerate(self._batch.requests) if r is not request])
        self._end(request, "aborted")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def has_pending_outputs(self) -> bool:
        """Whether the next step() reports aborted requests (by abort(), or by a round that failed)."""
        return bool(self._aborted)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free row."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a row of the running batch."""
        return len(self._batch)

    @property
    def cache_rows_in_use(self) -> int:
        """Rows of the target's KV cache that hold a request (the running ones, once a step ends)."""
        return self._batch.cache.batch_size if self._batch.cache is not None else 0

    # ---- offline: whole requests ----------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Result]:
        """Generate for each prompt (a string, or a list of token ids). One Result per prompt."""
        requests = self._start_run(prompts, params, "generate()")
        try:
            while self._unfinished:
                self._step(report=False)
        finally:
            self._end_run(requests)
        return [self._result(r) for r in requests]

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
        if self._unfinished:
            raise RuntimeError(f"{name} would also run the {len(self._unfinished)} requests in flight from "
                               "add_request(): drive those with step()")
        requests = self._make_requests(prompts, params)
        self.phases.reset()
        self._run_start, self._run_rounds = time.perf_counter(), self.rounds
        self._enqueue(requests)
        return requests

    def _end_run(self, requests: list[Request]):
        for r in requests:
            self.abort(r.request_id)  # only those an error or an early stop left unfinished
        self._aborted = []
        wall = time.perf_counter() - self._run_start
        self.last_run_rounds = self.rounds - self._run_rounds
        self.last_run_stats = DecodeStats.combine([r.stats for r in requests], wall)
        if self.phases.timed:
            self.last_run_phases = dict(self.phases.seconds, host=wall - sum(self.phases.seconds.values()), total=wall)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of chat messages ({"role", "content"} dicts) through the tokenizer's chat
        template, ending where the assistant's answer starts. Ids, not text: a template's text
        tokenized again could gain a second BOS."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template; this model's has none")
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                                   for m in messages):
            raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': str} dicts")
        for m in messages:
            utf8_text(m["content"])
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids)

    # ---- requests ---------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (str, bytes, bytearray)):
            prompt = utf8_text(prompt)
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            vocab = self.target.config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        if self.target.is_encoder_decoder:
            limit = self.target.config.max_source_positions
            if len(ids) > limit:
                raise ValueError(f"prompt has {len(ids)} tokens but the encoder takes at most {limit} "
                                 "(the config's n_positions)")
        elif len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len}: "
                             "no room to generate")
        return ids

    def _make_requests(self, prompts, params, request_ids: Sequence[str | None] | None = None) -> list[Request]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be SamplingParams")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        for i, request_id in enumerate(ids):
            if request_id is None:
                ids[i] = uuid.uuid4().hex
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
            elif request_id in self._unfinished or request_id in ids[:i]:
                raise ValueError(f"request_id {request_id!r} is already in flight")
        # Validate every prompt before queueing any: bad input leaves nothing half-done.
        encoded = [self._encode(p) for p in prompts]
        seeds = [p.seed if p.seed is not None else self._random_seed() for p in params]
        # An encoder-decoder target encodes the prompt; its decoder starts from its start token.
        start = [self.target.config.decoder_start_token_id] if self.target.is_encoder_decoder else None
        return [Request(request_id, tokens, p, seed, DecodeStats(gamma=self.gamma, prompt_tokens=len(tokens)),
                        decoder_start=start)
                for request_id, tokens, p, seed in zip(ids, encoded, params, seeds)]

    def _random_seed(self) -> int:
        """A seed for a request without one; with a split target, rank 0's (every rank samples alike)."""
        seed = secrets.randbits(63)
        return seed if self.target.tp is None else self.target.tp.broadcast_int(seed)

    def _enqueue(self, requests: list[Request]):
        now = time.perf_counter()
        for r in requests:
            r.added_at = now
            self._unfinished[r.request_id] = r
            self._waiting.append(r)

    def _admit(self) -> bool:
        """Move waiting requests into free rows, first come first served; whether any joined."""
        free = len(self._waiting) if self.max_batch_size is None else self.max_batch_size - len(self._batch)
        joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        if not joining:
            return False
        if self.gamma_controller is not None:
            for r in joining:
                r.acceptance = self.gamma_controller.new_estimate(len(self._batch) + len(joining),
                                                                  greedy=r.params.temperature == 0)
        running = len(self._batch)
        try:
            with self.phases("prefill"):
                # gamma="auto" feeds the draft model when it first drafts: a request whose draft
                # does not pay may never draft, and then never pays for the draft's prefill.
                self._batch.admit(joining, prefill_draft=self.gamma_controller is None)
        except BaseException as exc:
            # Nothing half-done: the rows already running stay as they were, the joiners end.
            self._batch.keep(list(range(running)))
            for r in joining:
                self._end(r, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
            raise
        return True

    def _end_running(self, message: str):
        for r in self._batch.requests:
            self._end(r, message)
        self._batch.keep([])

    def _end(self, r: Request, message: str):
        """Abort a request that holds no row (any more)."""
        r.finish_reason, r.message = "abort", message
        r.stats.wall_time_s = time.perf_counter() - r.added_at
        del self._unfinished[r.request_id]
        self._aborted.append(self._output(r))

    def _text(self, request: Request) -> str | None:
        if request.stop_text is not None:
            return request.stop_text
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(request.generated, skip_special_tokens=True)

    def _output(self, r: Request) -> RequestOutput:
        """The tokens and text r gained since its last output."""
        new_tokens = r.generated[r.sent_tokens:]
        r.sent_tokens = len(r.generated)
        new_text = None
        if self.tokenizer is not None:
            text = self._text(r)
            end = len(text) if r.finish_reason is not None else settled_length(text, r.params.stop)
            new_text = text[r.sent_chars:end] if end > r.sent_chars else ""
            r.sent_chars = max(r.sent_chars, end)
        return RequestOutput(r.request_id, new_tokens, new_text, r.finish_reason is not None, r.finish_reason,
                             r.stats, r.message)

    def _result(self, r: Request) -> Result:
        return Result(r.prompt_token_ids, list(r.generated), self._text(r), r.finish_reason, r.stats, r.message)

    # ---- the loop ---------------------------------------------------------------------------

    def _decode_round(self, joined: bool):
        """One round (or a block of rounds) for every running request; appends what they emitted."""
        round_start = time.perf_counter()
        batch, device = self._batch, self.target.device
        active = batch.requests
        sequences = [r.tokens for r in active]
        gamma = self._round_gamma(active)
        block = self._block_rounds(active, sequences, gamma)
        # A round writes each row's last token and its drafts (a block: up to gamma + 1 per round).
        batch.make_room(max(len(s) for s in sequences) + block * (gamma + 1))
        if block > 1:
            outcomes = run_block(self.target_steps, self.drafter, batch.sampling, sequences, gamma, block,
                                 self.check_every, self.verify_impl, self.phases)
        else:
            outcomes, gamma = self._round(batch.cache, active, sequences, gamma, batch.sampling, device)
        self.rounds += outcomes[0].rounds
        if self._check_ranks:
            tokens = [t for o in outcomes for t in [len(o.tokens), *o.tokens]]
            self.target.tp.check_same(torch.tensor(tokens, device=self.target.tp.device),
                                      f"tokens emitted in round {self.rounds}")
        for r, outcome in zip(active, outcomes):
            self._account(r, outcome)
            r.acceptance.update(outcome.accepted, outcome.rejections)
            self._append(r, outcome.tokens)
            if r.finish_reason is not None:
                r.stats.wall_time_s = time.perf_counter() - r.added_at
                if self.gamma_controller is not None:
                    self.gamma_controller.observe_finished(r.acceptance, r.stats.accepted, r.stats.rejections)
        if self.gamma_controller is not None:
            # A drafting round after rounds without drafts, or with rows that just joined, also
            # fed the draft model what it lacked.
            self.gamma_controller.observe_round(len(active), gamma,
                                                (time.perf_counter() - round_start) / outcomes[0].rounds,
                                                after_gap=self._previous_gamma == 0 or joined)
        self._previous_gamma = gamma

    def _round_gamma(self, active: list[Request]) -> int:
        if self.gamma_controller is None:
            return self.gamma
        gamma = self.gamma_controller.choose([r.acceptance for r in active])
        # Chosen from timings, which differ between ranks: every rank takes rank 0's choice.
        return gamma if self.target.tp is None else self.target.tp.broadcast_int(gamma)

    def _round(self, cache, active: list[Request], sequences, gamma: int, sampling: SamplingBatch,
               device) -> tuple[list[RowRounds], int]:
        """One round, read back at its end; also returns the drafts actually made (fewer than gamma
        near the rows' limits)."""
        budgets = [min(gamma, room - 1) for room in self._rooms(active, sequences)]
        with self.phases("draft"):
            proposal = self._propose(sequences, budgets, sampling, device)
        # Verification also advances both caches' lengths: that is the whole rollback.
        emitted, num_emitted, logit_checks = self._verify_round(cache, sequences, proposal, sampling)

        # The round's one read from the device (on CUDA the first .tolist() waits for it).
        emitted_rows = emitted.tolist()
        counts = num_emitted.tolist()
        drafted = proposal.num_drafts.tolist()
        for name, logits, finite in logit_checks:  # before any token of the round is kept
            if not finite:
                check_logits(name, logits)
        G = proposal.tokens.shape[1]
        outcomes = []
        for row, count, n_drafts in zip(emitted_rows, counts, drafted):
            histogram = [0] * (G + 1)
            histogram[count - 1] = 1
            outcomes.append(RowRounds(tokens=row[:count], rounds=1, draft_calls=proposal.draft_calls, drafted=n_drafts,
                                      accepted=count - 1, rejections=int(count - 1 < n_drafts), histogram=histogram))
        return outcomes, G

    def _rooms(self, active: list[Request], sequences) -> list[int]:
        """Tokens each row may still emit: within its max_new_tokens and the context."""
        return [min(r.params.max_new_tokens - len(r.generated), self.max_seq_len - len(s))
                for r, s in zip(active, sequences)]

    def _block_rounds(self, active: list[Request], sequences, gamma: int) -> int:
        """Rounds to run from device state before reading back (1: a host round)."""
        if self.check_every == 1 or min(len(s) for s in sequences) < 2:
            return 1
        if gamma > 0 and not (hasattr(self.drafter, "draft_phase_in_round") and self.drafter.caught_up(sequences)):
            return 1  # a host round first: its catch-up feeds the draft model what rounds at gamma 0 skipped
        return max(1, min(self.check_every, rounds_that_fit(self._rooms(active, sequences), gamma)))

    def _propose(self, sequences, budgets, sampling, device) -> Proposal:
        if self.drafter is None or max(budgets) == 0:
            return self._no_drafts(len(sequences), device)
        return self.drafter.propose(sequences, budgets, sampling)

    def _no_drafts(self, rows: int, device) -> Proposal:
        """The proposal of a round without drafts, built once per batch size (nothing writes to
        it): making its two tensors every round cost ~30 us of a ~6 ms target-only round."""
        key = (rows, str(device))
        if key not in self._empty_proposals:
            self._empty_proposals[key] = Proposal(torch.zeros(rows, 0, dtype=torch.int64, device=device),
                                                  torch.zeros(rows, dtype=torch.int64, device=device), None, 0)
        return self._empty_proposals[key]

    def _verify_round(self, cache, sequences, proposal: Proposal, sampling: SamplingBatch):
        device = self.target.device
        last = to_device([s[-1] for s in sequences], torch.int64, device)
        inputs = torch.cat([last[:, None], proposal.tokens], dim=1)  # [B, G+1]
        G1 = inputs.shape[1]
        lengths = [len(s) for s in sequences]
        with self.phases("verify"):
            if self.target_steps is not None:
                logits = self.target_steps(inputs, cache.lengths)  # [B, G+1, V]
            else:
                hidden = self.target(inputs, cache.lengths.clone(), cache, kv_len=max(lengths) - 1 + G1)
                logits = self.target.logits(hidden)  # [B, G+1, V]
        # Checked when the round's results are read, not now (a check is a synchronisation on
        # CUDA); a broken row's tokens are never kept.
        logit_checks = [(name, t, logits_valid(t)) for name, t in (("draft", proposal.logits), ("target", logits))
                        if t is not None]
        # Token i of this round lands at absolute position len(sequence) + i: its uniforms' key.
        # (a round without drafts leaves the draft cache as it is: shorter than the target's)
        draft_lengths = self.drafter.cache_lengths if proposal.tokens.shape[1] > 0 else None
        with self.phases("accept"):
            emitted, num_emitted = verify(
                logits, proposal.logits, proposal.tokens, proposal.num_drafts, sampling.temperature, sampling.top_k,
                sampling.top_p, sampling.min_p, sampling.seeds, to_device(lengths, torch.int64, device),
                target_lengths=cache.lengths, draft_lengths=draft_lengths, impl=self.verify_impl,
                filters=sampling.filters,
            )
        return emitted, num_emitted, logit_checks

    @staticmethod
    def _account(r: Request, outcome: RowRounds):
        s = r.stats
        s.rounds += outcome.rounds
        s.target_calls += outcome.rounds
        s.draft_calls += outcome.draft_calls
        s.drafted += outcome.drafted
        s.accepted += outcome.accepted
        s.rejections += outcome.rejections
        for accepted, rounds in enumerate(outcome.histogram):
            s.accepted_histogram[accepted] += rounds

    def _append(self, r: Request, new_tokens: list[int]):
        """Append a round's tokens, ending the request exactly at EOS, max_new_tokens or a stop string."""
        before = len(r.generated)
        for token in new_tokens:
            r.generated.append(token)
            if token in self.eos_token_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            if len(r.generated) == r.params.max_new_tokens:
                r.finish_reason = "length"
                break
        if r.params.stop and self.tokenizer is not None:
            self._check_stop_strings(r, before)
        if r.finish_reason is None and len(r.sequence_start) + len(r.generated) >= self.max_seq_len:
            r.finish_reason = "capacity"
            r.message = (f"stopped after {len(r.generated)} tokens: the context of {self.max_seq_len} tokens is full "
                         f"(it began with {len(r.sequence_start)}); the partial output is kept")
            log.warning(r.message)
        r.stats.generated_tokens = len(r.generated)

    def _check_stop_strings(self, r: Request, before: int):
        decode = self.tokenizer.decode
        text = decode(r.generated, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep tokens up to the one that completed the stop string; the text ends before it.
        for n in range(before + 1, len(r.generated) + 1):
            if any(s in decode(r.generated[:n], skip_special_tokens=True) for s in r.params.stop):
                del r.generated[n:]
                break
        r.stop_text = text[:cut]
        r.finish_reason = "stop"
