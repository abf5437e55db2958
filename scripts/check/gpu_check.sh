#!/usr/bin/env bash
# One command for the GPU machine: install what it lacks (the carried gguf wheel),
# run the GPU tests, the SASS check, the golden byte-identity check and a short
# benchmark; logs go under $OUT (when set) and a summary table is printed LAST.
#
#   bash scripts/check/gpu_check.sh              # from the repository root
#   GOLDEN_UPDATE=1 bash scripts/check/gpu_check.sh   # (re)make tests/golden first (-> $OUT/golden.tgz)
#   GOLDEN_CHECK=0 PYTEST_TIMEOUT=180 BENCH_REPS=3  # a shorter run
#   GPU_TESTS=0 BENCH_7B=1 bash scripts/check/gpu_check.sh  # the 7B steps without the GPU tests
#   BENCH_7B=1 bash scripts/check/gpu_check.sh        # + the 7B twin: bench, A/Bs of W_exp and the fused
#                                                     #   gate/up kernel, 3-mode greedy,
#                                                     #   GEMM engine by prompt length (AB_7B=0 skips the
#                                                     #   W_exp A/B, AB_GRAPHS=0 the CUDA-graph A/B),
#                                                     #   the batched bench (BATCH_7B=0 skips it)
#
# The Python steps run as modules from the repository root (python3 -m scripts.check.golden,
# python3 -m scripts.bench.ab, ...); the A/B and greedy-mode steps name CudaSettings
# fields (scripts/fields.py), not environment variables.
#
# $OUT gets at most 8 files back: env.log, golden.log (+ golden.tgz when made),
# pytest_gpu.log, parity.txt, sass.log, bench.log, summary.md.
# Exit status: non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

LOG=${OUT:-/tmp/minfer-gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
export MINFER_SKIP_MODEL_TESTS=1              # the real model cannot travel to this machine
export MINFER_CACHE=${MINFER_CACHE:-/tmp/minfer-cache}   # the synthetic model, made once, shared by the steps
export MINFER_REPORT_DIR=$LOG                 # test_parity.py appends its measured figures here
mkdir -p "$MINFER_CACHE"

STEPS=()
declare -A STATUS NOTE
FAILED=0
record() {   # step status note
    STEPS+=("$1"); STATUS[$1]=$2; NOTE[$1]=$3
    [ "$2" = FAIL ] && FAILED=1
    echo "=== $1: $2 ${3}"
}

# 1. the gguf wheel (nothing can be fetched here)
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$LOG/env.log" 2>&1; then
    record install ok "$(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
else
    record install FAIL "see env.log (carry .whl with the gguf wheel)"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the SASS check needs only nvcc/cuobjdump: run it beside the GPU steps
SASS_PID=
if [ -f scripts/check/sass_check.py ]; then
    timeout 240 python3 -m scripts.check.sass_check >"$LOG/sass.log" 2>&1 &
    SASS_PID=$!
fi
nvidia-smi -L | tee -a "$LOG/env.log"
python3 -c "import cupy, gguf; print('cupy', cupy.__version__, 'gguf ok')" 2>&1 | tee -a "$LOG/env.log"

# 2. golden files: made here when asked or when there are none yet
if [ "${GOLDEN_UPDATE:-0}" = 1 ] || ! ls tests/golden/*.json >/dev/null 2>&1; then
    if timeout 200 python3 -m scripts.check.golden --update --model-dir "$MINFER_CACHE" --out tests/golden >"$LOG/golden.log" 2>&1; then
        tar czf "$LOG/golden.tgz" tests/golden/*.json
        record golden-update ok "$(ls tests/golden/*.json | wc -l) streams -> golden.tgz"
    else
        record golden-update FAIL "see golden.log"
    fi
fi

# 3. the GPU tests (every gpu-marked test under tests/; GPU_TESTS=0 skips them, for a
#    second call that only benchmarks)
if [ "${GPU_TESTS:-1}" = 1 ]; then
    timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider \
        tests/ \
        >"$LOG/pytest_gpu.log" 2>&1
    rc=$?
    sum=$(tail -n 1 "$LOG/pytest_gpu.log")
    [ $rc = 0 ] && record pytest-gpu ok "$sum" || record pytest-gpu FAIL "rc=$rc $sum"
    grep -E "^(FAILED|ERROR)" "$LOG/pytest_gpu.log" | head -20
else
    record pytest-gpu skipped "GPU_TESTS=0"
fi

# 4. SASS check (LDGSTS in the EXP=true MMQ build), started above
if [ -n "$SASS_PID" ]; then
    wait $SASS_PID
    rc=$?
    [ $rc = 0 ] && record sass ok "$(tail -n 1 "$LOG/sass.log")" || record sass FAIL "rc=$rc $(tail -n 1 "$LOG/sass.log")"
else
    record sass FAIL "scripts/check/sass_check.py missing"
fi

# 5. golden byte identity (check mode; a fresh process against the files on disk)
if [ "${GOLDEN_CHECK:-1}" = 1 ]; then
    timeout 200 python3 -m scripts.check.golden --model-dir "$MINFER_CACHE" >>"$LOG/golden.log" 2>&1
    rc=$?
    [ $rc = 0 ] && record golden ok "$(grep -c ': OK' "$LOG/golden.log") streams byte-identical" \
                 || record golden FAIL "rc=$rc $(grep -m1 -E 'MISMATCH|error' "$LOG/golden.log")"
else
    record golden skipped "GOLDEN_CHECK=0 (test_golden_gpu.py compared all three modes)"
fi

# 6. short benchmark: prefill 512 and 3325 tokens, 32 decode steps, on the synthetic model
SYNTH=$(python3 -c "from minfer.tools.synth import synth_model; print(synth_model('$MINFER_CACHE'))" 2>"$LOG/bench.log")
if [ -f minfer/tools/bench.py ] && [ -n "$SYNTH" ]; then
    timeout 150 python3 -m minfer bench -m "$SYNTH" -p 512,3325 -r ${BENCH_REPS:-3} -n 32 >>"$LOG/bench.log" 2>&1
    rc=$?
    pp=$(grep -E '\| pp512 \|' "$LOG/bench.log" | head -1 | awk -F'|' '{print $(NF-1)}')
    [ $rc = 0 ] && record bench ok "pp512 ${pp} t/s (synthetic L3 d512)" || record bench FAIL "see bench.log"
else
    record bench FAIL "no minfer/tools/bench.py or no synthetic model"
fi
# 7. attention alone at the 7B's shapes (28 query / 4 KV heads, hd 128), CUDA events:
#    the path the backend takes at head dim 128 (f16 KV cache, K/V store, q's cast,
#    the flash attention), with each flash kernel this GPU has (wgmma first: the default).
#    Ten calls back to back between two events, so the GPU time is measured and not
#    the host's launch gaps (a single call between events also timed Python)
python3 - >>"$LOG/bench.log" 2>&1 <<'PY'
import cupy as cp, numpy as np
from minfer.backend.cuda.kernels.flash_attn import attention_f16, flash_kind
kinds = dict.fromkeys((flash_kind(True), flash_kind(False)))
for T in (512, 3325, 8192):
    rng = np.random.default_rng(T)
    q = cp.asarray(rng.standard_normal((T, 28, 128), dtype=np.float32))
    k = cp.asarray(rng.standard_normal((T, 4, 128), dtype=np.float32))
    kc = cp.zeros((T, 4, 128), cp.float16); vc = cp.zeros_like(kc)
    y = cp.empty((T, 28 * 128), cp.float32)
    for kind in kinds:
        run = lambda: attention_f16(q, k, k, kc, vc, 0, out=y, wgmma=kind == "wgmma")
        run()                                          # warm-up (compile)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ms = []
        for _ in range(5):
            e0.record()
            for _ in range(10):
                run()
            e1.record(); e1.synchronize()
            ms.append(cp.cuda.get_elapsed_time(e0, e1) / 10)
        flop = 4 * 28 * 128 * T * (T + 1) / 2
        print(f"attention 7B-shape T={T}: median {np.median(ms):.3f} ms/layer "
              f"({flop / np.median(ms) / 1e9:.1f} TFLOP/s, f16 flash {kind})")
PY
# 8. device out of memory through the CLI: one line on stderr, exit status 2, no traceback
if [ -n "$SYNTH" ]; then
    python3 -m minfer generate -m "$SYNTH" --backend cuda -c 400000000 -n 1 -q -p hi \
        >/dev/null 2>"$LOG/oom.txt"
    rc=$?
    if [ $rc = 2 ] && [ "$(wc -l <"$LOG/oom.txt")" -le 1 ] && grep -q "GPU out of memory" "$LOG/oom.txt"; then
        record oom-cli ok "exit 2, one line"
    else
        record oom-cli FAIL "exit $rc, $(wc -l <"$LOG/oom.txt") lines"
    fi
    cat "$LOG/oom.txt" >>"$LOG/bench.log"; rm -f "$LOG/oom.txt"
fi
# 9. the 7B benchmark model (BENCH_7B=1): the twin from the header, minfer bench,
#    the interleaved A/B of the W_exp bundle, greedy identity over the three q6_K
#    modes, and the GEMM engine by prompt length (all appended to bench.log)
if [ "${BENCH_7B:-0}" = 1 ]; then
    TWIN=$MINFER_CACHE/deepseek-r1-distill-qwen-7b-q4_k_m.twin.gguf
    t0=$(date +%s)
    if [ -f "$TWIN" ] || timeout 240 python3 -m minfer twin -q -o "$TWIN" >>"$LOG/bench.log" 2>&1; then
        record twin ok "$(( $(date +%s) - t0 )) s, $(stat -c %s "$TWIN") bytes"
        timeout 300 python3 -m minfer bench -m "$TWIN" -p 512,3325 -r ${BENCH7B_REPS:-5} -n 32 >"$LOG/b7.txt" 2>&1
        rc=$?
        cat "$LOG/b7.txt" >>"$LOG/bench.log"
        for t in pp512 pp3325 tg32; do
            v=$(grep -E "\| $t \|" "$LOG/b7.txt" | head -1 | awk -F'|' '{print $(NF-1)}')
            [ $rc = 0 ] && [ -n "$v" ] && record "7b-$t" ok "$v t/s" || record "7b-$t" FAIL "rc=$rc"
        done
        rm -f "$LOG/b7.txt"
        # ab_step NAME ARGS...: one interleaved scripts/bench/ab.py run on the twin, logged and recorded
        ab_step() {
            local name=$1; shift
            timeout 200 python3 -m scripts.bench.ab -m "$TWIN" -r ${AB_REPS:-7} "$@" >"$LOG/ab.txt" 2>&1
            local rc=$?
            cat "$LOG/ab.txt" >>"$LOG/bench.log"
            [ $rc = 0 ] && record "$name" ok "$(grep -m1 -iE 'ratio' "$LOG/ab.txt")" || record "$name" FAIL "rc=$rc"
            rm -f "$LOG/ab.txt"
        }
        if [ "${AB_7B:-1}" = 1 ]; then           # the W_exp bundle on vs off
            ab_step ab-exp -p ${AB_TOKENS:-3325} --a exp_planes=1 --b exp_planes=0
            # the LM head over many positions (perplexity-shaped) runs MMQ: there the plane stages B
            ab_step ab-exp-head -p 512 --logits-from 256 --a exp_planes=1 --b exp_planes=0
        fi
        if [ "${AB_GRAPHS:-1}" = 1 ]; then       # CUDA graphs of the layers vs eager, at 512 tokens
            ab_step ab-graphs -p 512 --a graphs=1 --b graphs=0
        fi
        if [ "${AB_GATEUP:-1}" = 1 ]; then       # the gate/up + SwiGLU kernels vs the chain:
            # the q4_K one at 512 tokens, the f16 one at 3,325
            ab_step ab-gateup -p ${AB_GATEUP_TOKENS:-512} --a gateup_fused=1 --b gateup_fused=0
            ab_step ab-gateup-f16 -p 3325 --a gateup_fused=1 --b gateup_fused=0
        fi
        if [ "${AB_FFN:-1}" = 1 ]; then          # f16 FFN intermediates vs f32, at 3325 tokens
            ab_step ab-ffn16 -p 3325 --a ffn_f16=1 --b ffn_f16=0
        fi
        # greedy stream from the 7B twin, byte-identical across the three q6_K modes and
        # with the fused gate/up kernel off (a prompt of ~150 tokens: long enough to take it);
        # each mode a fresh process of scripts/check/greedy_stream.py: the text into
        # /tmp/g7b_MODE.txt, its launch counters (`NAME: N` lines) into /tmp/g7b_MODE.err
        if [ "${GREEDY_7B:-1}" = 1 ]; then      # the greedy identity steps (GREEDY_7B=0 skips them)
            P="$(printf 'The capital of France is Paris. %.0s' $(seq 22))The capital of Italy is"
            for mode in exp off miss chain; do
                case $mode in
                    exp) envs=(); sets=() ;; off) envs=(MINFER_MMQ_Q6K_EXP=0); sets=() ;;
                    miss) envs=(); sets=(--set force_exp_miss=1) ;; chain) envs=(); sets=(--set gateup_fused=0) ;;
                esac
                env "${envs[@]}" timeout 120 python3 -m scripts.check.greedy_stream -m "$TWIN" -n 40 -p "$P" \
                    -o "/tmp/g7b_$mode.txt" "${sets[@]}" >"/tmp/g7b_$mode.err" 2>&1
                echo "--- 7B greedy, mode $mode: $(wc -c <"/tmp/g7b_$mode.txt") bytes; $(grep -E 'q6k (exp|exp=off|fallback!):' "/tmp/g7b_$mode.err" | tr '\n' ' ')" >>"$LOG/bench.log"
            done
            if [ -s /tmp/g7b_exp.txt ] && cmp -s /tmp/g7b_exp.txt /tmp/g7b_off.txt && cmp -s /tmp/g7b_exp.txt /tmp/g7b_miss.txt \
                    && cmp -s /tmp/g7b_exp.txt /tmp/g7b_chain.txt; then
                record 7b-greedy-modes ok "$(wc -c </tmp/g7b_exp.txt) bytes identical in exp / exp=off / fallback! / gate/up chain"
            else
                record 7b-greedy-modes FAIL "streams differ or are empty (see bench.log)"
            fi
            # the same at a prompt long enough for the f16 gate/up kernel (~2,000 tokens), whose
            # launches hand each next layer's gate/up on: its stream against the chain's,
            # and its counters live (every layer's launch, all but the last with the next pair)
            P="$(printf 'The capital of France is Paris. %.0s' $(seq 280))The capital of Italy is"
            for mode in exp chain; do
                case $mode in exp) sets=() ;; chain) sets=(--set gateup_fused=0) ;; esac
                timeout 120 python3 -m scripts.check.greedy_stream -m "$TWIN" -n 24 -p "$P" \
                    -o "/tmp/g7l_$mode.txt" "${sets[@]}" >"/tmp/g7l_$mode.err" 2>&1
                echo "--- 7B greedy, long prompt, mode $mode: $(wc -c <"/tmp/g7l_$mode.txt") bytes; $(grep -E '^(gateup_swiglu_f16|gate/up prefetch):' "/tmp/g7l_$mode.err" | tr '\n' ' ')" >>"$LOG/bench.log"
            done
            # the f16 kernel's launches (counted by kernel name: absent where none ran) and the
            # launches that also prefetched the next layer's pair
            f16n=$(grep -oP '^gateup_swiglu_f16: \K[0-9]+' /tmp/g7l_exp.err); ahn=$(grep -oP '^gate/up prefetch: \K[0-9]+' /tmp/g7l_exp.err)
            chn=$(grep -oP '^gateup_swiglu_f16: \K[0-9]+' /tmp/g7l_chain.err)
            if [ -s /tmp/g7l_exp.txt ] && cmp -s /tmp/g7l_exp.txt /tmp/g7l_chain.txt && [ "${f16n:-0}" -gt 0 ] \
                    && [ "${ahn:-0}" -gt 0 ] && [ "${chn:-0}" = 0 ]; then
                record 7b-greedy-long ok "$(wc -c </tmp/g7l_exp.txt) bytes identical, f16 kernel / chain (gateup_swiglu_f16 $f16n, prefetch $ahn)"
            else
                record 7b-greedy-long FAIL "streams differ, are empty, or the f16 kernel did not run (see bench.log)"
            fi
        fi
        if [ "${BATCH_7B:-1}" = 1 ]; then        # many sequences per forward (BATCH_7B=0 skips it)
            # batch_bench NAME [FLAGS...]: llama-batched-bench's table (32 x 128 and 8 x 512 prefilled
            # in one forward, decode at B 1/8/32), logged, its S_PP / S_TG recorded as NAME-PPxB
            batch_bench() {
                local name=$1; shift
                timeout 300 python3 -m minfer bench -m "$TWIN" -npp 128,512 -ntg 128 -npl 1,8,32 \
                    -r ${BATCH_REPS:-3} "$@" >"$LOG/bb.txt" 2>&1
                local rc=$?
                cat "$LOG/bb.txt" >>"$LOG/bench.log"
                for pb in "128 32" "512 8" "512 32"; do
                    set -- $pb
                    v=$(awk -F'|' -v pp=$1 -v b=$2 '$2+0 == pp && $4+0 == b {printf "S_PP %s S_TG %s", $7, $9}' "$LOG/bb.txt" | tr -s ' ')
                    [ $rc = 0 ] && [ -n "$v" ] && record "$name-${1}x${2}" ok "$v t/s" || record "$name-${1}x${2}" FAIL "rc=$rc"
                done
                rm -f "$LOG/bb.txt"
            }
            batch_bench 7b-batch
            # perplexity's forwards: four 512-token chunks a forward (-b 2048, the default) against one
            for b in 512 2048; do
                timeout 200 python3 -m minfer perplexity -m "$TWIN" -f tests/fixtures/perplexity_gpl3.txt \
                    -c 512 -b $b >"$LOG/ppl.txt" 2>&1
                rc=$?
                cat "$LOG/ppl.txt" >>"$LOG/bench.log"
                v=$(grep -oP '^perplexity: \K.*' "$LOG/ppl.txt")
                [ $rc = 0 ] && [ -n "$v" ] && record "7b-ppl-b$b" ok "$v" || record "7b-ppl-b$b" FAIL "rc=$rc"
            done
            rm -f "$LOG/ppl.txt"
            # the deterministic mode's cost: the same batched bench in it (each row's engine fixed
            # by what the row is), and its decode steps against the default's, interleaved
            batch_bench 7b-det --deterministic
            for B in 8 32; do
                ab_step "ab-deterministic-b$B" -p 512 --batch $B --steps 32 -r ${AB_REPS:-5} \
                    --a deterministic=1 --b deterministic=0
            done
            # a decode step of B sequences: mmq_rows (tensor cores) against the dp4a matvec
            # of B rows up to 8 and the f16 engine beyond (settings.decode_mma_rows=0);
            # at B = 1 against the one-row matvec that a lone generation's step runs
            for B in 1 8 32; do
                ab_step "ab-decode-mvt-b$B" -p 512 --batch $B --steps 32 -r ${AB_REPS:-5} \
                    --a decode_mma_rows=64 --b decode_mma_rows=0
            done
        fi
        if [ "${GEMM_PATHS:-1}" = 1 ]; then      # the GEMM engine by prompt length (GEMM_PATHS=0 skips it)
            timeout 150 python3 -m scripts.bench.gemm_paths -r 7 >>"$LOG/bench.log" 2>&1 \
                && record gemm-paths ok "$(grep 'wins for the whole layer' "$LOG/bench.log" | tr '\n' ' ')" \
                || record gemm-paths FAIL "see bench.log"
        fi
    else
        record twin FAIL "see bench.log"
    fi
fi
cat "$LOG/bench.log" | tail -n 90
[ -f "$LOG/parity.txt" ] && cat "$LOG/parity.txt"

# summary, last
{
    echo
    echo "| step | status | key number |"
    echo "| --- | --- | --- |"
    for s in "${STEPS[@]}"; do echo "| $s | ${STATUS[$s]} | ${NOTE[$s]} |"; done
} | tee "$LOG/summary.md"
exit $FAILED
