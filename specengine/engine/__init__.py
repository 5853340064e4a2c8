from .async_engine import AsyncEngine
from .engine import Engine
from .request import DecodeStats, RequestOutput, Result

__all__ = ["AsyncEngine", "DecodeStats", "Engine", "RequestOutput", "Result"]
