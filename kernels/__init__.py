"""Triton GPU kernels, installed as ``specengine.kernels``.

Each kernel module pairs with a pure-torch reference in ``specengine`` that is the
oracle of its tests. Kernels know only tensors: nothing here imports the engine.
"""
