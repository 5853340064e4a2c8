"""Small in-memory models for engine tests (no files, no tokenizer)."""
import torch

from specengine.models import LlamaForCausalLM, ModelConfig
from specengine.models.config import RopeConfig


def tiny_model(vocab_size=32, seed=0, num_layers=2, hidden_size=32, eos=None, max_positions=256,
               logit_scale=1.0) -> LlamaForCausalLM:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                      head_dim=hidden_size // 4, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                      rope=RopeConfig(theta=10000.0), eos_token_ids=() if eos is None else (eos,))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval().requires_grad_(False)
