"""Building what an Engine runs from files: the target, its tokenizer and the drafter, in one place."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..drafters.base import Drafter
from ..drafters.cross_vocab import CrossVocabDrafter
from ..drafters.eagle3 import Eagle3Drafter
from ..drafters.model import ModelDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.suffix import SuffixDrafter
from ..drafters.vocab_map import VocabMap
from ..layers.parallel import init_tensor_parallel
from ..models.eagle3 import is_eagle3_folder, load_eagle3
from ..models.loader import Model, load_model
from ..tokenizer import TokenizerMismatchError, has_tokenizer, load_tokenizer

log = logging.getLogger("specengine")

DRAFTERS = ("model", "ngram", "suffix", "eagle3")


def load_models(target: str | Path, draft: str | Path | None, drafter: str, device: str,
                dtype: str | torch.dtype | None, weight_dtype: str | torch.dtype | None,
                tensor_parallel: int, suffix_max_global_tokens: int | None = None
                ) -> tuple[Model, object, Drafter | None]:
    """(target model, its tokenizer, the drafter) of local Hugging Face folders or GGUF files; see
    Engine.from_pretrained."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    suffix_options = {}
    if suffix_max_global_tokens is not None:
        if drafter != "suffix":
            raise ValueError(f"suffix_max_global_tokens is an option of drafter='suffix', not {drafter!r}")
        if (not isinstance(suffix_max_global_tokens, int) or isinstance(suffix_max_global_tokens, bool)
                or suffix_max_global_tokens < 0):
            raise ValueError(f"suffix_max_global_tokens must be an integer >= 0 (0: no global tree), got "
                             f"{suffix_max_global_tokens!r}")
        suffix_options["max_global_tokens"] = suffix_max_global_tokens
    if drafter in ("ngram", "suffix") and draft is not None:
        raise ValueError(f"the {drafter} drafter takes no draft model; drop `draft` or use drafter='model'")
    if drafter == "eagle3" and draft is None:
        raise ValueError("drafter='eagle3' reads an EAGLE-3 head: give its folder as `draft`")
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
        return target_model, tokenizer, SuffixDrafter(**suffix_options)
    if draft is None:
        return target_model, tokenizer, None
    if drafter == "eagle3" or is_eagle3_folder(draft):  # a folder whose config says it is an EAGLE-3 head
        log.info("loading EAGLE-3 head %s", draft)
        head = load_eagle3(draft, target_model)
        log.info("loaded target and head in %.1f s", time.perf_counter() - start)
        return target_model, tokenizer, Eagle3Drafter(head, target_model.config.vocab_size, len(tokenizer))
    log.info("loading draft %s", draft)
    draft_model = load_model(draft, device, dtype, weight_dtype)
    if has_tokenizer(draft):
        draft_tokenizer = load_tokenizer(draft)
        if (draft_tokenizer.get_vocab() != tokenizer.get_vocab()
                or draft_tokenizer.all_special_ids != tokenizer.all_special_ids):
            # Another vocabulary: map it onto the target's once (drafters.vocab_map), or refuse a
            # pair that shares too little of it to be worth drafting with.
            if draft_model.is_encoder_decoder or target_model.is_encoder_decoder:
                raise TokenizerMismatchError(f"the tokenizers of {target} and {draft} differ, and an encoder-decoder "
                                             "pair must share one vocabulary")
            vocab = VocabMap.from_tokenizers(tokenizer, draft_tokenizer, target_model.config.vocab_size,
                                             draft_model.config.vocab_size)
            vocab.check_share(target, draft)
            log.info("draft %s has its own tokenizer: %d tokens shared with the target (%.0f%% of a sample text's)",
                     draft, vocab.num_shared, 100 * vocab.share)
            log.info("loaded target and draft in %.1f s", time.perf_counter() - start)
            return target_model, tokenizer, CrossVocabDrafter(draft_model, vocab)
    elif draft_model.config.vocab_size != target_model.config.vocab_size:
        # A draft folder without tokenizer files is made for a target's tokenizer (as the
        # default pair's draft is): its logits must be as wide as the target's.
        raise TokenizerMismatchError(
            f"{draft} has no tokenizer files, so it must share {target}'s tokenizer, but its vocab_size "
            f"{draft_model.config.vocab_size} is not the target's {target_model.config.vocab_size}")
    log.info("loaded target and draft in %.1f s", time.perf_counter() - start)
    return target_model, tokenizer, ModelDrafter(draft_model, target_model.config.vocab_size, len(tokenizer))
