from .engine import Engine
from .request import DecodeStats, Result

__all__ = ["DecodeStats", "Engine", "Result"]
