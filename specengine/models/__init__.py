from .config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from .llama import LlamaForCausalLM
from .loader import CheckpointError, empty_model, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "CheckpointError", "ConfigError", "LlamaForCausalLM", "ModelConfig", "empty_model",
           "load_model"]
