# The sparse-native SmolLM2 with dense layers (`--dense-layers`, default 18) on held-out text: the
# copy and selection suites (dense / sparse / sparda, every split, 4K and 8K) and `sparda demo`'s
# needle at 4K and 8K, in the background (setsid) so that device calls only poll.
#
#   source scripts/device_setup.sh          # the GGUF joined, the corpus in /root/data
#   DENSE=18 bash scripts/dense_layer_eval.sh start
#   bash scripts/dense_layer_eval.sh wait SECONDS   # until every job is done or SECONDS pass
#   bash scripts/dense_layer_eval.sh collect        # JSONs and logs under $OUT/dense_layers
set -u
DATA=${DATA:-/root/data}
DENSE=${DENSE:-18}
D=/root/dl_${DENSE//,/_}
common="--model smollm2-135m-sparse --dense-layers $DENSE"
case "${1:-}" in
  start)
    mkdir -p "$D"
    jobs=(
      "eval --suite copy --text $DATA --lengths 4096 8192 --samples 8 --splits eval-info eval-man eval-licenses heldout --modes dense sparse sparda $common --out $D/copy.json"
      "eval --suite selection --text $DATA --lengths 4096 8192 --seqs 4 --splits eval-info eval-man eval-licenses heldout --modes dense sparse sparda $common --out $D/selection.json"
      "demo --dtype bfloat16 --context 4096 --systems dense_resident sparse sparda $common --json $D/demo_4096.json"
      "demo --dtype bfloat16 --context 8128 --systems dense_resident sparse sparda $common --json $D/demo_8128.json"
    )
    for j in "${jobs[@]}"; do
      o=$(echo "$j" | sed 's/.*--\(out\|json\) \([^ ]*\).*/\2/')
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 setsid nohup sh -c "sparda $j > ${o%.json}.log 2>&1; echo \$? > ${o%.json}.rc" \
        < /dev/null > /dev/null 2>&1 &
    done
    echo "started ${#jobs[@]} jobs in $D" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(ls "$D"/*.rc 2>/dev/null | wc -l)" -lt 4 ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    for r in "$D"/*.rc; do echo "$(basename "$r") $(cat "$r")"; done ;;
  collect)
    dst=${OUT:-/tmp/out}/dense_layers; mkdir -p "$dst"
    cp "$D"/*.json "$D"/*.md "$dst/" 2>/dev/null
    for l in "$D"/*.log; do tail -c 8000 "$l" > "$dst/$(basename "$l").tail"; done
    ls "$dst" ;;
  *) sed -n '1,8p' "$0"; exit 2 ;;
esac
