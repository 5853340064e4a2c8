from .config import SUPPORTED_ARCHITECTURES, T5_ARCHITECTURE, ConfigError, ModelConfig
from .llama import LlamaForCausalLM
from .loader import CheckpointError, empty_model, load_config, load_model
from .t5 import T5ForConditionalGeneration
from .t5_config import T5Config

__all__ = ["SUPPORTED_ARCHITECTURES", "T5_ARCHITECTURE", "CheckpointError", "ConfigError", "LlamaForCausalLM",
           "ModelConfig", "T5Config", "T5ForConditionalGeneration", "empty_model", "load_config", "load_model"]
