#!/usr/bin/env bash
# Every GPU check of ampkit in one prepared run, for a session lent the H200.
#
#   bash benchmarks/gpu_session.sh [PART ...]      (default: all parts, in this order)
#
# Parts and their time limits (estimates until a first run replaces them):
#   tests      pytest -m gpu: the CUDA cases of the suite (fp8 attention
#              compiles its 3 Triton kernels there)                   limit 150 s
#   autocast   benchmarks/bench_autocast.py --device cuda               limit  30 s
#   scaler     benchmarks/bench_scaler.py --device cuda                 limit  45 s
#   optlevels  benchmarks/bench_optlevels.py (GPT + ResNet-50)          limit 200 s
#   host       benchmarks/bench_host.py --device cuda --rounds 10: ops
#              (launches), syncs, Python calls, thread/wall/GPU time per
#              step vs torch.amp                                        limit  75 s
#   fp8gemm    benchmarks/bench_fp8.py --only gemm (7 shapes, 14 small
#              compiles, inductor GEMM backends ATEN)                   limit  90 s
#   fp8mlp     benchmarks/bench_fp8.py --only mlp (9 variants, 6 compiled) limit 150 s
#   bench      ampkit bench on the GPT default, JSON + plot             limit  90 s
#   fp8attn    benchmarks/bench_fp8_attention.py: fp8 Triton kernels vs
#              torch bf16 attention, fwd and fwd+bwd, gpt + long shapes limit  90 s
# A device call may run 600 s at most and the session has 15 min of device time in all
# (the machine's start included), so use two calls on one warm machine:
#   bash benchmarks/gpu_session.sh tests autocast scaler optlevels host   (limits 500 s)
#   bash benchmarks/gpu_session.sh fp8gemm fp8mlp bench                   (limits 330 s)
# and, with device time left (not in the default list: issue 14's targets come first),
#   bash benchmarks/gpu_session.sh fp8attn                                (limit   90 s)
# (the old part name fp8 runs fp8gemm then fp8mlp). Each part runs under
# `timeout -s INT -k 15 LIMIT`: at its limit the part gets SIGINT, the benchmark scripts
# write the JSON they have (they rewrite it after every completed row anyway, and a
# failing case is an error row, not the end of the run) and exit 130, and KILL follows
# 15 s later. Results go to $OUT (the device tool's folder) or out/ here: one JSON per
# benchmark part (bench also a PNG) and one log for all the parts of a call,
# gpu_session.log (appended to), so a call returns at most 5 files (the tool returns 8).
# torchao 0.17 for the fp8 reference must travel as a wheel in .whl/ (ignored by git;
# name it in the device call's carry); the script installs it from there when present.
# Fetch it with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl torchao==0.17.0
# (torchao-0.17.0-cp310-abi3-manylinux_2_24/2_28_x86_64, 3.2 MB; checked 2026-11-30).
# The suite and every script below also ran under torch 2.11.0 (the H200's version) on
# a CPU on 2026-11-30.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests autocast scaler optlevels host fp8gemm fp8mlp bench)
# Every name is checked before any part runs: a typo must not cost the parts before it.
for part in "${parts[@]}"; do
    case $part in
        tests|autocast|scaler|optlevels|host|fp8gemm|fp8mlp|fp8|bench|fp8attn) ;;
        *) echo "unknown part '$part'; valid: tests autocast scaler optlevels host fp8gemm" \
               "fp8mlp bench fp8attn (fp8 = fp8gemm fp8mlp); nothing was run" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

log="$out/gpu_session.log"
run_part() {  # name, timeout seconds, command...
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$log"
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    case $rc in
        124) note=" (reached its ${limit}s limit: interrupted; partial results kept)" ;;
        137) note=" (killed 15 s after its interrupt: its JSON holds the last completed row)" ;;
        130) note=" (interrupted)" ;;
        *) note="" ;;
    esac
    echo "=== $name exit $rc$note $(date +%T)" | tee -a "$log"
    rm -f "$out"/.*.tmp  # a temp file of a write that was killed: not a result
}

for part in "${parts[@]}"; do
    case $part in
        tests) run_part tests 150 python3 -m pytest -m gpu -rfEs -p no:cacheprovider ;;
        autocast) run_part autocast 30 python3 benchmarks/bench_autocast.py --device cuda \
            --json "$out/bench_autocast.json" ;;
        scaler) run_part scaler 45 python3 benchmarks/bench_scaler.py --device cuda \
            --json "$out/bench_scaler.json" ;;
        optlevels) run_part optlevels 200 python3 benchmarks/bench_optlevels.py --device cuda \
            --json "$out/bench_optlevels.json" ;;
        host) run_part host 75 python3 benchmarks/bench_host.py --device cuda --rounds 10 \
            --json "$out/bench_host_cuda.json" ;;
        fp8gemm) run_part fp8gemm 90 python3 benchmarks/bench_fp8.py --device cuda --only gemm \
            --gemm-backends ATEN --json "$out/bench_fp8_gemm.json" ;;
        fp8mlp) run_part fp8mlp 150 python3 benchmarks/bench_fp8.py --device cuda --only mlp \
            --gemm-backends ATEN --json "$out/bench_fp8_mlp.json" ;;
        fp8) run_part fp8gemm 90 python3 benchmarks/bench_fp8.py --device cuda --only gemm \
                 --gemm-backends ATEN --json "$out/bench_fp8_gemm.json"
             run_part fp8mlp 150 python3 benchmarks/bench_fp8.py --device cuda --only mlp \
                 --gemm-backends ATEN --json "$out/bench_fp8_mlp.json" ;;
        fp8attn) run_part fp8attn 90 python3 benchmarks/bench_fp8_attention.py --device cuda \
            --shapes gpt,long --iters 10 --emulate no --json "$out/bench_fp8_attention.json" ;;
        bench) run_part bench 90 python3 -m ampkit.cli bench --device cuda --quiet \
            --json "$out/bench_gpt.json" --plot "$out/bench_gpt.png" ;;
    esac
done
