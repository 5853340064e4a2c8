"""Counting the Triton block kernels' launches (kernels/blocks.py), for the tests of stored-matrix
models and of the kernels themselves. Import after TRITON_INTERPRET is chosen (conftest.py)."""
from collections import Counter

BLOCK_KERNELS = ("_gemv_kernel", "_gemm_kernel", "_combine_kernel", "_rows_kernel")


def count_launches(monkeypatch) -> Counter:
    """Counts of the block kernels' launches from here on, by kernel name (each launch still runs)."""
    from specengine.kernels import blocks as kernels

    counts = Counter()
    for name in BLOCK_KERNELS:
        fn = getattr(kernels, name)

        def counted(*args, _name=name, _run=fn.run, **kwargs):
            counts[_name] += 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(fn, "run", counted)
    return counts
