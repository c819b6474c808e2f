#!/usr/bin/env bash
# The whole GPU test suite: the CUDA-only tests, the kernel tests on CUDA (all dtypes), and the
# reference-op and pass tests, in one call or in two halves (GPU_PART=1, GPU_PART=2). Results go
# under $OUT (or ./gpu-out). The tests run in $GPU_WORKERS processes (default 6) sharing the GPU:
# most of their time is Triton compiling kernels, which the processes do side by side. Without a network the test packages
# install from ./.wheels, which this fills for a Python 3.12 machine:
#   pip download -d .wheels --python-version 3.12 --only-binary :all: hypothesis pytest-xdist torchao bitsandbytes
# With LATEST_WHEELS=<dir>, the wheels there (e.g. the newest transformers, fetched the same
# way with --no-deps) are put ahead of the machine's own packages first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
python3 -c "import hypothesis, xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .wheels hypothesis sortedcontainers pytest-xdist execnet
for package in torchao bitsandbytes; do  # the quantised bases
    python3 -c "import $package" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .wheels "$package"
done
if [ -n "${LATEST_WHEELS:-}" ]; then
    pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/latest-site "$LATEST_WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/latest-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
# two halves of about equal time (~2,500 s of tests over 6 workers in all), so that each fits a
# device call of 10 minutes: GPU_PART=1 or 2; both by default
PART1="tests/test_gpu.py tests/test_gpu_moe.py tests/test_gpu_runtime.py"
PART2="tests/test_kernel_sgmv.py tests/test_kernel_bgmv.py tests/test_kernel_lora_linear.py tests/test_kernel_lora_embedding.py \
    tests/test_kernel_lora_embedding_delta.py tests/test_kernel_lora_conv_delta.py tests/test_kernel_lora_weight_rows.py tests/test_kernel_lora_grouped_delta.py \
    tests/test_kernel_batch_info.py tests/test_kernel_moe_lora.py tests/test_passes.py tests/test_kernel_decode_attention.py \
    tests/test_pass_decode_attention.py tests/test_inner.py tests/test_kernel_lora_delta.py tests/test_kernel_lora_shrink.py \
    tests/test_coverage.py tests/test_kernel_grouped_mm.py tests/test_gpu_quantized.py tests/test_kernel_paged_decode_attention.py \
    tests/test_gpu_stream.py"
case "${GPU_PART:-all}" in 1) TESTS=$PART1 ;; 2) TESTS=$PART2 ;; *) TESTS="$PART1 $PART2" ;; esac
# shellcheck disable=SC2086  # the lists are words
python3 -m pytest -q -p no:cacheprovider $TESTS \
    -n "${GPU_WORKERS:-6}" -v --durations=20 --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.txt" \
    | grep -vE "^\s*$|PASSED" | tail -40
