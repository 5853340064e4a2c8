"""Building what an Engine runs from files: the target, its tokenizer and the drafter, in one place."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..drafters.base import Drafter
from ..drafters.model import ModelDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.suffix import SuffixDrafter
from ..layers.parallel import init_tensor_parallel
from ..models.loader import Model, load_model
from ..tokenizer import TokenizerMismatchError, check_same_vocabulary, has_tokenizer, load_tokenizer

log = logging.getLogger("specengine")

DRAFTERS = ("model", "ngram", "suffix")


def load_models(target: str | Path, draft: str | Path | None, drafter: str, device: str,
                dtype: str | torch.dtype | None, weight_dtype: str | torch.dtype | None,
                tensor_parallel: int) -> tuple[Model, object, Drafter | None]:
    """(target model, its tokenizer, the drafter) of local Hugging Face folders or GGUF files; see
    Engine.from_pretrained."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if drafter in ("ngram", "suffix") and draft is not None:
        raise ValueError(f"the {drafter} drafter takes no draft model; drop `draft` or use drafter='model'")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    tp = None
    if tensor_parallel > 1:
        tp, device = init_tensor_parallel(tensor_parallel, device)
    start = time.perf_counter()
    log.info("loading target %s", target)
    target_model = load_model(target, device, dtype, weight_dtype, tp)
    log.info("loading the tokenizer of %s", target)
    tokenizer = load_tokenizer(target)
    if drafter == "ngram":
        return target_model, tokenizer, NgramDrafter()
    if drafter == "suffix":
        return target_model, tokenizer, SuffixDrafter()
    if draft is None:
        return target_model, tokenizer, None
    log.info("loading draft %s", draft)
    draft_model = load_model(draft, device, dtype, weight_dtype)
    if has_tokenizer(draft):
        check_same_vocabulary(tokenizer, load_tokenizer(draft), target, draft)
    elif draft_model.config.vocab_size != target_model.config.vocab_size:
        # A draft folder without tokenizer files is made for a target's tokenizer (as the
        # default pair's draft is): its logits must be as wide as the target's.
        raise TokenizerMismatchError(
            f"{draft} has no tokenizer files, so it must share {target}'s tokenizer, but its vocab_size "
            f"{draft_model.config.vocab_size} is not the target's {target_model.config.vocab_size}")
    log.info("loaded target and draft in %.1f s", time.perf_counter() - start)
    return target_model, tokenizer, ModelDrafter(draft_model, target_model.config.vocab_size, len(tokenizer))
