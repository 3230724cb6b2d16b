# Does the copy hide behind GEMMs that are not cuBLAS's? nvjet sm90 kernels hold a whole SM (168 regs x
# 384 threads, ~221 KB shared memory), so no copy CTA can share one; XLA's Triton GEMMs are not persistent
# and leave room. --xla_gpu_cublas_fallback=false drops cuBLAS from XLA's GEMM autotuning.
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_cublas_fallback=false" timeout 150 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
import json, os
from sparda_jax.envinfo import environment
r = bench_pipeline(blocks=(240, 1920), ctas=(2, 8, 16), threads=(256,), log=lambda m: None)
print('XLA_FLAGS=--xla_gpu_cublas_fallback=false'); print(pipeline_table(r))
json.dump({'name': 'copy_pipeline', 'environment': environment(), 'env': {'XLA_FLAGS': '--xla_gpu_cublas_fallback=false'},
           'command': 'scripts/probes/cublas_fallback.sh', 'pipeline': r}, open(os.environ['OUT'] + '/copy_pipeline_nocublas.json', 'w'), indent=1)"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_cublas_fallback=false" timeout 200 python3 -m sparda_jax.cli bench decode --lengths 131072 \
  --batches 16 --modes sparda sparda_sync --reuse-fractions --real-miss-rate sparda=0.086 --budget-s 130 --repeats 16 \
  --overlap --out "$OUT/decode_nocublas.json" 2>&1 | tail -12
