"""Builds the C++ CPU ops in csrc/ into specengine._C (pybind11, no torch headers).

The ops take NumPy views of CPU tensors, so building needs neither torch nor a CUDA
toolkit, and `pip install --no-build-isolation` works on machines without internet.
"""
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (one job per core unless NPY_NUM_BUILD_JOBS says otherwise).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext_modules = [
    Pybind11Extension(
        "specengine._C",
        sources=["csrc/bindings.cpp", "csrc/decoder.cpp", "csrc/gemm.cpp", "csrc/layers.cpp", "csrc/linear.cpp",
                 "csrc/ngram.cpp", "csrc/verify.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
