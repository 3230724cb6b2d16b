# The sparse-native SmolLM2 on one GPU: its adapter (`sparda finetune --objective distill`), its
# Forecast, and their evaluation on held-out text, as one chain in the background (setsid) that
# outlives the device call; calls only poll. Its progress: /root/sn/log.
#
#   source scripts/device_setup.sh     # the GGUF joined, the corpus in /root/data
#   bash scripts/sn_study.sh start     # the chain below
#   bash scripts/sn_study.sh status    # the chain's log, the runs' steps
#   bash scripts/sn_study.sh collect   # records, JSONs, adapter and Forecast under $OUT/sn_study
#
#   bash scripts/sn_study.sh place     # first in every later call: puts the chain's files back
#
# A device machine can be lost mid-chain: end every poll with `collect`, so what the chain has made
# so far (its adapter once trained, its Forecast, records) is here already; a later machine goes on
# with ADAPTER=that adapter (no training) and FC_RUN's Forecast started again.
#
# Chain: the adapter (ADAPTER=FILE: that file instead of training; FT_STEPS, FT_SEQ, FT_BATCH, FT_COPY,
# FT_SELECT (--select-weight), FT_LR (--lr, default 5e-4), FT_INIT (--init-adapter, e.g. shipped)) -> in parallel: the model's
# dense / sparse baselines (copy + selection suites, every split, 4K and 8K) and its Forecast
# (`forecast_study.sh start $FC_RUN SN_STEPS`, FC_RUN default sn_forecast) -> the Forecast's
# evaluation and `sparda demo` at 4K and 8K with Dense+, Sparse and SparDA. SN_STEPS=0: the
# adapter and its baselines only.
set -u
DATA=${DATA:-/root/data}
FC_RUN=${FC_RUN:-sn_forecast}
SN=/root/sn
RUNS=${RUNS:-/root/study}
W=sparda_jax/weights
mkdir -p "$SN" "$RUNS/eval"
log() { echo "$(date +%T) $*" >> "$SN/log"; }

# Each device call copies the local tree over the machine's, the package's weights included: a file
# put there (or replaced) by the chain is gone or reverted after the next call. So the chain keeps
# its adapter and Forecast under $SN and puts them in place again just before each command that
# loads them (each reads them once, at its start).
place() {
  cp "$SN/adapter.safetensors" "$W/adapter-smollm2-135m-sparse.safetensors"
  [ -f "$SN/forecast.safetensors" ] && cp "$SN/forecast.safetensors" "$W/forecast-smollm2-135m-sparse.safetensors"
  return 0
}

chain() {
  if [ -n "${ADAPTER:-}" ]; then
    cp "$ADAPTER" "$W/adapter-smollm2-135m-sparse.safetensors" || { log "no adapter $ADAPTER"; return 1; }
  else
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 sparda finetune --model smollm2-135m --data "$DATA" --out "$SN/ft" \
      --seq-len "${FT_SEQ:-4096}" --steps "${FT_STEPS:-400}" --batch "${FT_BATCH:-8}" --micro-batch 2 --lr "${FT_LR:-5e-4}" --rank 32 \
      --save-every 25 --eval-every 50 --eval-seqs 2 --repeat-share 0.25 --scatter-share 0.25 \
      --objective distill --copy-weight "${FT_COPY:-0}" --select-weight "${FT_SELECT:-0}" \
      ${FT_INIT:+--init-adapter $FT_INIT} > "$SN/ft.log" 2>&1 || { log "finetune failed: $(tail -n 3 "$SN/ft.log")"; return 1; }
    # a run whose held-out dense NLL rose past 0.05 nats diverged (an 8K run at select weight 2 and
    # lr 5e-4 did): its Forecast and evaluation would waste the machine
    python3 -c "import json,sys; r=[json.loads(l) for l in open('$SN/ft/metrics.jsonl') if 'heldout_dense' in l]
sys.exit(r[-1]['heldout_dense'] - r[0]['heldout_dense'] > 0.05)" || { log "adapter diverged: held-out dense NLL rose past 0.05 nats; chain stopped"; return 1; }
    cp "$SN/ft/adapter.safetensors" "$W/adapter-smollm2-135m-sparse.safetensors"
  fi
  cp "$W/adapter-smollm2-135m-sparse.safetensors" "$SN/adapter.safetensors"
  log "adapter in place"
  place
  EVAL_MODEL=smollm2-135m-sparse BASE_TAG=_sn BASE_MODES="dense sparse" EVAL_JOBS=2 \
    bash scripts/forecast_study.sh eval >> "$SN/log" 2>&1 &
  if [ "${SN_STEPS:-600}" = 0 ]; then  # the adapter's own baselines only (a control arm): no Forecast
    wait; log "chain done (SN_STEPS=0: baselines only)"; return 0
  fi
  FRACTION=0.2 bash scripts/forecast_study.sh start "$FC_RUN" "${SN_STEPS:-600}" >> "$SN/log"
  sleep 30
  WAIT_S=100000 bash scripts/forecast_study.sh wait "$FC_RUN" >> "$SN/log"
  cp "$RUNS/$FC_RUN/forecast.safetensors" "$SN/forecast.safetensors" || { log "no Forecast"; wait; return 1; }
  place
  for c in 4096 8128; do  # 8K: the prompt and 32 new tokens within the model's 8192
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 sparda demo --model smollm2-135m-sparse --dtype bfloat16 --context $c \
      --systems dense_resident sparse sparda --json "$SN/demo_$c.json" > "$SN/demo_$c.log" 2>&1 &
  done
  place
  BASELINES=0 EVAL_JOBS=2 EVAL_MODEL=smollm2-135m-sparse bash scripts/forecast_study.sh eval "$FC_RUN" >> "$SN/log" 2>&1
  wait
  log "chain done"
}

case "${1:-status}" in
  start)
    python3 -c "import gguf" || { echo "gguf is not importable: carry .whl"; exit 1; }
    [ -f "$DATA/manifest.json" ] || { echo "no corpus in $DATA: carry .data"; exit 1; }
    [ -n "${SPARDA_SMOLLM2_GGUF:-}" ] || { echo "no SmolLM2 GGUF: carry .model0 and .model1"; exit 1; }
    export -f chain log place; export DATA SN RUNS W FC_RUN
    setsid nohup bash -c chain >> "$SN/log" 2>&1 < /dev/null &
    echo "started; log $SN/log" ;;
  place) [ -f "$SN/adapter.safetensors" ] && place; true ;;
  status)
    tail -n 12 "$SN/log" 2>/dev/null
    tail -c 400 "$SN/ft.log" 2>/dev/null | tr '\r' '\n' | tail -n 2
    bash scripts/forecast_study.sh status 2>/dev/null | grep -A1 "$FC_RUN" ;;
  collect)  # at most 8 files come back from a call
    dst=${OUT:-/tmp/out}/sn_study; mkdir -p "$dst"
    tar czf "$dst/records.tgz" -C / --ignore-failed-read root/sn/log root/sn/ft.log root/sn/ft/metrics.jsonl \
      root/sn/ft/config.json root/sn/ft/metrics.png $(cd / && ls root/sn/demo_* root/study/eval/*_sn_* \
      root/study/eval/${FC_RUN}_* root/study/$FC_RUN/metrics.jsonl root/study/$FC_RUN/config.json \
      root/study/$FC_RUN/metrics.png 2>/dev/null)
    cp "$SN/adapter.safetensors" "$SN/forecast.safetensors" "$dst/" 2>/dev/null
    ls -la "$dst" ;;
  *) sed -n '1,16p' "$0"; exit 2 ;;
esac
