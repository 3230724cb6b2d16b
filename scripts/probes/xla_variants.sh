# The prefetch microbenchmark under XLA settings that could serialise the copy with XLA's work:
# CUDA graphs (command buffers) off, and the environment the process runs in (a container may
# set CUDA_DEVICE_MAX_CONNECTIONS=1, which puts every stream on one hardware queue). Also the
# 4d2db98 overlap benchmark (one start, one layer, whole cache through the barrier), which overlapped
# partly then (copy.json: 1.16-1.27 x max) while the pipelined pattern never has. (~150 s)
echo "env: $(env | grep -E '^(CUDA|NCCL|XLA|TF_)' | tr '\n' ' ')"
nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv,noheader 2>/dev/null
for flags in "" "--xla_gpu_enable_command_buffer="; do
XLA_FLAGS="${XLA_FLAGS:-} $flags" FLAGS_NAME="$flags" timeout 140 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, bench_overlap, pipeline_table
import json, os
from sparda_jax.envinfo import environment
name = os.environ['FLAGS_NAME'] or 'default'
r = bench_pipeline(blocks=(1920,), ctas=(16,), threads=(256,), starts=('lanes', 'one'), log=lambda m: None)
print('XLA flags:', name); print(pipeline_table(r))
o = bench_overlap(ctas=(16,), repeats=10)
for row in o['rows']:
    print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
tag = 'default' if name == 'default' else 'nocmdbuf'
json.dump({'name': 'copy_pipeline', 'environment': environment(), 'xla_flags': name,
           'env': {k: v for k, v in os.environ.items() if k.startswith(('CUDA', 'NCCL', 'XLA'))},
           'command': 'scripts/probes/xla_variants.sh', 'pipeline': r, 'overlap': o},
          open(os.environ['OUT'] + f'/copy_pipeline_xla_{tag}.json', 'w'), indent=1)" 2>&1 | grep -v "^\[pipeline\]"
done
