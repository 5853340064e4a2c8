"""Builds the C++ CPU ops in csrc/ into specengine._C (pybind11, no torch headers).

The ops take NumPy views of CPU tensors, so building needs neither torch nor a CUDA
toolkit, and `pip install --no-build-isolation` works on machines without internet.
"""
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (one job per core unless NPY_NUM_BUILD_JOBS says otherwise).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext_modules = [
    Pybind11Extension(
        "specengine._C",
        sources=["csrc/bindings.cpp", "csrc/blocks.cpp", "csrc/decoder.cpp", "csrc/gemm.cpp", "csrc/gemm_blocks.cpp", "csrc/layers.cpp",
                 "csrc/linear.cpp", "csrc/ngram.cpp", "csrc/verify.cpp"],
        # (headers and blocks.cpp's shared vector design: a change to them rebuilds the module)
        depends=[str(p) for p in sorted(Path("csrc").glob("*.h"))] + ["csrc/blocks_simd.inc"],
        cxx_std=17,
        # -ffp-contract=off: blocks.cpp's weights must be gguf's float32 values, each multiply and
        # add rounded on its own, and GCC would otherwise fuse any a * b + c (even one written with
        # _mm512_mul_ps and _mm512_add_ps) into an FMA. Explicit FMA intrinsics are unaffected.
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
    ),
]


class build_ext_kernels_in_place(build_ext):
    """`setup.py build_ext --inplace` (the fallback where pip cannot install) leaves the tree to be
    imported as it is; pyproject maps specengine.kernels from kernels/, which a plain import of the
    tree does not see, so a link specengine/kernels -> ../kernels stands in for that mapping."""

    def run(self):
        super().run()
        link = Path(__file__).resolve().parent / "specengine" / "kernels"
        if self.inplace and not link.exists():
            link.symlink_to(Path("..") / "kernels", target_is_directory=True)


setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext_kernels_in_place})
