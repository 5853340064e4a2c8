"""specengine: lossless speculative decoding (Leviathan, Kalman, Matias, ICML 2023)."""
import os as _os
import sys as _sys
from pathlib import Path as _Path

# Run from a source checkout (`make demo`, `python -m specengine` in its root), the checkout's root
# is on sys.path, and its kernels/ folder (installed as specengine.kernels) would shadow the
# `kernels` package that transformers imports when that is installed: tokenizers and configs then
# fail to load. The root is taken off the path; specengine's own modules are found from the package.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "kernels" / "__init__.py").is_file() and (_checkout / "setup.py").is_file():
    _sys.path[:] = [p for p in _sys.path if _Path(p or _os.getcwd()).resolve() != _checkout]
from .engine import AsyncEngine, DecodeStats, Engine, RequestOutput, Result
from .sampling.params import SamplingParams
from .shipped import default_pair

__all__ = ["AsyncEngine", "DecodeStats", "Engine", "RequestOutput", "Result", "SamplingParams", "default_pair"]
__version__ = "0.1.0"
