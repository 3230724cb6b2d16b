# The copy's start as it is (K and V on two lanes), as one start (one launch, whole quota), and through the
# DMA engines (cudaMemcpyBatchAsync), in the prefetch pattern; then SparDA's decode with one start
timeout 100 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
import json, os
from sparda_jax.envinfo import environment
r = bench_pipeline(blocks=(240, 1920), ctas=(2, 16), threads=(256,), starts=('lanes', 'one', 'dma'), log=lambda m: None)
print(pipeline_table(r))
json.dump({'name': 'copy_pipeline', 'environment': environment(), 'command': 'scripts/probes/starts.sh',
           'pipeline': r}, open(os.environ['OUT'] + '/copy_pipeline_starts.json', 'w'), indent=1)"
timeout 90 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 16 --modes sparda \
  --reuse-fractions --real-miss-rate sparda=0.086 --budget-s 60 --repeats 16 --copy-start one \
  --out "$OUT/decode_one_start.json" 2>&1 | tail -5
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
  tests/test_copy_engine.py > "$OUT/gpu_tests_copy.log" 2>&1; tail -2 "$OUT/gpu_tests_copy.log"
