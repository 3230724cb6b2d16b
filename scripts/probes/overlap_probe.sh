# Does the engine's copy kernel run beside other kernels outside XLA (plain CUDA streams)? Builds and
# runs scripts/probes/overlap_probe.cu as the environment has it, then with CUDA_DEVICE_MAX_CONNECTIONS
# 1 and 32 (PROBE_CONNS), and with larger host pools (PROBE_POOLS, MiB) (~60 s for the default three);
# writes $OUT/overlap_probe.json with the commit and a table per run.
set -u
echo "env: $(env | grep -E '^(CUDA|NCCL)' | tr '\n' ' ')"
nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv,noheader 2>/dev/null
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
inc=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
rm -f /tmp/overlap_probe /tmp/overlap_probe_*.jsonl
"$NVCC" -O3 -std=c++17 -arch=sm_90 -diag-suppress 940,2473 -I kernels/copy -I "$inc" scripts/probes/overlap_probe.cu \
  -o /tmp/overlap_probe -ldl
if [ ! -x /tmp/overlap_probe ]; then echo "overlap probe: build failed ($NVCC)"; exit 0; fi
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cublas=$(find "$site" /usr/local/cuda*/lib64 -name 'libcublas.so*' 2>/dev/null | grep -v Lt | head -1)
echo "cublas: ${cublas:-none}"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# PROBE_CONNS: the CUDA_DEVICE_MAX_CONNECTIONS runs (inherited = as the environment has it);
# PROBE_POOLS: the host pools' sizes in MiB (each of K and V), one run each with inherited connections
for conn in ${PROBE_CONNS-inherited 1 32}; do
  if [ "$conn" = inherited ]; then
    timeout 150 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe_$conn.jsonl
  else
    CUDA_DEVICE_MAX_CONNECTIONS=$conn timeout 150 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe_$conn.jsonl
  fi
  echo "run $conn: rc $?"
done
for mib in ${PROBE_POOLS-}; do
  OVERLAP_PROBE_POOL_MIB=$mib timeout 200 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe_pool$mib.jsonl
  echo "run pool $mib MiB: rc $?"
done
python3 scripts/probes/overlap_summary.py /tmp/overlap_probe_*.jsonl
