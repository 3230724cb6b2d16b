# The deeper copy kernel (blocks moved as groups, 16 loads per thread in flight) in the prefetch pattern and
# in the engine's decode (sparda and sparda_sync at batch 16, random traffic and SmolLM2's miss rate)
timeout 150 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
import json, os
from sparda_jax.envinfo import environment
r = bench_pipeline(blocks=(240, 1920), ctas=(2, 4, 8, 16), threads=(256,), groups=(4, 8), log=lambda m: None)
print(pipeline_table(r))
json.dump({'name': 'copy_pipeline', 'environment': environment(), 'command': 'scripts/probes/copy_group.sh',
           'pipeline': r}, open(os.environ['OUT'] + '/copy_pipeline_group.json', 'w'), indent=1)"
timeout 200 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 16 --modes sparda sparda_sync \
  --reuse-fractions --real-miss-rate sparda=0.086 --budget-s 130 --repeats 16 --overlap --copy-group 4 \
  --out "$OUT/decode_group4.json" 2>&1 | tail -12
