#!/usr/bin/env bash
# Every benchmark in one call; JSON results and the printed tables go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 benchmarks/lora_linear.py --out "$OUT/lora_linear.json" "$@" 2>&1 | tee "$OUT/lora_linear.txt" | tail -100
