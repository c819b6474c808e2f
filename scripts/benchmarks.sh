#!/usr/bin/env bash
# The benchmarks in one call; JSON results and the printed tables go under $OUT.
#   scripts/benchmarks.sh [--quick]          every benchmark
#   BENCHMARKS="decode" scripts/benchmarks.sh  only those named (files in benchmarks/)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for name in ${BENCHMARKS:-lora_linear decode}; do
    python3 "benchmarks/$name.py" --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -60
done
