"""Turning what a caller passes (prompts as text, bytes or token ids; sampling parameters; request
ids) into Requests, or a ValueError / TypeError naming the argument that is wrong. All of a call's
prompts are checked before any is queued: bad input leaves nothing half-done."""
from __future__ import annotations

import secrets
import uuid
from collections.abc import Collection, Sequence

import torch

from ..sampling.params import SamplingParams
from .request import DecodeStats, Request
from .text import utf8_text

Prompt = str | bytes | Sequence[int]


class Intake:
    def __init__(self, target, tokenizer, max_seq_len: int, gamma: int):
        self.target, self.tokenizer, self.max_seq_len, self.gamma = target, tokenizer, max_seq_len, gamma

    def requests(self, prompts, params, request_ids: Sequence[str | None] | None,
                 in_flight: Collection[str]) -> list[Request]:
        if isinstance(prompts, (str, bytes)) or (isinstance(prompts, Sequence) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if not isinstance(params, Sequence):
            raise TypeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"params must be SamplingParams, got {type(wrong).__name__}")
        if self.target.is_encoder_decoder and any(p.prompt_logprobs is not None for p in params):
            raise ValueError("prompt_logprobs needs a decoder-only target: an encoder-decoder target's prompt is its "
                             "encoder's input, which it does not predict")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        for i, request_id in enumerate(ids):
            if request_id is None:
                ids[i] = uuid.uuid4().hex
            elif not isinstance(request_id, str):
                raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
            elif not request_id:
                raise ValueError("request_id must be a non-empty string")
            elif request_id in in_flight or request_id in ids[:i]:
                raise ValueError(f"request_id {request_id!r} is already in flight")
        encoded = [self.encode(p) for p in prompts]
        seeds = [p.seed if p.seed is not None else self._random_seed() for p in params]
        # An encoder-decoder target encodes the prompt; its decoder starts from its start token.
        start = [self.target.config.decoder_start_token_id] if self.target.is_encoder_decoder else None
        return [Request(request_id, tokens, p, seed, DecodeStats(gamma=self.gamma, prompt_tokens=len(tokens)),
                        decoder_start=start)
                for request_id, tokens, p, seed in zip(ids, encoded, params, seeds)]

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (str, bytes, bytearray)):
            prompt = utf8_text(prompt)
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, Sequence) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            vocab = self.target.config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
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

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of chat messages through the tokenizer's chat template (see Engine.chat_prompt)."""
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

    def _random_seed(self) -> int:
        """A seed for a request without one; with a split target, rank 0's (every rank samples alike)."""
        seed = secrets.randbits(63)
        return seed if self.target.tp is None else self.target.tp.broadcast_int(seed)
