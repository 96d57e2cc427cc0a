#!/usr/bin/env bash
# Every GPU check of ampkit in one prepared run, for a session lent the H200.
#
#   bash benchmarks/gpu_session.sh [PART ...]      (default: all parts, in this order)
#
# Parts and their time limits (estimates until a first run replaces them):
#   tests      pytest -m gpu: the CUDA cases of the suite             limit 120 s
#   autocast   benchmarks/bench_autocast.py --device cuda               limit  45 s
#   scaler     benchmarks/bench_scaler.py --device cuda                 limit  60 s
#   optlevels  benchmarks/bench_optlevels.py (GPT + ResNet-50)          limit 180 s
#   fp8        benchmarks/bench_fp8.py --only gemm,mlp (compiled)       limit 200 s
#   bench      ampkit bench on the GPT default, JSON + plot             limit 120 s
#   host       benchmarks/bench_host.py --device cuda: ops (launches),
#              syncs, Python calls and host time per step vs torch.amp  limit 150 s
# A device call may run 600 s at most, so use two calls on one warm machine:
#   bash benchmarks/gpu_session.sh tests autocast scaler optlevels     (<= 405 s)
#   bash benchmarks/gpu_session.sh fp8 bench host                      (<= 470 s)
# Each part runs under its own timeout so one slow part cannot eat the lease; results
# (JSON, logs, PNG) go to $OUT (the device tool's folder) or out/ here. torchao 0.17 for
# the fp8 reference must travel as a wheel in .whl/ (ignored by git; name it in the
# device call's carry); the script installs it from there when present. Fetch it with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl torchao==0.17.0
# (torchao-0.17.0-cp310-abi3-manylinux_2_24/2_28_x86_64, 3.2 MB; checked 2026-11-30).
# The suite and every script below also ran under torch 2.11.0 (the H200's version) on
# a CPU on 2026-11-30.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests autocast scaler optlevels fp8 bench host)

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

run_part() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]}"
}

for part in "${parts[@]}"; do
    case $part in
        tests) run_part tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider ;;
        autocast) run_part autocast 45 python3 benchmarks/bench_autocast.py --device cuda \
            --json "$out/bench_autocast.json" ;;
        scaler) run_part scaler 60 python3 benchmarks/bench_scaler.py --device cuda \
            --json "$out/bench_scaler.json" ;;
        optlevels) run_part optlevels 180 python3 benchmarks/bench_optlevels.py --device cuda \
            --json "$out/bench_optlevels.json" ;;
        fp8) run_part fp8 200 python3 benchmarks/bench_fp8.py --device cuda --only gemm,mlp \
            --json "$out/bench_fp8.json" ;;
        bench) run_part bench 120 python3 -m ampkit.cli bench --device cuda --quiet \
            --json "$out/bench_gpt.json" --plot "$out/bench_gpt.png" ;;
        host) run_part host 150 python3 benchmarks/bench_host.py --device cuda --rounds 15 \
            --json "$out/bench_host_cuda.json" ;;
        *) echo "unknown part '$part'; valid: tests autocast scaler optlevels fp8 bench host"; exit 2 ;;
    esac
done
