#!/usr/bin/env bash
# The benchmarks in one call; JSON results and the printed tables go under $OUT.
#   scripts/benchmarks.sh [--quick]                every benchmark
#   BENCHMARKS="decode_moe" scripts/benchmarks.sh  only those named
#   GPUS=2 scripts/benchmarks.sh                   the generate_* systems side by side, one GPU each
#   LATEST_WHEELS=<dir> scripts/benchmarks.sh      the wheels there (the newest transformers, peft) first
# The stream and tier benchmarks run only when named (BENCHMARKS="stream stream_base tiers"); so do
# the stream's whole generate_batch calls (stream_calls, stream_calls_8b, stream_calls_moe; a second run of the same
# entry, e.g. stream_calls_warm, finds Inductor's and Triton's caches filled: the warm setup) and
# the decode step's profile (profile_8b, profile_1b), the stream's prefill's (profile_prefill) and where the stream's setup goes (setup_stream, setup_stream_8b).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
if [ -n "${LATEST_WHEELS:-}" ]; then
    pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/latest-site "$LATEST_WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/latest-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -A RUNS=(
    [lora_linear]="lora_linear.py"
    [decode_attention]="decode_attention.py"
    [decode]="decode.py --model llama"
    [decode_moe]="decode.py --model qwen3_moe"
    [generate]="generate.py --model llama --gpus ${GPUS:-1}"
    [generate_moe]="generate.py --model qwen3_moe --gpus ${GPUS:-1}"
    [generate_fp8]="generate.py --model llama --quant fp8 --adapters 4,16 --systems fxlora,transformers --gpus ${GPUS:-1}"
    [generate_moe_fp8]="generate.py --model qwen3_moe --quant fp8 --adapters 4,16 --systems fxlora,transformers --gpus ${GPUS:-1}"
    [stream]="stream.py --model llama --systems stream,static"
    [stream_base]="stream.py --model llama --adapters 0 --systems stream,static,transformers-compiled"
    [stream_8b]="stream.py --model llama8b --systems stream,static"
    [stream_8b_base]="stream.py --model llama8b --adapters 0 --systems stream,static"
    [stream_calls]="generate.py --model llama --systems fxlora --stream"
    [stream_calls_warm]="generate.py --model llama --systems fxlora --stream"
    [stream_calls_8b]="generate.py --model llama8b --systems fxlora --stream"
    [stream_calls_8b_warm]="generate.py --model llama8b --systems fxlora --stream"
    [stream_calls_moe]="generate.py --model qwen3_moe --systems fxlora --stream"
    [profile_8b]="profile_step.py --model llama8b --batch 1,32,128 --inner inductor"
    [profile_1b]="profile_step.py --model llama --batch 1,32,128 --inner inductor"
    [profile_prefill]="profile_step.py --model llama --batch 32 --prefill 128 --stream --inner inductor"
    [setup_stream]="setup_time.py --stream"
    [setup_stream_8b]="setup_time.py --model llama8b --stream"
    [tiers]="tiers.py --slots 256,16,64"
)
for name in ${BENCHMARKS:-lora_linear decode_attention decode decode_moe generate generate_moe generate_fp8 generate_moe_fp8}; do
    # shellcheck disable=SC2086  # the entry holds the script and its arguments
    python3 benchmarks/${RUNS[$name]} --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -60
done
