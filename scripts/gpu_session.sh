# One device-tool call on the H200 runs named benchmark specs (sparda_jax/bench/specs.py):
#   source scripts/device_setup.sh; bash scripts/gpu_session.sh decode-split4 [NAME ...]
# `bash scripts/gpu_session.sh --list` prints them. Results: $OUT/<benchmark>/<name>.json, log and run record beside.
# Carry .whl and .commit, and .model/smol.part* for the specs that need SmolLM2 (decode-real-model, realmodel, eval-tasks-*).
set -u
exec python3 -m sparda_jax.bench.specs --out "${OUT:-/tmp/out}" "$@"
