for c in 32 2; do
CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 120 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
import json, os
r = bench_pipeline(blocks=(240, 1920), ctas=(2, 8, 16), threads=(256,), log=lambda m: None)
print('CUDA_DEVICE_MAX_CONNECTIONS=$c'); print(pipeline_table(r))
json.dump(r, open(os.environ['OUT'] + '/copy_pipeline_conn$c.json', 'w'), indent=1)"
done
