"""specengine: lossless speculative decoding (Leviathan, Kalman, Matias, ICML 2023)."""
from .engine import AsyncEngine, DecodeStats, Engine, RequestOutput, Result
from .sampling.params import SamplingParams
from .shipped import default_pair

__all__ = ["AsyncEngine", "DecodeStats", "Engine", "RequestOutput", "Result", "SamplingParams", "default_pair"]
__version__ = "0.1.0"
