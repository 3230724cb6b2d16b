# Stages for a device-tool call on the H200, one or more per call (each ends well inside 10 min):
#   source scripts/device_setup.sh; bash scripts/gpu_session.sh tests copy
# Carry .whl and .commit (and .model/smol.part01 after a call that carried part00 when a stage
# needs SmolLM2: eval-tasks, train).
set -u
OUT=${OUT:-/tmp/out}
for stage in "$@"; do
  case "$stage" in
    tests)       # every GPU-marked test: cuDNN dense path, CUDA copy engine
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -15 ;;
    copy)        # bench: UVA gather vs bulk vs XLA loop vs host gather, CTA sweep
      timeout 300 python3 -m sparda_jax.cli bench copy --repeats 20 --out "$OUT/copy.json" 2>&1 | tail -60 ;;
    train32k)    # the 8B Forecast step at 32K (fits since the fused-gradient loss)
      timeout 300 python3 -m sparda_jax.cli bench train --preset minicpm4.1-8b --seq-len 32768 --repeats 3 \
        --out "$OUT/train_32k.json" 2>&1 | tail -8 ;;
    train64k)    # the paper's MiniCPM training length
      timeout 400 python3 -m sparda_jax.cli bench train --preset minicpm4.1-8b --seq-len 65536 --repeats 2 \
        --out "$OUT/train_64k.json" 2>&1 | tail -8 ;;
    eval-tasks)  # the accuracy table: every task, every mode, 2K..8K (1K equals dense at budget 24: eval/results/tasks_smollm2_partial.md)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 560 python3 -m sparda_jax.cli eval --suite tasks \
        --lengths 2048 4096 8192 --samples 20 --out "$OUT/tasks_smollm2.json" 2>&1 | tail -40 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
