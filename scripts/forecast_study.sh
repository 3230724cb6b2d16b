# The Forecast study on one GPU: short ablation runs side by side, the long run, and the
# evaluation of every Forecast on held-out text of other domains. Runs go on in the background
# (setsid) between device calls while the machine stays warm; each phase returns at once.
#
#   source scripts/device_setup.sh            # joins the GGUF, unpacks the corpus into /root/data
#   bash scripts/forecast_study.sh ablate     # start the ablation runs (STEPS each, in parallel)
#   bash scripts/forecast_study.sh ablate2    # the second set: mix_norest src_mid src_own len8k
#   bash scripts/forecast_study.sh main       # start (or resume) the long run to MAIN_STEPS
#   bash scripts/forecast_study.sh start NAME [N]  # one run of the table below, N steps
#   bash scripts/forecast_study.sh status     # each run's step, loss, recall; GPU memory
#   bash scripts/forecast_study.sh wait NAME..# block until those runs' processes have ended
#   bash scripts/forecast_study.sh eval NAME..# held-out evaluation of the runs' Forecasts ("shipped": the package's) (+ baselines;
#                                             # EVAL_MODEL=smollm2-135m-sparse BASE_TAG=_sn for that model's)
#   bash scripts/forecast_study.sh collect    # run records, eval results, the main Forecast into $OUT/forecast_study
#                                             # (WITH_CHECKPOINT=1: its newest checkpoint too, in 15 MiB parts)
#
# Runs (all SmolLM2-135M, 8 x 4096 tokens per step, lr 5e-4, supervision k 64 unless named):
#   pydocs      the Python docs (the CI default corpus), coarse (32, 16) teacher
#   corpus      the Debian documentation corpus, coarse teacher
#   mix         corpus + retrieval-rich windows (25% repeated spans, 25% scattered pieces)
#   mix_fine    mix with the fine (2, 1) teacher
#   mix_k256    mix with supervision k 256
#   mix_norest  mix without the loss's rest bucket (start it with: start mix_norest STEPS)
#   fine_main   mix with the (2, 1) teacher, for a long run (start fine_main MAIN_STEPS)
#   main        mix, trained on from its last checkpoint to MAIN_STEPS
#   cont        mix, started from the shipped Forecast (fresh optimizer, other windows: seed 1)
#   src_mid     mix, the Forecast reading layer l-1's state after its attention (--forecast-source prev_mid)
#   src_own     mix, the Forecast reading layer l's own input: no lead (--forecast-source own_input)
#   len8k       mix on 8K windows, 4 a step (the same tokens a step)
#   cont8k      the shipped Forecast trained on with 8K windows, 4 a step (seed 2: other windows)
#   cont8k2     the same again from the Forecast that cont8k made the shipped one (seed 3)
#   sn_forecast the Forecast of the sparse-native SmolLM2 (sn_forecast_NAME: an arm's), started from
#               the base model's shipped Forecast; TRAIN_ARGS="--adapter FILE" names the adapter
#               (else the package's; TRAIN_ARGS: more `sparda train` arguments for any run)
#   sn_cont     that model's shipped Forecast trained on (seed 1); sn_cont8k the same on 8K windows (seed 2)
#   sn_sel8k    sn_cont8k on a new adapter (TRAIN_ARGS="--adapter FILE"; seed 4)
set -u
DATA=${DATA:-/root/data}
RUNS=${RUNS:-/root/study}
STEPS=${STEPS:-250}
MAIN_STEPS=${MAIN_STEPS:-1200}
FRACTION=${FRACTION:-0.14}  # GPU memory per process: seven fit beside each other
mkdir -p "$RUNS"
COMMON="--seq-len 4096 --batch 8 --micro-batch 8 --save-every 50 --eval-every 50"

flags() {
  case "$1" in
    pydocs)   echo "--teacher 32 16" ;;
    corpus)   echo "--data $DATA --teacher 32 16" ;;
    mix)      echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25" ;;
    mix_fine) echo "--data $DATA --teacher 2 1 --repeat-share 0.25 --scatter-share 0.25" ;;
    mix_k256) echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --supervision-k 256" ;;
    mix_norest) echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --no-rest-bucket" ;;
    fine_main) echo "--data $DATA --teacher 2 1 --repeat-share 0.25 --scatter-share 0.25" ;;
    main)     echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25" ;;
    src_mid)  echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --forecast-source prev_mid" ;;
    src_own)  echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --forecast-source own_input" ;;
    len8k)    echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --seq-len 8192 --batch 4 --micro-batch 4" ;;
    cont)     echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 1" ;;
    cont8k)   echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 2 --seq-len 8192 --batch 4 --micro-batch 4" ;;
    cont8k2)  echo "--data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 3 --seq-len 8192 --batch 4 --micro-batch 4" ;;
    sn_cont)  echo "--model smollm2-135m-sparse --data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 1" ;;
    sn_cont8k) echo "--model smollm2-135m-sparse --data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 2 --seq-len 8192 --batch 4 --micro-batch 4" ;;
    sn_sel8k) echo "--model smollm2-135m-sparse --data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast shipped --seed 4 --seq-len 8192 --batch 4 --micro-batch 4" ;;
    sn_forecast|sn_forecast_*) echo "--model smollm2-135m-sparse --data $DATA --teacher 32 16 --repeat-share 0.25 --scatter-share 0.25 --init-forecast sparda_jax/weights/forecast-smollm2-135m.safetensors" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

start() {  # start NAME STEPS: a background training process that outlives this call
  local name=$1 steps=$2 f
  f=$(flags "$name") || return 1
  mkdir -p "$RUNS/$name"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRACTION setsid nohup sparda train --out "$RUNS/$name" --steps "$steps" \
    $COMMON $f ${TRAIN_ARGS:-} >>"$RUNS/$name/log" 2>&1 < /dev/null &
  echo "started $name ($steps steps): sparda train --out $RUNS/$name --steps $steps $COMMON $f ${TRAIN_ARGS:-}"
}

status() {
  for d in "$RUNS"/*/; do
    local n; n=$(basename "$d")
    [ "$n" = eval ] && continue
    local last; last=$(tail -n 1 "$d/metrics.jsonl" 2>/dev/null | python3 -c \
      'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print(r.get("step"), round(r.get("loss", 0), 3), round(r.get("tokens_per_s", 0)))' 2>/dev/null)
    local rec; rec=$(grep -o '"recall": [0-9.]*' "$d/metrics.jsonl" 2>/dev/null | tail -n 1)
    echo "$n: step/loss/tok_s $last $rec $( [ -f "$d/forecast.safetensors" ] && echo exported ) $(pgrep -f "out $RUNS/$n " >/dev/null && echo running)"
    tail -n 2 "$d/log" 2>/dev/null | tr '\r' '\n' | tail -n 1 | cut -c1-160
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || true
}

evaluate() {  # eval NAME...: each run's Forecast on the held-out domains (baselines once), EVAL_JOBS at a time
  # BASELINES=0: no baselines; BASE_SPLITS / BASE_TAG: the baselines on some splits, in baselines${BASE_TAG}_*.json;
  # BASE_MODES: which (default: dense sparse infinigen, and sparda with an untrained Forecast);
  # BASE_ARGS: more `sparda eval` arguments for the baselines (e.g. --adapter FILE)
  local out=$RUNS/eval; mkdir -p "$out"
  local splits="eval-info eval-man eval-licenses heldout"
  # EVAL_MODEL: another model than SmolLM2 (smollm2-135m-sparse for sn_forecast and its baselines)
  # EVAL_ARGS: more `sparda eval` arguments for the runs' Forecasts (e.g. --seed 1), EVAL_TAG in their names
  local sel="--suite selection --text $DATA --lengths 4096 8192 --seqs 4 ${EVAL_MODEL:+--model $EVAL_MODEL}"
  local cpy="--suite copy --text $DATA --lengths 4096 8192 --samples 8 ${EVAL_MODEL:+--model $EVAL_MODEL}"
  local jobs=$out/jobs${BASE_TAG:-}$$.txt; : > "$jobs"
  local base=$out/baselines${BASE_TAG:-}
  if [ "${BASELINES:-1}" = 1 ] && [ ! -f "${base}_selection.json" ]; then
    local bs=${BASE_SPLITS:-$splits}
    local bm=${BASE_MODES:-dense sparse infinigen sparda}
    echo "$sel --splits $bs --modes $bm --forecast random ${BASE_ARGS:-} --out ${base}_selection.json" >> "$jobs"
    echo "$cpy --splits $bs --modes $bm --forecast random ${BASE_ARGS:-} --out ${base}_copy.json" >> "$jobs"
  fi
  sel="$sel --splits $splits"; cpy="$cpy --splits $splits"
  for name in "$@"; do
    local f=$RUNS/$name/forecast.safetensors
    [ "$name" = shipped ] && f=sparda_jax/weights/forecast-smollm2-135m.safetensors  # the package's own
    [ -f "$f" ] || { echo "no Forecast for $name yet"; continue; }
    cp "$f" "$out/$name.safetensors"  # the Forecast evaluated, even if its run goes on
    echo "$sel --modes sparda --forecast $out/$name.safetensors ${EVAL_ARGS:-} --out $out/${name}${EVAL_TAG:-}_selection.json" >> "$jobs"
    echo "$cpy --modes sparda --forecast $out/$name.safetensors ${EVAL_ARGS:-} --out $out/${name}${EVAL_TAG:-}_copy.json" >> "$jobs"
  done
  # one line per job; each job's log beside its JSON
  XLA_PYTHON_CLIENT_MEM_FRACTION=${EVAL_FRACTION:-0.08} xargs -P "${EVAL_JOBS:-6}" -I{} \
    sh -c 'set -- {}; o=$(echo "$@" | sed "s/.*--out \([^ ]*\).*/\1/"); sparda eval "$@" > "${o%.json}.log" 2>&1; echo "done $o ($?)"' < "$jobs"
}

collect() {  # at most 8 files of at most 16 MiB come back from a call: records in one archive
  local dst=${OUT:-/tmp/out}/forecast_study tmp=/tmp/collect; mkdir -p "$dst"; rm -rf "$tmp"; mkdir -p "$tmp"
  for d in "$RUNS"/*/; do
    local n; n=$(basename "$d"); mkdir -p "$tmp/$n"
    cp "$d"/*.json "$d"/*.jsonl "$d"/*.png "$d"/*.md "$tmp/$n/" 2>/dev/null
    tail -c 20000 "$d/log" > "$tmp/$n/log.tail" 2>/dev/null
    for l in "$d"/*.log; do [ -f "$l" ] && tail -c 6000 "$l" > "$tmp/$n/$(basename "$l").tail"; done
  done
  tar czf "$dst/records.tgz" -C "$tmp" .
  for n in ${COLLECT_FORECASTS:-main cont}; do
    [ -f "$RUNS/$n/forecast.safetensors" ] && cp "$RUNS/$n/forecast.safetensors" "$dst/${n}_forecast.safetensors"
  done
  # the long run's newest checkpoint, in parts, where the run may outlast the machine
  if [ -d "$RUNS/main/checkpoints" ] && [ "${WITH_CHECKPOINT:-0}" = 1 ]; then
    (cd "$RUNS/main" && tar czf - "checkpoints/$(ls checkpoints | grep -E '^[0-9]+$' | sort -n | tail -n 1)") \
      | split -b 15M -d -a 1 - "$dst/main_checkpoint.tgz.part"
  fi
  ls -la "$dst"
}

phase=${1:-status}; shift || true
case "$phase" in
  ablate) for n in pydocs corpus mix mix_fine mix_k256; do start "$n" "$STEPS"; done ;;
  ablate2) for n in mix mix_norest src_mid src_own len8k; do start "$n" "$STEPS"; done ;;
  main)  # the long run goes on from the mix run's last checkpoint (the same recipe)
    if [ ! -d "$RUNS/main" ] && [ -d "$RUNS/mix/checkpoints" ]; then
      mkdir -p "$RUNS/main" && cp -r "$RUNS/mix/checkpoints" "$RUNS/mix/config.json" "$RUNS/mix/metrics.jsonl" "$RUNS/main/"
    fi
    start main "$MAIN_STEPS" ;;
  start) start "$1" "${2:-$STEPS}" ;;  # start NAME [STEPS]: one run of the table above
  status) status ;;
  wait)  # until each run's process has exited (a lengthened run re-exports at its end), or WAIT_S seconds
    t_end=$(( $(date +%s) + ${WAIT_S:-600} ))
    for n in "$@"; do
      while pgrep -f "out $RUNS/$n " >/dev/null && [ "$(date +%s)" -lt "$t_end" ]; do sleep 5; done
      if pgrep -f "out $RUNS/$n " >/dev/null; then echo "$n: still running after WAIT_S"
      elif [ -f "$RUNS/$n/forecast.safetensors" ]; then echo "$n exported"
      else echo "$n: no Forecast (see $RUNS/$n/log)"; tail -n 3 "$RUNS/$n/log"; fi
    done ;;
  eval) evaluate "$@" ;;
  collect) collect ;;
  *) sed -n '1,20p' "$0"; exit 2 ;;
esac
