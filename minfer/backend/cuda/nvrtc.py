"""Kernel loading: `.cu` files compiled with NVRTC through cupy.RawModule, once
per process, cached. Only the per-kernel wrappers in minfer/backend/ call this;
nothing else touches RawModule objects (DESIGN.md, layering rules).
"""
from __future__ import annotations

import functools
from pathlib import Path

from ...errors import MinferError
from ...package_data import package_data_dir

NVRTC_OPTIONS = ("-std=c++17",)


@functools.lru_cache(maxsize=1)
def kernel_dir() -> Path:
    """Where the .cu sources are: the installed package `minfer.kernels`, else the
    repository checkout (minfer.package_data)."""
    d = package_data_dir("minfer.kernels", "*.cu")
    if d is None:
        raise MinferError("CUDA kernel sources (kernels/*.cu) not found; reinstall minfer")
    return d


def source(filename: str) -> str:
    return (kernel_dir() / filename).read_text()


@functools.lru_cache(maxsize=None)
def module(filename: str, name_expressions: tuple[str, ...] = (),
           defines: tuple[tuple[str, str], ...] = ()):
    """Compile kernels/<filename> (NVRTC, for the current device) -> cupy.RawModule.

    name_expressions: C++ template instantiations to export, e.g.
    ("mmq_q6k_bt<2, true>",); defines: (("NAME", "VALUE"), ...) injected as -D.
    Cached per (file, instantiations, defines), so each compiles once per process
    (and cupy's on-disk cache makes later processes fast).
    """
    import cupy

    opts = NVRTC_OPTIONS + (f"-I{kernel_dir()}",) + tuple(f"-D{k}={v}" for k, v in defines)
    return cupy.RawModule(code=source(filename), options=opts,
                          name_expressions=name_expressions or None)


def function(filename: str, name: str, name_expressions: tuple[str, ...] = (),
             defines: tuple[tuple[str, str], ...] = ()):
    """One kernel (a plain extern "C" name, or one of name_expressions)."""
    mod = module(filename, name_expressions, defines)
    return mod.get_function(name)
