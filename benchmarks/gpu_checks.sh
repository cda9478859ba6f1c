#!/usr/bin/env bash
# On a CUDA machine: the GPU-marked tests, then the benchmarks. Output also goes to $OUT if set.
# The Qwen4Exp references need transformers >= 5.24 (its indexed_attention layers): carry that wheel
# to a machine with an older one.
#   bash benchmarks/gpu_checks.sh [tests|attention|engine|quick|moe|moe-engine|mla|kimi|nvfp4|dflash]...   (default: tests attention engine)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
for part in "${@:-tests attention engine}"; do
  for p in $part; do
    case $p in
      tests) python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/models tests/kernels tests/layers tests/engine tests/speculative 2>&1 | tee "$out/gpu_tests.log" ;;
      attention) python3 benchmarks/attention_bench.py 2>&1 | tee "$out/attention_bench.log" ;;
      engine) python3 benchmarks/gpu_bench.py --json "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.log" ;;
      quick) python3 benchmarks/gpu_bench.py --quick 2>&1 | tee "$out/gpu_bench_quick.log" ;;
      moe) python3 benchmarks/moe_bench.py --sweep --json "$out/moe_bench.json" 2>&1 | tee "$out/moe_bench.log" ;;
      moe-engine) python3 benchmarks/moe_gpu_bench.py --json "$out/moe_gpu_bench.json" 2>&1 | tee "$out/moe_gpu_bench.log" ;;
      nvfp4) python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/kernels/test_nvfp4_kernels.py \
               tests/kernels/test_fp8_experts_kernels.py tests/quantization/test_dual_weights.py 2>&1 | tee "$out/nvfp4_gpu_tests.log"
             for q in nvfp4-linears nvfp4-decode nvfp4-moe dual-prefill; do
               python3 benchmarks/quant_gpu_bench.py --only $q --json "$out/quant_$q.json" 2>&1 | tee "$out/quant_$q.log"
             done ;;
      mla) python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/kernels/test_mla_kernels.py tests/kernels/test_mla_layer.py tests/models/test_deepseek.py 2>&1 | tee "$out/mla_gpu_tests.log"
           python3 benchmarks/mla_bench.py --json "$out/mla_bench.json" 2>&1 | tee "$out/mla_bench.log"
           python3 benchmarks/mla_engine_bench.py --json "$out/mla_engine_bench.json" 2>&1 | tee "$out/mla_engine_bench.log" ;;
      dflash) python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/speculative/test_dflash_cuda_graphs.py \
                tests/kernels/test_paged_attention.py -k "dflash or non_causal" 2>&1 | tee "$out/dflash_gpu_tests.log"
              for q in rates steps cycle batch16; do
                python3 benchmarks/dflash_bench.py --parts $q --json "$out/dflash_$q.json" 2>&1 | tee "$out/dflash_$q.log"
              done ;;
      kimi) python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/models/test_kimi_linear.py tests/models/test_raon.py tests/kernels/test_kda_layer.py 2>&1 | tee "$out/kimi_gpu_tests.log"
            python3 benchmarks/mla_engine_bench.py --model kimi --json "$out/kimi_engine_bench.json" 2>&1 | tee "$out/kimi_engine_bench.log" ;;
    esac
  done
done
