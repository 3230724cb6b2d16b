# The sparse-native SmolLM2 on one GPU: its adapter (`sparda finetune --objective distill`), its
# Forecast, and their evaluation on held-out text, as one chain in the background (setsid) that
# outlives the device call; calls only poll. Its progress: /root/sn/log.
#
#   source scripts/device_setup.sh     # the GGUF joined, the corpus in /root/data
#   bash scripts/sn_study.sh start     # the chain below
#   bash scripts/sn_study.sh status    # the chain's log, the runs' steps
#   bash scripts/sn_study.sh collect   # records, JSONs, adapter and Forecast under $OUT/sn_study
#
#
# A device machine can be lost mid-chain: end every poll with `collect`, so what the chain has made
# so far (its adapter once trained, its Forecast, records) is here already; a later machine goes on
# with ADAPTER=that adapter (no training) and FC_RUN's Forecast started again.
#
# Chain: the adapter (ADAPTER=FILE: that file instead of training; FT_STEPS, FT_SEQ, FT_BATCH, FT_COPY,
# FT_SELECT (--select-weight), FT_SELECT_LAYERS (--select-layers, e.g. 15-19), FT_LR (--lr, default
# 5e-4), FT_INIT (--init-adapter, e.g. shipped)) -> in parallel: the model's
# dense / sparse baselines (copy + selection suites, every split, 4K and 8K) and its Forecast
# (`forecast_study.sh start $FC_RUN SN_STEPS`, FC_RUN default sn_forecast) -> the Forecast's
# evaluation and `sparda demo` at 4K and 8K with Dense+, Sparse and SparDA. SN_STEPS=0: the
# adapter and its baselines only. Every command after training names the adapter (`--adapter`).
#
#   bash scripts/sn_study.sh arm NAME  # one chain in the foreground, in SN=/root/sn_NAME, its baselines
#                                      # tagged _NAME: arms run one after another in one background shell
set -u
DATA=${DATA:-/root/data}
FC_RUN=${FC_RUN:-sn_forecast}
SHIPPED=/root/shipped-adapter.safetensors
SN=${SN:-/root/sn}
TAG=${TAG:-_sn}  # the baselines' files: $RUNS/eval/baselines${TAG}_*.json
RUNS=${RUNS:-/root/study}
W=sparda_jax/weights
mkdir -p "$SN" "$RUNS/eval"
log() { echo "$(date +%T) $*" >> "$SN/log"; }

# Each device call copies the local tree over the machine's, the package's weights included: a file
# put there (or replaced) by the chain is gone or reverted after the next call. So every command
# names the chain's own files: --adapter $SN/adapter.safetensors, --forecast $SN/forecast.safetensors.

chain() {
  local init=${FT_INIT:-}
  [ "$init" = shipped ] && init=$SHIPPED  # the package's adapter as this call found it (see start)
  if [ -n "${ADAPTER:-}" ]; then
    cp "$ADAPTER" "$SN/adapter.safetensors" || { log "no adapter $ADAPTER"; return 1; }
  else
    XLA_PYTHON_CLIENT_MEM_FRACTION=${FT_MEM:-0.4} sparda finetune --model smollm2-135m --data "$DATA" --out "$SN/ft" \
      --seq-len "${FT_SEQ:-4096}" --steps "${FT_STEPS:-400}" --batch "${FT_BATCH:-8}" --micro-batch 2 --lr "${FT_LR:-5e-4}" --rank 32 \
      --save-every 25 --eval-every 50 --eval-seqs 2 --repeat-share 0.25 --scatter-share 0.25 \
      --objective distill --copy-weight "${FT_COPY:-0}" --select-weight "${FT_SELECT:-0}" \
      ${FT_SELECT_LAYERS:+--select-layers $FT_SELECT_LAYERS} ${init:+--init-adapter $init} > "$SN/ft.log" 2>&1 || { log "finetune failed: $(tail -n 3 "$SN/ft.log")"; return 1; }
    # a run whose held-out dense NLL rose past 0.05 nats diverged (an 8K run at select weight 2 and
    # lr 5e-4 did): its Forecast and evaluation would waste the machine
    python3 -c "import json,sys; r=[json.loads(l) for l in open('$SN/ft/metrics.jsonl') if 'heldout_dense' in l]
sys.exit(r[-1]['heldout_dense'] - r[0]['heldout_dense'] > 0.05)" || { log "adapter diverged: held-out dense NLL rose past 0.05 nats; chain stopped"; return 1; }
    cp "$SN/ft/adapter.safetensors" "$SN/adapter.safetensors"
  fi
  log "adapter ready: $SN/adapter.safetensors"
  local with="--adapter $SN/adapter.safetensors"
  EVAL_MODEL=smollm2-135m-sparse BASE_TAG=$TAG BASE_MODES="dense sparse" BASE_ARGS="$with" EVAL_JOBS=2 \
    bash scripts/forecast_study.sh eval >> "$SN/log" 2>&1 &
  if [ "${SN_STEPS:-600}" = 0 ]; then  # the adapter's own baselines only (a control arm): no Forecast
    wait; log "chain done (SN_STEPS=0: baselines only)"; return 0
  fi
  FRACTION=0.2 TRAIN_ARGS="$with" bash scripts/forecast_study.sh start "$FC_RUN" "${SN_STEPS:-600}" >> "$SN/log"
  sleep 30
  WAIT_S=100000 bash scripts/forecast_study.sh wait "$FC_RUN" >> "$SN/log"
  cp "$RUNS/$FC_RUN/forecast.safetensors" "$SN/forecast.safetensors" || { log "no Forecast"; wait; return 1; }
  for c in 4096 8128; do  # 8K: the prompt and 32 new tokens within the model's 8192
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 sparda demo --model smollm2-135m-sparse --dtype bfloat16 --context $c \
      $with --forecast "$SN/forecast.safetensors" --systems dense_resident sparse sparda --json "$SN/demo_$c.json" > "$SN/demo_$c.log" 2>&1 &
  done
  BASELINES=0 EVAL_JOBS=2 EVAL_MODEL=smollm2-135m-sparse EVAL_ARGS="$with" bash scripts/forecast_study.sh eval "$FC_RUN" >> "$SN/log" 2>&1
  wait
  log "chain done"
}

case "${1:-status}" in
  start)
    python3 -c "import gguf" || { echo "gguf is not importable: carry .whl"; exit 1; }
    [ -f "$DATA/manifest.json" ] || { echo "no corpus in $DATA: carry .data"; exit 1; }
    [ -n "${SPARDA_SMOLLM2_GGUF:-}" ] || { echo "no SmolLM2 GGUF: carry .model0 and .model1"; exit 1; }
    cp -n "$W/adapter-smollm2-135m-sparse.safetensors" "$SHIPPED"  # this call's tree is the package's
    export -f chain log; export DATA SN RUNS W FC_RUN TAG SHIPPED
    setsid nohup bash -c chain >> "$SN/log" 2>&1 < /dev/null &
    echo "started; log $SN/log" ;;
  arm)  # arm NAME: the chain in the foreground, in /root/sn_NAME (FT_* and SN_STEPS as for start;
    # FT_INIT=shipped needs an earlier `start` or `arm` call's copy of the package's adapter)
    [ -f "$SHIPPED" ] || cp "$W/adapter-smollm2-135m-sparse.safetensors" "$SHIPPED"
    SN=/root/sn_${2:?usage: arm NAME} TAG=_$2 FC_RUN=sn_forecast_$2; mkdir -p "$SN"; log "arm $2: FT_SEQ=${FT_SEQ:-4096} FT_BATCH=${FT_BATCH:-8} FT_SELECT=${FT_SELECT:-0} FT_SELECT_LAYERS=${FT_SELECT_LAYERS:-all} FT_LR=${FT_LR:-5e-4} FT_STEPS=${FT_STEPS:-400} FT_INIT=${FT_INIT:-}"
    chain >> "$SN/log" 2>&1 ;;
  status)
    tail -n 12 "$SN/log" 2>/dev/null
    tail -c 400 "$SN/ft.log" 2>/dev/null | tr '\r' '\n' | tail -n 2
    bash scripts/forecast_study.sh status 2>/dev/null | grep -A1 "$FC_RUN" ;;
  collect)  # at most 8 files come back from a call
    dst=${OUT:-/tmp/out}/sn_study; mkdir -p "$dst"
    s=${SN#/} r=${RUNS#/}; dst=$dst$(basename "$SN" | sed 's/^sn//'); mkdir -p "$dst"
    tar czf "$dst/records.tgz" -C / --ignore-failed-read $s/log $s/ft.log $s/ft/metrics.jsonl \
      $s/ft/config.json $s/ft/metrics.png $(cd / && ls $s/demo_* $r/eval/*${TAG}_* \
      $r/eval/${FC_RUN}_* $r/$FC_RUN/metrics.jsonl $r/$FC_RUN/config.json $r/$FC_RUN/metrics.png 2>/dev/null)
    cp "$SN/adapter.safetensors" "$SN/forecast.safetensors" "$dst/" 2>/dev/null
    ls -la "$dst" ;;
  *) sed -n '1,26p' "$0"; exit 2 ;;
esac
