"""Operations with several implementations behind one entry point each (impl="cpp", "triton" or
"reference"), which the models call with their backend's implementation (models.backend) and the
tests call with each.

An entry point checks its arguments and puts them in the layout the implementation needs, unless
called with check=False: the models do, since the loader checked their weights and they build the
other tensors in that layout (the checks cost as much as a small layer's op on a CPU).
SPECENGINE_CHECK_OPS=1 makes the models' calls check too (a debug mode; tests/test_models.py
runs a forward of each backend that way)."""
import os

CHECK_MODEL_CALLS = os.environ.get("SPECENGINE_CHECK_OPS", "") == "1"
