#!/usr/bin/env python3
"""SASS-level evidence for the q6_K W_exp bundle: the cp.async staging really became
LDGSTS, and the MMQ kernels neither spill nor exceed their register budget.

Compiles kernels/mmq.cu offline (nvcc -cubin -arch=sm_90, with the explicit
instantiations of its MINFER_SASS_INSTANTIATE block and the kernel constants
that minfer.backend.cuda.nvrtc injects at run time), then per MMQ kernel:
registers, stack frame and spill bytes (ptxas -v), and the number of LDGSTS
instructions (cuobjdump --dump-sass): explicit-PTX cp.async must really become
LDGSTS in the EXP=true build, or the fast path silently degrades.

Exit code 1 if LDGSTS is missing from mmq_q6k_bt<.., true>, if any MMQ kernel
spills, or if mmq_q6k_bt uses more than the 80 registers that
__launch_bounds__(256, 3) allows. Then the wgmma kernels for sm_90a
(kernels/flash_attn_sm90.cu, kernels/gateup_sm90.cu): no spills, at most the
registers of their launch bounds, and no wgmma serialized by ptxas ("Potential
Performance Loss"); with cuobjdump, HGMMA in their SASS.
Without cuobjdump (a machine with only nvcc/ptxas) the LDGSTS column says so and
counts cp.async in the PTX instead; that is not SASS evidence, and
--require-sass makes it an error.

    python3 -m scripts.check.sass_check [--arch sm_90] [--require-sass]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MMQ = ROOT / "kernels" / "mmq.cu"
FLASH90 = ROOT / "kernels" / "flash_attn_sm90.cu"
GATEUP90 = ROOT / "kernels" / "gateup_sm90.cu"


def kernel_constants():
    """-> (K, define_flags): the constants minfer.backend.cuda.nvrtc injects at run
    time, and its nvcc -D flags (imported when a check runs, not for --help)."""
    from minfer.backend.cuda.nvrtc import K, define_flags      # (imports without cupy)
    return K, define_flags


def register_budgets(K) -> tuple[int, int, int]:
    """-> the most registers of mmq_q6k_bt, flash_attn_f16_sm90 and the gate/up kernels"""
    # 3 blocks of MMQ_THREADS per SM (__launch_bounds__ of mmq_q6k_bt) -> 80 (alloc granule 8)
    q6k = 65536 // (K["MMQ_THREADS"] * 3) // 8 * 8
    # two blocks of FA90_WG warpgroups per SM (__launch_bounds__ of flash_attn_f16_sm90)
    flash90 = 65536 // (128 * K["FA90_WG"] * 2)
    # one block of GU_THREADS (384) per SM (__launch_bounds__ of both gate/up kernels; their
    # consumer warpgroups raise theirs with setmaxnreg) -> 168 (alloc granule 8)
    gateup90 = 65536 // K["GU_THREADS"] // 8 * 8
    return q6k, flash90, gateup90


def demangle(sym: str) -> str:
    """_Z10mmq_q6k_btILi2ELb1EEv... -> mmq_q6k_bt<2, true> (enough for these kernels)."""
    m = re.match(r"_Z(\d+)", sym)
    if not m:
        return sym
    start = m.end()
    name, rest = sym[start:start + int(m[1])], sym[start + int(m[1]):]
    if not rest.startswith("I"):
        return name
    targs = re.findall(r"L([ib])(\d+)E", rest[:rest.find("EE") + 2])
    vals = [v if k == "i" else ("true" if v == "1" else "false") for k, v in targs]
    return f"{name}<{', '.join(vals)}>"


def run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"sass_check: {' '.join(cmd)} failed:\n{p.stdout}{p.stderr}")
    return p.stdout + p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.check.sass_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--require-sass", action="store_true",
                    help="fail when cuobjdump is not available")
    a = ap.parse_args()
    if not shutil.which("nvcc"):
        sys.exit("sass_check: nvcc not found")
    K, define_flags = kernel_constants()
    MAX_REGS_Q6K, MAX_REGS_FLASH90, MAX_REGS_GATEUP90 = register_budgets(K)
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "mmq.cubin", Path(tmp) / "mmq.ptx"
        common = ["nvcc", f"-arch={a.arch}", "-std=c++17", "-DMINFER_SASS_INSTANTIATE",
                  *define_flags(), f"-I{MMQ.parent}", str(MMQ)]
        log = run(common[:1] + ["-cubin", "-Xptxas", "-v", "-o", str(cubin)] + common[1:])
        run(common[:1] + ["-ptx", "-o", str(ptx)] + common[1:])

        # ptxas -v: "Compiling entry function 'SYM'" ... "N bytes stack frame, S bytes
        # spill stores, L bytes spill loads" ... "Used R registers"
        res: dict[str, dict] = {}
        cur = None
        for line in log.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                cur = m.group(1)
                res[cur] = {}
            elif cur and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                         r"(\d+) bytes spill loads", line)):
                res[cur].update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
            elif cur and (m := re.search(r"Used (\d+) registers", line)):
                res[cur]["regs"] = int(m[1])

        # PTX cp.async per entry (fallback evidence) and SASS LDGSTS per function
        ptx_text = ptx.read_text()
        for sym in res:
            body = ptx_text.split(f".entry {sym}(", 1)[-1].split(".entry ", 1)[0]
            res[sym]["ptx_cp_async"] = body.count("cp.async.cg.shared.global")
        have_sass = shutil.which("cuobjdump") is not None
        if have_sass:
            sass = run(["cuobjdump", "--dump-sass", str(cubin)])
            for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
                sym = chunk.split("\n", 1)[0].strip()
                if sym in res:
                    res[sym]["ldgsts"] = len(re.findall(r"\bLDGSTS\b", chunk))
            run(["cuobjdump", "--dump-resource-usage", str(cubin)])   # must work too

    print(f"{'kernel':28} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9} "
          f"{'LDGSTS':>7} {'PTX cp.async':>13}")
    bad = []
    for sym, r in res.items():
        name = demangle(sym)
        ld = r.get("ldgsts")
        print(f"{name:28} {r.get('regs', -1):>5} {r.get('stack', 0):>6} {r.get('spill_st', 0):>9} "
              f"{r.get('spill_ld', 0):>9} {('n/a' if ld is None else ld):>7} {r['ptx_cp_async']:>13}")
        if r.get("spill_st", 0) or r.get("spill_ld", 0):
            bad.append(f"{name} spills")
        if name.startswith("mmq_q6k_bt") and r.get("regs", 0) > MAX_REGS_Q6K:
            bad.append(f"{name} uses {r['regs']} registers > {MAX_REGS_Q6K} "
                       f"(__launch_bounds__({K['MMQ_THREADS']}, 3))")
        if name.startswith("mmq_q6k_bt") and name.endswith("true>"):
            if ld is not None and ld == 0:
                bad.append(f"{name}: no LDGSTS in the SASS (cp.async degraded)")
            if r["ptx_cp_async"] == 0:
                bad.append(f"{name}: no cp.async in the PTX")
    if not any(demangle(s).endswith("true>") for s in res):
        bad.append("no mmq_q6k_bt<.., true> instantiation found")
    if not have_sass:
        msg = "cuobjdump not found: LDGSTS not checked at the SASS level (PTX counts shown)"
        if a.require_sass:
            bad.append(msg)
        else:
            print(f"WARNING: {msg}")
    bad += check_sm90(FLASH90, "flash_attn_f16_sm90", MAX_REGS_FLASH90, define_flags())
    bad += check_sm90(GATEUP90, "gateup_swiglu_q4k, _f16", MAX_REGS_GATEUP90, define_flags())
    for b in bad:
        print(f"FAIL: {b}")
    if not bad:
        print("OK" + (" (SASS: LDGSTS present in EXP=true)" if have_sass else ""))
    return 1 if bad else 0


def check_sm90(src: Path, name: str, max_regs: int, flags: list[str]) -> list[str]:
    """A wgmma kernel: registers, spills, no serialized wgmma -> failures."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        log = run(["nvcc", "-arch=sm_90a", "-std=c++17", "-cubin", "-Xptxas", "-v", *flags,
                   f"-I{src.parent}", str(src), "-o", str(cubin)])
        hgmma = None
        if shutil.which("cuobjdump"):
            hgmma = len(re.findall(r"\bHGMMA\b", run(["cuobjdump", "--dump-sass", str(cubin)])))
    # every kernel of the file: the most registers, all spills
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", log)), default=-1)
    sp = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    spills = sum(int(a) + int(b) for a, b in sp) if sp else -1
    print(f"{name:28} {regs:>5} {'':>6} {spills:>9} (spill bytes)  "
          f"HGMMA {'n/a' if hgmma is None else hgmma}")
    bad = []
    if spills:
        bad.append(f"{name} spills ({spills} bytes)")
    if not 0 < regs <= max_regs:
        bad.append(f"{name} uses {regs} registers > {max_regs}")
    if "Performance Loss" in log:
        bad.append(f"{name}: ptxas serialized its wgmma")
    if hgmma == 0:
        bad.append(f"{name}: no HGMMA in the SASS")
    return bad


if __name__ == "__main__":
    sys.exit(main())
