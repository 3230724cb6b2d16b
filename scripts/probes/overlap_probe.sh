# Does the engine's copy kernel run beside other kernels outside XLA (plain CUDA streams)? Builds and
# runs scripts/probes/overlap_probe.cu as the environment has it, then with CUDA_DEVICE_MAX_CONNECTIONS
# 1 and 32 (~40 s); writes $OUT/overlap_probe.json with the commit and a table per run.
set -u
echo "env: $(env | grep -E '^(CUDA|NCCL)' | tr '\n' ' ')"
inc=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
nvcc -O3 -std=c++17 -arch=sm_90 -I kernels/copy -I "$inc" scripts/probes/overlap_probe.cu -o /tmp/overlap_probe -ldl \
  2>&1 | grep -iE "error" || true
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cublas=$(find "$site" /usr/local/cuda*/lib64 -name 'libcublas.so*' 2>/dev/null | grep -v Lt | head -1)
echo "cublas: ${cublas:-none}"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rm -f /tmp/overlap_probe_*.json
for conn in inherited 1 32; do
  if [ "$conn" = inherited ]; then
    timeout 120 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe_$conn.json
  else
    CUDA_DEVICE_MAX_CONNECTIONS=$conn timeout 120 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe_$conn.json
  fi
  echo "run $conn: rc $?"
done
python3 - <<'PY'
import glob, json, os
runs = []
for f in sorted(glob.glob('/tmp/overlap_probe_*.json')):
    try:
        runs.append(dict(json.load(open(f)), run=os.path.basename(f)[14:-5]))
    except ValueError as e:
        print(f, 'unreadable:', e)
json.dump({'name': 'overlap_probe', 'commit': os.environ.get('SPARDA_COMMIT'), 'command': 'scripts/probes/overlap_probe.sh',
           'runs': runs}, open(os.environ['OUT'] + '/overlap_probe.json', 'w'), indent=1)
for d in runs:
    print(f"\nCUDA_DEVICE_MAX_CONNECTIONS: {d['run']} (process saw '{d['CUDA_DEVICE_MAX_CONNECTIONS']}'), {d['sms']} SMs")
    alone = {(c['case'], c['work'], c['ctas']): c for c in d['cases']}
    print(f"{'case':13} {'work':26} {'cp':>2} {'ctas':>4} {'first':>5} {'copy ms':>8} {'work ms':>8} {'total':>8} {'/max':>6} {'/sum':>6}")
    for c in d['cases']:
        line = (f"{c['case']:13} {c['work']:26} {c['copies']:2d} {c['ctas']:4d} {str(c['copy_first'])[0]:>5} "
                f"{c['copy_ms']:8.3f} {c['work_ms']:8.3f} {c['total_ms']:8.3f}")
        ref = None
        if c['case'] == 'together':
            ref = (alone[('copy_alone', 'none', c['ctas'])]['copy_ms'], alone[('work_alone', c['work'], 16)]['work_ms'])
        elif c['case'] in ('two_spins', 'spin_and_copy'):
            sp = alone[('spin_alone', 'spin', 1)]['work_ms']
            ref = (sp, sp) if c['case'] == 'two_spins' else (alone[('copy_alone', 'none', 16)]['copy_ms'], sp)
        if ref:
            line += f" {c['total_ms'] / max(ref):6.2f} {c['total_ms'] / sum(ref):6.2f}"
        print(line)
PY
