"""Every switch of the CUDA backend, read from the environment once.

A CudaSettings is frozen: a backend holds one, and changing a setting (tests,
A/B scripts) means replacing it (CUDABackend.using). Because a captured CUDA
graph bakes in every launch decision, the settings object is part of each
graph's cache key.

    MINFER_MMQ_Q6K_EXP=0          register no W_exp planes (buys back ~1.52 GB on the 7B);
                                  every q6_K GEMM counts `q6k exp=off`
    MINFER_FFN_F16=0              keep the FFN's (T, d_ff) intermediates in f32
    MINFER_F16_WEIGHTS=1          opt-in: keep an f16 copy of every layer weight the f16
                                  engine reads, made at load (2 bytes a weight: ~13 GB on
                                  the 7B), so a prefill GEMM dequantizes nothing
    MINFER_GATEUP_FUSED=0         prefill gate/up + SwiGLU through dequantize + cuBLAS + swiglu_f16
                                  at every length, never the Hopper kernel that reads q4_K
                                  (gateup.py; the same bits)
    MINFER_FLASH_WGMMA=0          prefill attention through the mma.sync flash kernel on a
                                  Hopper GPU too (the one other GPUs run), not the wgmma one
    MINFER_CUDA_GRAPHS=0          never capture the decoder layers (every prefill eager)
    MINFER_PDL=0                  launch a captured graph's kernels the ordinary way, each
                                  after its predecessor has finished (dependent.py; GPUs
                                  before compute capability 9.0 always do)
    MINFER_MMQ_RAW_NB_DEBUG=1     print the launch-path counters at exit
    MINFER_TEST_FORCE_EXP_MISS=1  tests only: every W_exp registration fails
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

# Prefill GEMMs of at least this many tokens take the f16 cuBLAS engine. Measured
# on the H200 at the 7B's shapes (scripts/gemm_paths.py; docs/PERF.md, "GEMM
# engine by prompt length"): the f16 engine beats the int8 MMQ for a whole layer
# from T = 2 on, so every prefill GEMM of the layer stack takes it.
F16_GEMM_MIN_T = 2


@dataclass(frozen=True)
class CudaSettings:
    exp_planes: bool = True        # register W_exp planes at load (MINFER_MMQ_Q6K_EXP)
    exp_enabled: bool = True       # GEMMs use the registered planes (an A/B toggle at run time)
    f16_min_t: int = F16_GEMM_MIN_T
    ffn_f16: bool = True           # fused f16 FFN (MINFER_FFN_F16)
    f16_weights: bool = False      # f16 copies of the f16 engine's weights, made at load (MINFER_F16_WEIGHTS)
    gateup_fused: bool = True      # q4_K gate/up + SwiGLU in one Hopper kernel (gemm.GATEUP_KERNELS; MINFER_GATEUP_FUSED)
    flash_wgmma: bool = True       # wgmma flash attention where the GPU has it (MINFER_FLASH_WGMMA)
    graphs: bool = True            # CUDA graphs of the decoder layers (MINFER_CUDA_GRAPHS)
    dependent_launches: bool = True  # programmatic dependent launches in captured graphs (MINFER_PDL)
    report_counts: bool = False    # launch-path counters printed at exit (MINFER_MMQ_RAW_NB_DEBUG)
    force_exp_miss: bool = False   # simulate a failed plane registration (MINFER_TEST_FORCE_EXP_MISS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "CudaSettings":
        return cls(exp_planes=env.get("MINFER_MMQ_Q6K_EXP", "1") != "0",
                   ffn_f16=env.get("MINFER_FFN_F16", "1") != "0",
                   f16_weights=env.get("MINFER_F16_WEIGHTS") == "1",
                   gateup_fused=env.get("MINFER_GATEUP_FUSED", "1") != "0",
                   flash_wgmma=env.get("MINFER_FLASH_WGMMA", "1") != "0",
                   graphs=env.get("MINFER_CUDA_GRAPHS", "1") != "0",
                   dependent_launches=env.get("MINFER_PDL", "1") != "0",
                   report_counts=env.get("MINFER_MMQ_RAW_NB_DEBUG") == "1",
                   force_exp_miss=env.get("MINFER_TEST_FORCE_EXP_MISS") == "1")

    @property
    def use_planes(self) -> bool:
        """Do q6_K GEMMs read W_exp planes (registered and not toggled off)?"""
        return self.exp_planes and self.exp_enabled

    def replace(self, **changes) -> "CudaSettings":
        return replace(self, **changes)
