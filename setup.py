"""Packaging lives in pyproject.toml. This file only adds the ahead-of-time CUDA build of ``ops`` when asked:

    PACKLOADER_BUILD_CUDA=1 pip install --no-build-isolation .     # needs torch with CUDA and nvcc at build time

Without PACKLOADER_BUILD_CUDA=1 the install is pure Python, and the kernels build just in time on first use
(see ops/_build.py).
"""
import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("PACKLOADER_BUILD_CUDA", "0") == "1":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from torch.utils.cpp_extension import BuildExtension

    from ops._build import cuda_extension

    ext_modules = [cuda_extension(here)]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
