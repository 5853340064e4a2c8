"""transformers' own load of a checkpoint: the oracle the benchmarks and checks compare against."""
from __future__ import annotations

from pathlib import Path

import torch


def transformers_model(path: str | Path, encoder_decoder: bool = False, device: str | torch.device = "cpu"):
    """transformers' float32 model of a checkpoint folder or of a GGUF file (which transformers
    dequantizes with the gguf package: the file's own model), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from ..models.loader import is_gguf

    model_class = AutoModelForSeq2SeqLM if encoder_decoder else AutoModelForCausalLM
    path = Path(path)
    if is_gguf(path):
        model = model_class.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = model_class.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device).eval()
