"""Every switch of the CUDA backend, held once.

A CudaSettings is frozen: a backend holds one, and changing a setting means
replacing it (CUDABackend.using at run time; Engine.load(..., settings=...) for
the load-time ones). Because a captured CUDA graph bakes in every launch
decision, the settings object is part of each graph's cache key.

The user's switches come from the environment (the README lists them in one table):

    MINFER_MMQ_Q6K_EXP=0          register no W_exp planes (buys back ~1.52 GB on the 7B);
                                  every q6_K GEMM counts `q6k exp=off`
    MINFER_F16_WEIGHTS=1          opt-in: keep an f16 copy of every layer weight the f16
                                  engine reads, made at load (2 bytes a weight: ~13 GB on
                                  the 7B), so a prefill GEMM dequantizes nothing
    MINFER_CUDA_GRAPHS=0          never capture the decoder layers (every prefill eager)
    MINFER_PRINT_LAUNCH_COUNTS=1  print the launch counters at exit

The other fields exist to time one kernel against another or to test a fallback:
tests and scripts/bench/ab.py set them by field name, never the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping

from ...errors import MinferError

# Prefill GEMMs of at least this many tokens take the f16 cuBLAS engine: on the H200
# at the 7B's shapes the f16 engine beats the int8 MMQ for a whole layer from T = 2
# on (scripts/bench/gemm_paths.py re-measures it).
F16_GEMM_MIN_T = 2

# A decode step of up to this many sequences runs its linears as matvecs of B rows
# (kernels/matvec.cu: each weight read once per launch of up to 8 rows, each row's
# sums in its one-row order); beyond it, as a prompt of B rows (paths.gemm_path).
# On the H200 (7B twin, 32 steps after 512 tokens, interleaved A/B, 2026-12-02): at
# 8 rows the f16 engine ran at 0.76x the matvec's rate; at 32 rows (four launches
# of 8) at 2.31x (2,386 against 1,033 t/s): the dp4a products of 8 rows a launch
# are bound by the integer units, not the weights' bytes. scripts/bench/ab.py
# --batch B --a decode_matvec_rows=64 --b decode_matvec_rows=0 re-measures it.
DECODE_MATVEC_ROWS = 8
# A decode step of 2 to this many sequences runs its q4_K and q6_K linears on
# kernels/mmq_rows.cu (tensor-core products of few rows: each weight read once per
# 32 rows); 0 turns it off (the rule above then holds for every type). Measured on
# the H200 (7B twin, 32 steps after 512 tokens, interleaved, medians of 5,
# 2026-12-02), mmq_rows against what runs without it: 1,095 against 871 t/s at 8
# sequences (the dp4a matvec of 8 rows); 2,117 against 2,305 at 32 (the f16
# engine), so it stops at 16, one m-tile of x; and at one sequence 175 against
# 324 (the one-row matvec), so it starts at 2. scripts/bench/ab.py --batch B
# --a decode_mma_rows=64 --b decode_mma_rows=0 re-measures it.
DECODE_MMA_ROWS = 16

# fields read at load (registering weights); the rest may change between calls
LOAD_TIME = ("exp_planes", "f16_weights", "force_exp_miss")


@dataclass(frozen=True)
class CudaSettings:
    # the user's (environment)
    exp_planes: bool = True        # register W_exp planes at load (MINFER_MMQ_Q6K_EXP)
    f16_weights: bool = False      # f16 copies of the f16 engine's weights, made at load (MINFER_F16_WEIGHTS)
    graphs: bool = True            # CUDA graphs of the decoder layers (MINFER_CUDA_GRAPHS)
    print_launch_counts: bool = False  # the launch counters printed at exit (MINFER_PRINT_LAUNCH_COUNTS)
    # A/B and test settings (by field name only)
    exp_enabled: bool = True       # GEMMs read the registered planes (the W_exp A/B at run time)
    f16_min_t: int = F16_GEMM_MIN_T
    ffn_f16: bool = True           # the FFN's (T, d_ff) intermediates in f16, not f32
    gateup_fused: bool = True      # the gate/up + SwiGLU kernels where paths.GATEUP_KERNELS says
    flash_wgmma: bool = True       # the wgmma flash attention where the GPU has it (else mma.sync)
    decode_mma_rows: int = DECODE_MMA_ROWS  # a decode step of up to this many sequences: mmq_rows (q4_K, q6_K)
    decode_matvec_rows: int = DECODE_MATVEC_ROWS  # ... of up to this many (other types): the matvec
    decode_mmq: bool = False       # a longer decode step on the int8 MMQ (else the f16 engine)
    dependent_launches: bool = True  # programmatic dependent launches in captured graphs (dependent.py)
    deterministic: bool = False    # every row's engine fixed by what the row is (paths.gemm_path)
    force_exp_miss: bool = False   # every W_exp registration fails (the `q6k fallback!` path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "CudaSettings":
        return cls(exp_planes=env.get("MINFER_MMQ_Q6K_EXP", "1") != "0",
                   f16_weights=env.get("MINFER_F16_WEIGHTS") == "1",
                   graphs=env.get("MINFER_CUDA_GRAPHS", "1") != "0",
                   print_launch_counts=env.get("MINFER_PRINT_LAUNCH_COUNTS") == "1")

    @property
    def use_planes(self) -> bool:
        """Do q6_K GEMMs read W_exp planes (registered and not toggled off)?"""
        return self.exp_planes and self.exp_enabled

    def replace(self, **changes) -> "CudaSettings":
        """These settings with some fields changed; an unknown name or a value of the
        wrong type is a one-line MinferError."""
        types = {f.name: f.type for f in fields(self)}
        for name, value in changes.items():
            if name not in types:
                raise MinferError(f"unknown CUDA setting {name!r} (known: {', '.join(types)})")
            want = int if types[name] == "int" else bool
            if type(value) is not want:
                raise MinferError(f"CUDA setting {name}={value!r}: expected {want.__name__}")
        return replace(self, **changes)
