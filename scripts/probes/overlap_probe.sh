# Does the engine's copy kernel run beside other kernels outside XLA (plain CUDA streams)? Builds and
# runs scripts/probes/overlap_probe.cu (~20 s); writes $OUT/overlap_probe.json with the commit.
set -u
inc=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
nvcc -O3 -std=c++17 -arch=sm_90 -I kernels/copy -I "$inc" scripts/probes/overlap_probe.cu -o /tmp/overlap_probe -ldl \
  2>&1 | grep -v "warning #940\|^ *}\|^ *^\|^$" || true
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cublas=$(find "$site" /usr/local/cuda*/lib64 -name 'libcublas.so*' 2>/dev/null | grep -v Lt | head -1)
echo "cublas: ${cublas:-none}"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 120 /tmp/overlap_probe ${cublas:+"$cublas"} > /tmp/overlap_probe.json && python3 - <<'PY'
import json, os
d = json.load(open('/tmp/overlap_probe.json'))
d['commit'] = os.environ.get('SPARDA_COMMIT'); d['command'] = 'scripts/probes/overlap_probe.sh'
json.dump(d, open(os.environ['OUT'] + '/overlap_probe.json', 'w'), indent=1)
alone = {(c['case'], c['work'], c['ctas']): c for c in d['cases']}
print(f"{'case':12} {'work':26} {'cp':>2} {'ctas':>4} {'first':>5} {'copy ms':>8} {'work ms':>8} {'total':>8} {'/max':>6} {'/sum':>6}")
for c in d['cases']:
    line = f"{c['case']:12} {c['work']:26} {c['copies']:2d} {c['ctas']:4d} {str(c['copy_first'])[0]:>5} {c['copy_ms']:8.3f} {c['work_ms']:8.3f} {c['total_ms']:8.3f}"
    if c['case'] == 'together':
        cp, wk = alone[('copy_alone', 'none', c['ctas'])]['copy_ms'], alone[('work_alone', c['work'], 16)]['work_ms']
        line += f" {c['total_ms'] / max(cp, wk):6.2f} {c['total_ms'] / (cp + wk):6.2f}"
    print(line)
PY
