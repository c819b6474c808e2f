#!/usr/bin/env bash
# Tensor parallelism on two GPUs in one call: the NCCL tests (tests/test_gpu_tensor_parallel.py:
# two ranks against one GPU, bf16, CUDA graphs with the collectives inside, the request stream;
# about 300 s with both cases side by side) and the decode
# benchmark at tp=2 against tp=1 (benchmarks/decode_tp.py). Results go under $OUT (or
# ./gpu-out). NVLink multicast stays off here and in every program started from here.
#   scripts/gpu_tests_tp.sh [--quick]    --quick: the benchmark's smaller batch sizes
#   LATEST_WHEELS=<dir> scripts/gpu_tests_tp.sh  the wheels there (the newest transformers, peft) first
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import hypothesis" 2>/dev/null || pip install -q --no-index --find-links .wheels hypothesis sortedcontainers
if [ -n "${LATEST_WHEELS:-}" ]; then  # the newest transformers and peft, as scripts/gpu_tests.sh takes them
    pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/latest-site "$LATEST_WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/latest-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu-tp.txt"
nvidia-smi topo -m | tee -a "$OUT/gpu-tp.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpu-tp.txt"
# the two cases side by side (each on both GPUs): their time is mostly compiling, on the CPUs
for case in llama qwen3_moe; do
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py -k "[$case]" -rfE \
        --junitxml="$OUT/gpu-tp-$case.xml" > "$OUT/gpu-tp-$case.txt" 2>&1 &
done
wait
for case in llama qwen3_moe; do grep -v "^\s*$" "$OUT/gpu-tp-$case.txt" | tail -20; done
python3 benchmarks/decode_tp.py --out "$OUT/decode_tp.json" "$@" 2>&1 | tee "$OUT/decode_tp.txt" | tail -30
