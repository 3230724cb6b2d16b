# Stages for a device-tool call on the H200, one or more per call (each ends well inside 10 min):
#   source scripts/device_setup.sh; bash scripts/gpu_session.sh tests copy
# Carry .whl and .commit (and .model/smol.part01 after a call that carried part00 when a stage
# needs SmolLM2: eval-tasks, train).
set -u
OUT=${OUT:-/tmp/out}
# A full-depth decode run with XLA's command-buffer log beside it (stderr), then the step's big graphs'
# re-recording costs by moved allocations (scripts/probes/graph_updates.py --updates); the log is kept gzipped.
#   [VAR=value ...] logged_decode NAME TIMEOUT TABLE_PATTERN <bench decode args>  ->  $OUT/decode_NAME.json
logged_decode() {
  local name=$1 t=$2 pat=$3; shift 3
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout "$t" python3 -m sparda_jax.cli bench decode \
    "$@" --out "$OUT/decode_$name.json" 2> "$OUT/$name.log" | grep -E "$pat"
  grep -iE "warning|error:|host pool" "$OUT/$name.log" | grep -v "^[IWE][0-9]" | head -5
  python3 scripts/probes/graph_updates.py --updates "$OUT/$name.log"; gzip -f "$OUT/$name.log"
}
# the batch-8 claim's rows at full depth with the doorbell copies (Sparse and SparDA, random traffic and
# SmolLM2's miss rates), shared by the stages that time it under one setting each, and their table lines
FULL32=(--lengths 131072 --batches 8 --layers 32 --repeats 12)  # 128K, batch 8, every layer timed
CLAIMS32=("${FULL32[@]}" --modes sparse sparda --reuse-fractions
          --real-miss-rate sparse=0.122 sparda=0.086 --copy-start doorbell)
CLAIMS_ROWS="^\| (Sparse|SparDA)|SparDA / Sparse"
for stage in "$@"; do
  case "$stage" in
    tests)       # every GPU-marked test (kernels, copy engine, engine, cuDNN): 38 at 9b21157, whose run a 300 s
                 # limit cut after 37 (gpu_tests_9b21157.log)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 420 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests \
        > "$OUT/gpu_tests.log" 2>&1; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -15 ;;
    tests-engine)  # the GPU tests of the copy engine and the offload engine alone (~90 s)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_copy_engine.py tests/test_engine.py > "$OUT/gpu_tests_engine.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_engine.log" | tail -15 ;;
    copy)        # bench: UVA gather vs bulk vs XLA loop vs host gather, CTA sweep, overlap, write-back (~100 s)
      timeout 200 python3 -m sparda_jax.cli bench copy --repeats 10 --sizes 1 8 32 --out "$OUT/copy.json" 2>&1 | tail -30 ;;
    pipeline)    # bench: the prefetch pattern without the engine (bench/copy.py bench_pipeline): K/V copies of
                 # the next layer started beside skinny matmuls, per CTA count, threads per CTA, resident (~60 s)
      timeout 200 python3 -m sparda_jax.cli bench copy --pipeline-only --repeats 10 --out "$OUT/copy_pipeline.json" 2>&1 | tail -40 ;;
    pipeline-timeline)  # the prefetch microbenchmark with a timeline per row (copy_engine.trace: timing events where
                        # each copy begins and ends on its lane and around each work layer): do they run together? (~60 s)
      timeout 200 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
import json, os
from sparda_jax.envinfo import environment
r = bench_pipeline(blocks=(240, 1920), ctas=(2, 16), threads=(256,), starts=('lanes', 'one'), timeline=True)
print(pipeline_table(r))
for x in r['rows']:
    t = x.get('timeline', {})
    print(x['blocks_per_layer'], x['start'], x['ctas'], x['resident'], 'work ms', round(t.get('work_ms', 0), 3),
          'with a copy beside', round(t.get('work_ms_with_a_copy_beside', 0), 3))
json.dump({'name': 'copy_pipeline', 'environment': environment(), 'command': 'gpu_session.sh pipeline-timeline',
           'pipeline': r}, open(os.environ['OUT'] + '/copy_pipeline_timeline.json', 'w'), indent=1)" 2>&1 | grep -v "^\[pipeline\]" ;;
    hlo-pipeline)  # where XLA's GPU scheduler puts the copy starts and waits: the optimized HLO (after
                   # scheduling) of the prefetch microbenchmark's programs, one config, tarred (~40 s)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*fn.* --xla_dump_hlo_pass_re=copy-insertion" \
      timeout 150 python3 -c "
from sparda_jax.bench.copy import bench_pipeline, pipeline_table
print(pipeline_table(bench_pipeline(blocks=(240,), ctas=(16,), threads=(256,), starts=('lanes', 'one'), repeats=3)))"
      python3 scripts/probes/hlo_order.py "$OUT/hlo"   # schedule of starts (S), waits (W), GEMMs, copies; starts ordered
      tar czf "$OUT/hlo_pipeline.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo" ;;
    hlo-decode)  # the same for the engine's SparDA decode step (batch 16, 128K, 4 layers): where XLA put
                 # each layer's starts, waits and GEMMs, and whether it copies a started cache (~90 s)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo_decode --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*engine_decode.* --xla_dump_hlo_pass_re=copy-insertion" \
      timeout 200 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 16 --modes sparda \
        --budget-s 60 --repeats 2 --out "$OUT/decode_hlo_run.json" 2>&1 | tail -4
      python3 scripts/probes/hlo_order.py "$OUT/hlo_decode"
      tar czf "$OUT/hlo_decode.tgz" -C "$OUT" hlo_decode && rm -rf "$OUT/hlo_decode" ;;
    decode-one)  # the claims' rows with K and V in one start (copy_start "one"), overlap timings included;
                 # compare with decode-overlap's two-lane rows run in the same call
      timeout 380 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 16 --modes sparda \
        --reuse-fractions --real-miss-rate sparda=0.086 --overlap --budget-s 200 --repeats 16 --copy-start one \
        --out "$OUT/decode_one.json" 2>&1 | tail -14 ;;
    decode-host) # the two SparDA systems at batch 16, random traffic and SmolLM2's miss rate, with each step's
                 # host dispatch time (host_dispatch_seconds): is a step bound by the host? (~120 s)
      timeout 240 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 16 --modes sparda sparda_sync \
        --reuse-fractions --real-miss-rate sparda=0.086 --budget-s 150 --out "$OUT/decode_host.json" 2>&1 | tail -12 ;;
    attention)   # bench: sparse prefill/decode kernels vs cuDNN (~120 s; decode also other buffer and split
                 # counts, mosaic_gpu@s<S>n<N>); do not set highest precision here
      timeout 200 python3 -m sparda_jax.cli bench attention --out "$OUT/attention.json" 2>&1 | tail -30 ;;
    xla-variants)   # the prefetch microbenchmark with XLA's CUDA graphs off, the environment's CUDA_* variables,
                    # and the 4d2db98 overlap benchmark that overlapped partly (~150 s)
      bash scripts/probes/xla_variants.sh ;;
    overlap-probe)  # the engine's copy kernel beside other kernels with plain CUDA streams, outside XLA:
                    # short CTAs, a CUDA graph of them, persistent one-CTA-per-SM work (as nvjet), the
                    # same leaving 16 SMs, cuBLAS; and two copy streams at once (~30 s)
      bash scripts/probes/overlap_probe.sh ;;
    tests-decode)   # the decode kernel's GPU tests alone (two CTAs per SM, ids window in SMEM; ~60 s)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernel_decode.py > "$OUT/gpu_tests_decode.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_decode.log" | tail -8 ;;
    attention-decode)  # decode attention alone, every decode variant (the new default with 8 splits at batch 16
                       # vs the old s2n4, s2n8, s2n16, s3n4, the split pass without its combine), 32K-128K (~100 s)
      timeout 300 python3 -m sparda_jax.cli bench attention --decode-only --out "$OUT/attention_decode.json" 2>&1 | tail -16 ;;
    attention-loop)  # decode attention at batch 16 with the call's 8 steps as a lax.map (a while loop: the host
                     # reads its predicate every trip) and unrolled: a linear fit of the batch-16/64 rows
                     # (seventh session) leaves ~40-58 us per step not explained by bytes
      for L in map unroll; do
        timeout 200 python3 -m sparda_jax.cli bench attention --decode-only --decode-batches 16 64 --decode-loop $L \
          --variants mosaic_gpu mosaic_gpu@s2n4 mosaic_gpu@s2n8 --repeats 10 --out "$OUT/attention_loop_$L.json" 2>&1 | tail -8
      done ;;
    attention-steps)  # decode attention with 32 steps a timed call instead of 8: the host's dispatch and wait of
                      # each call (tens of us) spread over 4x the steps (~80 s)
      timeout 200 python3 -m sparda_jax.cli bench attention --decode-only --decode-batches 16 64 --decode-steps 32 \
        --variants mosaic_gpu mosaic_gpu@s2n4 --repeats 10 --out "$OUT/attention_steps32.json" 2>&1 | tail -8 ;;
    attention-split)  # the decode kernel's split pass alone vs the whole kernel (split pass + XLA combine),
                      # batch 16 and 64, 32K and 128K: what the combine costs (~60 s)
      timeout 200 python3 -m sparda_jax.cli bench attention --decode-only --lengths 32768 131072 \
        --variants mosaic_gpu mosaic_gpu@split --out "$OUT/attention_split.json" 2>&1 | tail -12 ;;
    attention-rho)  # prefill kernels vs cuDNN on selections as alike between neighbours as real ones
                    # (rho 0.99: SmolLM2's tile union, eval/results/tile_union_smollm2.json)
      timeout 200 python3 -m sparda_jax.cli bench attention --prefill-only --query-correlation 0.99 \
        --variants cudnn mosaic_gpu --out "$OUT/attention_rho099.json" 2>&1 | tail -12 ;;
    prefill-rho)  # prefill at 128K with inputs alike along positions (AR(1) embedding rows), whose selections'
                  # tile union is near SmolLM2's real one; each sparse row reports the union it timed
      timeout 250 python3 -m sparda_jax.cli bench prefill --lengths 131072 --budget-s 190 --input-correlation 0.999 \
        --out "$OUT/prefill_rho.json" 2>&1 | tail -20 ;;
    select)      # bench: Forecast vs InfLLM-V2 selectors (prefill ~120 s, then decode); the default 140 s budget
                 # cut the decode part of the first run (bench/results/select.json, 4d2db98), so a call of its own
      timeout 500 python3 -m sparda_jax.cli bench select --budget-s 420 --out "$OUT/select.json" 2>&1 | tail -30 ;;
    select-decode)  # decode selection alone, 128K, batch 8 and 16: the XLA selectors with lax.top_k and the ids' sort
                    # (the decode step's ~25 us of sorts a layer, layer_breakdown_2e96975) against the same with the
                    # Mosaic top-k (@mosaic_topk); its GPU tests first, in the selectors and in the engine's step
                    # (~150 s); if it wins, the claims again with `bench decode --topk-impl mosaic_gpu`
      timeout 150 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernel_select.py tests/test_engine.py \
        -k "decode_topk or topk_kernel_equals" 2>&1 | tail -2
      timeout 240 python3 -m sparda_jax.cli bench select --decode-only --lengths 131072 --decode-batches 8 16 \
        --variants forecast_xla forecast_xla@mosaic_topk infllmv2_xla infllmv2_xla@mosaic_topk --budget-s 200 \
        --out "$OUT/select_decode_topk.json" 2>&1 | tail -12 ;;
    decode)      # bench: the engine's systems, decode tokens/s vs batch at 128K (Table 4); the reuse
                 # variants match the miss rates measured on SmolLM2 in the same run (needs the model)
      timeout 330 python3 -m sparda_jax.cli bench decode --real-model smollm2-135m \
        --out "$OUT/decode.json" 2>&1 | tail -30 ;;
    decode-profile)  # where a decode step's time goes: the claims' rows at 128K, 3 traced steps each
                     # (bench/profile.py: busy/idle per step, per stream, top kernels; traces in $OUT/profiles).
                     # XLA runs op by op while a profiler is active unless told otherwise: the timed steps
                     # use command buffers (CUDA graphs), so the traced ones should too
      XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" \
      timeout 330 python3 -m sparda_jax.cli bench decode --modes sparse sparda sparda_sync --batches 8 16 \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --profile-steps 3 --budget-s 250 \
        --out "$OUT/decode_profile.json" 2>&1 | tail -80 ;;
    decode-others)  # the systems the budgeted decode stage never reached (Dense+, Sparse+, InfiniGen), 128K,
                    # batch 4 / 8 / 16, random traffic; their own JSON (~250 s)
      timeout 330 python3 -m sparda_jax.cli bench decode --modes dense_resident sparse_resident infinigen \
        --batches 4 8 16 --budget-s 260 --out "$OUT/decode_others.json" 2>&1 | tail -16 ;;
    decode-claims)  # the claims' pairs at 128K, batch 8 and 16, the paper's CTA heuristic, random traffic and
                    # SmolLM2's miss rates (measured by the decode stage's real_miss_rate, decode.json)
      timeout 300 python3 -m sparda_jax.cli bench decode --modes sparse sparda sparda_sync --batches 8 16 \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --budget-s 170 --out "$OUT/decode_claims.json" 2>&1 | tail -30 ;;
    decode-overlap)  # the overlap claim: each claims' row (random traffic and SmolLM2's miss rates) also timed
                     # with no data moved (compute alone) and as its copies alone (bench/decode.py _overlap);
                     # every plan compiles in ~26 s, 8 plans: ~300 s; 16 timed steps (6 varied by +-15%
                     # between runs: decode_host.json vs decode_overlap.json)
      timeout 380 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 16 --modes sparse sparda sparda_sync \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --overlap --budget-s 300 --repeats 16 \
        --out "$OUT/decode_overlap.json" 2>&1 | tail -30 ;;
    decode-marginal)  # decode-overlap with the full-model step estimated from 2 and 4 layers (bench.decode.marginal:
                      # scaling 4 layers x8 counts the fixed costs and the prefetch's fill and drain 8 times), the
                      # batch-8 claim's rows also timed at 8 layers to check the estimate
      timeout 430 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 16 --modes sparse sparda sparda_sync \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --overlap --budget-s 330 --repeats 12 \
        --marginal-layers 2 --validate-layers 8 --out "$OUT/decode_marginal.json" 2>&1 | grep -v "^\[decode\]" | tail -40 ;;
    decode-b8)  # the batch-8 claim alone: Sparse and SparDA at 128K, random traffic and two repeating-row counts
                # around each real-model miss rate (interpolated: bench.decode.at_miss_rate), 2 and 4 layers,
                # every row also at 8 layers
      timeout 480 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --modes sparse sparda \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --overlap --budget-s ${B8_BUDGET:-400} --repeats 12 \
        --marginal-layers 2 --validate-layers 8 --out "$OUT/decode_b8.json" 2>&1 | grep -v "^\[decode\]" | tail -30 ;;
    weights-ab)  # SparDA at batch 8 on the stacked weights (each step slices every layer's; XLA copied the o_proj
                 # slice feeding cuBLAS) and on per-layer weights (model.layered_params), one call, two JSONs (~150 s)
      for W in stacked layered; do
        timeout 150 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --modes sparda \
          --reuse-fractions 0.88 --budget-s 60 --repeats 16 --weights $W --out "$OUT/decode_weights_$W.json" 2>&1 | tail -4
      done ;;
    decode-graph-plain|decode-graph|decode-graph-one)
      # the batch-8 claim with all 32 layers timed (decode_b8_32layers.json: SparDA host-bound at 15-22 ms
      # a step), plain; with the synchronous copies recordable into CUDA graphs (--copy-in-graph); and
      # that with SparDA's K and V in one start. Random and reuse=0.88 rows; one stage a call (~330 s each)
      case $stage in
        decode-graph-plain) X="--no-copy-in-graph"; M="sparse sparda";;
        decode-graph) X="--copy-in-graph"; M="sparse sparda";;
        decode-graph-one) X="--copy-in-graph --copy-start one"; M="sparda";;
      esac
      timeout 480 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --modes $M --layers 32 \
        --reuse-fractions 0.88 --budget-s 400 --repeats 12 $X --out "$OUT/${stage//-/_}.json" 2>&1 | grep -E "^\| (Sparse|SparDA)" ;;
    decode-depth)  # the batch-8 claim at full depth (32 layers) with the copies in XLA's graphs (--copy-in-graph):
                   # the engine's copy_in_graph GPU tests; then every row timed and 2 steps of each traced (device
                   # busy/idle, the host's CUDA API calls: is the step host- or device-bound?); then the same rows
                   # with CUDA's launch queues 4x deep (does the host block on a full queue?), compiled programs
                   # from the persistent cache ($OUT/jaxcache, also carried back for the next call) (~520 s)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 90 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine.py -k "cuda_copy_engine_equals" > "$OUT/gpu_tests_engine_graph.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_engine_graph.log" | tail -5
      export JAX_COMPILATION_CACHE_DIR="$OUT/jaxcache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=5
      XF0="${XLA_FLAGS:-}"; export XLA_FLAGS="$XF0 --xla_enable_command_buffers_during_profiling=true"
      A="--lengths 131072 --batches 8 --modes sparse sparda --layers 32 --reuse-fractions 0.88 --repeats 12 --copy-in-graph"
      timeout 380 python3 -m sparda_jax.cli bench decode $A --budget-s 330 --profile-steps 2 --profile-reuse \
        --out "$OUT/decode_depth_graph.json" 2>&1 | grep -E "^\| (Sparse|SparDA)|^profile|^    (host|cuda)"
      CUDA_SCALE_LAUNCH_QUEUES=4x timeout 150 python3 -m sparda_jax.cli bench decode $A --budget-s 120 \
        --out "$OUT/decode_depth_queue4x.json" 2>&1 | grep -E "^\| (Sparse|SparDA)"
      export XLA_FLAGS="$XF0"; unset JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
      du -sh "$OUT/jaxcache"; ls -la "$OUT/jaxcache" | head -20 ;;
    decode-claims32)  # the batch-8 claim at full depth (32 layers), copies in graphs, CUDA's launch queues 4x (the
                      # CLI's default): random traffic and the rows around SmolLM2's miss rates, both modes (~330 s).
                      # (decode-depth2 put this, K and V in one start, a log run and an XLA-flag run in one call:
                      # uncached 32-layer compiles, ~75 s a program, overran the 600 s limit)
      timeout 480 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparse sparda --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --budget-s 420 \
        --out "$OUT/decode_claims32.json" 2>&1 | grep -E "^\| (Sparse|SparDA)|SparDA / Sparse|warning" ;;
    claims-doorbell)  # the batch-8 claim at full depth with SparDA's doorbell copies (one graph a step), Sparse beside
                      # it, random traffic and SmolLM2's miss rates, each row's host_period_seconds (host-bound or
                      # not) (~450 s: at a6a025c Sparse's three rows took 192 s, weights, ceilings and compile included,
                      # and SparDA's first call was still compiling when a 300 s limit cut it)
      # XLA's log beside it: each graph update's time and moved allocations at 32 layers (at 16, updates
      # that moved 2 allocations took ~0.1 ms, 3-4 moved 1.5-4.8 ms: graph_updates/record_profile)
      logged_decode claims32_doorbell 540 "$CLAIMS_ROWS" "${CLAIMS32[@]}" --budget-s 480 ;;
    allocator-ab)  # SparDA's full-depth low-traffic step is host-bound (a6a025c): most back-to-back steps moved a 3rd
                   # or 4th allocation of its big graph (1405 commands), and each such update took 6-10 ms on the host
                   # (~0.1 ms when 2 moved). The same rows under another device allocator (ALLOC, default cuda_async:
                   # stream-ordered, so a step's temporaries may keep their address), with the same log (~300 s)
      XLA_PYTHON_CLIENT_ALLOCATOR=${ALLOC:-cuda_async} logged_decode alloc_${ALLOC:-cuda_async} 330 "^\| SparDA" \
        --lengths 131072 --batches 8 --layers 32 --repeats 12 --modes sparda --reuse-fractions \
        --real-miss-rate sparda=0.086 --copy-start doorbell --budget-s 300 ;;
    temp-color)  # the same, with XLA's temporaries in a memory space of their own (--xla_gpu_temp_buffer_use_separate_color:
                 # a stream-ordered allocator of their own, "the temp buffer at the fixed address on every iteration").
                 # At 3e40815 the third allocation that moved is the one the whole big graph reads (its re-recordings cost
                 # 6-10 ms against ~0.1 ms with 2 moved): if it is the temporaries, this pins it. Sparse beside it (~450 s)
      XLA_FLAGS="${XLA_FLAGS:-}${XLA_FLAGS:+ }--xla_gpu_temp_buffer_use_separate_color=true" \
        logged_decode claims32_tempcolor 540 "$CLAIMS_ROWS" "${CLAIMS32[@]}" --budget-s 480 ;;
    cmdbuf-off32)  # the claims at full depth without XLA's command buffers (CUDA graphs): the host then launches
                   # each of the step's ~1400 kernels, but no graph is re-recorded; with graphs SparDA's reuse steps
                   # spent 6-10 ms re-recording theirs (3e40815) and the temporaries' own color made every step
                   # host-bound (422126b, decode_claims32_tempcolor.json). Sparse beside it (~300 s)
      XLA_FLAGS="${XLA_FLAGS:-}${XLA_FLAGS:+ }--xla_gpu_enable_command_buffer=" timeout 420 python3 -m sparda_jax.cli \
        bench decode "${CLAIMS32[@]}" --budget-s 380 --out "$OUT/decode_claims32_cmdbuf_off.json" 2>&1 \
        | grep -E "$CLAIMS_ROWS|warning|rror" ;;
    prealloc32)  # the same rows with graphs, the device allocator's arena preallocated (PREALLOC_FRACTION of the GPU,
                 # default 0.90) instead of grown on demand: do fewer of the step's allocations move? (~300 s)
      XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=${PREALLOC_FRACTION:-0.90} \
        logged_decode claims32_prealloc 420 "$CLAIMS_ROWS" "${CLAIMS32[@]}" --budget-s 380 ;;
    topk-test)  # the Mosaic top-k's selector GPU test alone, with its failure's lines (~80 s)
      timeout 150 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernel_select.py \
        -k "compiled_decode_topk" 2>&1 | grep -E "Error|assert|Mismatch|passed|failed" | head -12 ;;
    overlap32-doorbell)  # SparDA's full-depth overlap (step, compute alone, copies alone) on reuse, doorbell (~300 s)
      timeout 330 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparda --reuse-fractions 0.88 --overlap --copy-start doorbell --budget-s 300 \
        --out "$OUT/decode_overlap32_doorbell.json" 2>&1 | grep -E "^\| SparDA|^overlap|^doorbell timeline" ;;
    graph-prefetch)  # sparda's prefetch as the in-graph gather beside layer l (copy_start "graph", CONCURRENT
                     # graph scheduling): its GPU equality test, then 4 layers, batch 8, 128K, sparda beside
                     # sparda_sync with compute alone and copies alone (~150 s)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine.py -k "cuda_copy_engine_equals and graph" > "$OUT/gpu_tests_graph.log" 2>&1
      tail -3 "$OUT/gpu_tests_graph.log"
      timeout 200 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 4 --repeats 12 \
        --modes sparda sparda_sync --reuse-fractions 0.88 --overlap --copy-start graph --budget-s 150 \
        --out "$OUT/decode_graph4.json" 2>&1 | grep -E "^\| (SparDA)|overlap" ;;
    decode-claims32-graph)  # decode-claims32 with sparda's prefetch in the graph (copy_start "graph") (~330 s)
      timeout 480 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparse sparda --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --budget-s 400 \
        --copy-start graph --out "$OUT/decode_claims32_graph.json" 2>&1 | grep -E "^\| (Sparse|SparDA)|SparDA / Sparse" ;;
    queues-ab)  # SparDA's full-depth reuse step took 9.38 ms at 7b25dc4 (CUDA_SCALE_LAUNCH_QUEUES=4x exported by the
                # shell) and 14.61 at 9eb6c5d (the CLI setting it in-process, positions staged by _own_buffer since).
                # Same code, one call: (a) the variable exported by the shell; (b) that with the staging off (~330 s)
      R="--lengths 131072 --batches 8 --layers 32 --repeats 12 --modes sparda --reuse-fractions 0.88 --budget-s 200"
      CUDA_SCALE_LAUNCH_QUEUES=4x timeout 260 python3 -m sparda_jax.cli bench decode $R \
        --out "$OUT/decode_queues_shell.json" 2>&1 | grep -E "^\| SparDA|warning"
      CUDA_SCALE_LAUNCH_QUEUES=4x timeout 260 python3 -c "
import sys
from sparda_jax.infer import engine
engine._own_buffer = lambda x: x  # diagnostic only: every layer reads the positions input, as before 23b2832
from sparda_jax.cli import main
sys.exit(main(sys.argv[1:]))" bench decode $R --out "$OUT/decode_queues_shell_nostaging.json" 2>&1 | grep -E "^\| SparDA|warning" ;;
    decode-variance)  # SparDA's full-depth reuse step took 9.4-14.6 ms over four calls (docs/decisions.md). One call:
                      # the same rows (sparse and sparda, random and reuse=0.88, 32 layers) compiled fresh into a
                      # persistent cache, then loaded from it (do autotuned fresh compiles differ?), then with XLA's
                      # SKIP_TEMP graph-update mode (fixed VMM addresses for temporaries: fewer re-recordings?) (~520 s)
      export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=5
      A="--lengths 131072 --batches 8 --modes sparse sparda --layers 32 --reuse-fractions 0.88 --repeats 16"
      for V in fresh cached; do
        timeout 200 python3 -m sparda_jax.cli bench decode $A --budget-s 170 --out "$OUT/decode_variance_$V.json" \
          2>&1 | grep -E "^\| (Sparse|SparDA)|warning"
      done
      unset JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 200 python3 -m sparda_jax.cli \
        bench decode $A --modes sparda --budget-s 150 --out "$OUT/decode_variance_skiptemp.json" 2>&1 \
        | grep -E "^\| (Sparse|SparDA)|warning|rror" ;;
    tests-doorbell)  # the doorbell's GPU tests alone (~70 s): the copy engine's with CUDA's lazy loading (the
                     # doorbell init preloads its kernels: at 329d606, without that, a ring loaded beside the
                     # server deadlocked), the engine's eager (its step's GEMMs would be loaded beside the
                     # server: runtime.set_eager_module_loading); timeline asserts in both
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_copy_engine.py -k "doorbell" 2>&1 | grep -vE "^(E[0-9]{4}|===|external/)" > "$OUT/gpu_tests_doorbell.log"
      CUDA_MODULE_LOADING=EAGER JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -m gpu -q -rf \
        -p no:cacheprovider tests/test_engine.py -k "doorbell" 2>&1 | grep -vE "^(E[0-9]{4}|===|external/)" \
        >> "$OUT/gpu_tests_doorbell.log"
      grep -E "passed|failed|error" "$OUT/gpu_tests_doorbell.log" ;;
    tests-loop)  # the device loop's GPU tests (infer.engine.engine_decode_steps: n steps in one program equal the
                 # steps called one by one, with the CUDA copies; the doorbell with eager loading, as the CLI sets) (~90 s)
      CUDA_MODULE_LOADING=EAGER JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -m gpu -q -rf \
        -p no:cacheprovider tests/test_engine.py -k "decode_steps_in_one" 2>&1 | grep -vE "^(E[0-9]{4}|===|external/)" \
        > "$OUT/gpu_tests_loop.log"
      grep -E "passed|failed|error" "$OUT/gpu_tests_loop.log" ;;
    claims32-loop)  # the batch-8 claim's rows at full depth, each timed call 8 decode steps in one program
                    # (--steps-per-call 8: the step's buffers keep their addresses inside a call, so XLA records its
                    # graphs once a call, not at every step), XLA's command-buffer log beside it (~300 s)
      logged_decode claims32_loop 540 "$CLAIMS_ROWS" "${CLAIMS32[@]}" --steps-per-call 8 --budget-s 480 ;;
    claims32-loop-mid)  # the same in the loop at the miss rates between (reuse 0.5 and 0.6: ~0.31 and ~0.25), where
                        # the fifteenth session's rows put the ratio's peak (SparDA's copy just under its compute):
                        # a projection of ~1.9 near 0.27 to test, not a claim (~300 s)
      logged_decode claims32_loop_mid 540 "$CLAIMS_ROWS" "${FULL32[@]}" \
        --modes sparse sparda --reuse-fractions 0.5 0.6 --copy-start doorbell --steps-per-call 8 --budget-s 480 ;;
    generate-loop)  # generate(steps_per_call=8) against the one-step loop: the same tokens, and the time a token
                    # (MiniCPM4.1-8B shapes, random weights, 8 layers, 4 prompts up to 32K; Sparse and SparDA) (~150 s)
      timeout 300 python3 scripts/probes/generate_loop.py --layers 8 --context 32768 --batch 4 \
        --out "$OUT/generate_loop.json" 2>&1 | grep -E "^\||\[generate\]|Error" ;;
    topk-count)  # the top-k by counting (topk_impl "xla_count": no sort) on the GPU: its tests (the 128K decode
                 # case against the host contract; in the engine's step against lax.top_k's blocks) and the loop's,
                 # then decode selection at 128K, batch 8 and 16, against lax.top_k (~250 s)
      CUDA_MODULE_LOADING=EAGER JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 python3 -m pytest -m gpu -q -rf \
        -p no:cacheprovider tests/test_kernel_select.py tests/test_engine.py \
        -k "compiled_decode_topk or (topk_kernel_equals and xla_count) or decode_steps_in_one" 2>&1 \
        | grep -vE "^(E[0-9]{4}|===|external/)" > "$OUT/gpu_tests_count.log"
      grep -E "passed|failed|error" "$OUT/gpu_tests_count.log"
      timeout 150 python3 -m sparda_jax.cli bench select --decode-only --lengths 131072 --decode-batches 8 16 \
        --variants forecast_xla forecast_xla@count_topk infllmv2_xla infllmv2_xla@count_topk --budget-s 110 \
        --out "$OUT/select_decode_count.json" 2>&1 | tail -8 ;;
    claims32-pool)  # the batch-8 claim's rows in the loop with the pool and the slots' miss ranks without
                    # reduce_window (lax.top_k kept: the top-k by counting lost, select_decode_count.json): random
                    # traffic, the peak's miss rate (reuse 0.62, ~0.23) and SmolLM2's (~420 s)
      logged_decode claims32_pool 560 "$CLAIMS_ROWS" "${FULL32[@]}" --modes sparse sparda --reuse-fractions 0.62 \
        --real-miss-rate sparse=0.122 sparda=0.086 --copy-start doorbell --steps-per-call 8 --budget-s 500 ;;
    claims32-split)  # what the batch-8 ratio is made of, in one call: Sparse+ (resident, no copy at all), Sparse,
                     # SparDA without and with prefetch, full depth, 8 steps a call, random traffic and reuse 0.62.
                     # The paper's SparDA beat its copy-free Sparse+ by 1.27 at batch 4 (240.2 against 189.5
                     # tokens/s): its selector saving, which the overlap multiplies (~450 s)
      logged_decode claims32_split 580 "^\| (Sparse|SparDA)|SparDA / Sparse" "${FULL32[@]}" \
        --modes sparse sparda sparse_resident sparda_sync --reuse-fractions 0.62 --copy-start doorbell \
        --steps-per-call 8 --budget-s 520 ;;
    claims32-split4)  # the same four systems at batch 4, the paper's batch with all four in its tables (Table 10:
                      # selector 1.47, prefetch 0.97, SparDA / Sparse+ 1.27), random traffic only (~330 s)
      logged_decode claims32_split4 560 "^\| (Sparse|SparDA)|^split" --lengths 131072 --batches 4 --layers 32 --repeats 12 \
        --modes sparse sparda sparse_resident sparda_sync --reuse-fractions --copy-start doorbell \
        --steps-per-call 8 --budget-s 480 ;;
    generate-loop32)  # the same at full depth (32 layers), SparDA alone, 3 calls of 8 (~300 s)
      timeout 420 python3 scripts/probes/generate_loop.py --layers 32 --context 32768 --batch 4 --systems sparda \
        --new-tokens 25 --out "$OUT/generate_loop32.json" 2>&1 | grep -E "^\||\[generate\]|Error" ;;
    write-token-ab)  # the new token's cache write with its slot computed once (scripts/probes/write_token_ab.py):
                     # SparDA, 16 layers, batch 8, 128K, doorbell, 8 steps a call, as is then with the barrier (~200 s)
      for V in as-is barrier; do
        timeout 150 python3 scripts/probes/write_token_ab.py --variant $V -- --lengths 131072 --batches 8 --layers 16 \
          --repeats 12 --modes sparda --reuse-fractions 0.88 --copy-start doorbell --steps-per-call 8 --budget-s 120 \
          --out "$OUT/decode_write_token_$V.json" 2>&1 | grep -E "^\| SparDA|Error" | sed "s/^/$V /"
      done ;;
    loop-ab)  # SparDA alone at full depth (doorbell, random and SmolLM2's miss rates), one step a call against 8 in one
              # program, in one call, each with XLA's command-buffer log (~300 s)
      for K in 1 8; do
        logged_decode sparda32_k$K 280 "^\| SparDA" "${FULL32[@]}" --modes sparda \
          --reuse-fractions --real-miss-rate sparda=0.086 --copy-start doorbell --steps-per-call $K --budget-s 240
      done ;;
    doorbell)  # the doorbell copies (copy_start "doorbell": a persistent server, rings and waits inside XLA's
               # graphs): their GPU tests, then SparDA at 4 layers, batch 8, 128K, lanes and doorbell with compute
               # alone and copies alone, then the doorbell at full depth (~420 s; its timeouts allow 710 s: a call of its own)
      bash "$0" tests-doorbell
      for S in lanes doorbell; do
        timeout 120 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 4 --repeats 12 \
          --modes sparda --reuse-fractions 0.88 --overlap --copy-start $S --budget-s 90 \
          --out "$OUT/decode_doorbell4_$S.json" 2>&1 | grep -E "^\| SparDA|^overlap|rror"
      done
      timeout 200 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparda --reuse-fractions 0.88 --copy-start doorbell --budget-s 160 \
        --out "$OUT/decode_doorbell32.json" 2>&1 | grep -E "^\| SparDA|rror|warning" ;;
    doorbell-timeline)  # where the doorbell step's time goes on reuse (4 layers: the step with copies took
                        # ~0.15 ms a layer more than compute alone + copies alone, decode_doorbell4_*.json):
                        # its GPU tests, then each job's ring, copy and wait on the device clock (rec["doorbell_timeline"]),
                        # at 4 layers with the overlap's timings, then at full depth with a budget that reaches
                        # the reuse row (~520 s)
      bash "$0" tests-doorbell
      timeout 150 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 4 --repeats 12 \
        --modes sparda --reuse-fractions 0.88 --overlap --copy-start doorbell --budget-s 110 \
        --out "$OUT/decode_doorbell4_timeline.json" 2>&1 | grep -E "^\| SparDA|^doorbell timeline|^overlap|rror"
      timeout 250 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparda --reuse-fractions 0.88 --copy-start doorbell --budget-s 220 \
        --out "$OUT/decode_doorbell32_timeline.json" 2>&1 | grep -E "^\| SparDA|^doorbell timeline|rror|warning" ;;
    update-modes)  # is SparDA's full-depth reuse step bound by XLA re-recording its graph? The doorbell timeline
                   # (decode_doorbell32_timeline.json, 85629b2) put layer 1's ring 10.4 ms into a synchronous
                   # step, then 265 us a layer; host 15.3 ms against ~9 ms of device work. XLA's update modes
                   # that give the graph's buffers stable addresses (VMM allocator, forced by the flag):
                   # SKIP_PROFILED (profiled temporaries, parameters, outputs), SKIP_TEMP (temporaries);
                   # XLA's command-buffer log counted per run (~420 s)
      A="--lengths 131072 --batches 8 --layers 32 --repeats 12 --modes sparda --reuse-fractions 0.88 --copy-start doorbell"
      for M in SKIP_PROFILED SKIP_TEMP; do
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_update_mode=$M" TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=3 timeout 240 python3 -m sparda_jax.cli bench decode $A --budget-s 200 \
          --out "$OUT/decode_update_$M.json" 2> "$OUT/update_$M.log" | grep -E "^\| SparDA|^doorbell timeline"
        echo "$M: $(grep -E 'needs_update=true' "$OUT/update_$M.log" | grep -cE 'num_commands=[0-9]{3,}') updates of the step's \
          big graph (>= 100 commands); $(grep -ciE 'error|warning' "$OUT/update_$M.log") error/warning lines"
        grep -iE "error|warning|VA remap|profil" "$OUT/update_$M.log" | sed -E 's/^[IWEF][0-9]{4} [0-9:.]+ +[0-9]+ //' \
          | cut -c1-220 | sort | uniq -c | sort -rn | head -8
        gzip -f "$OUT/update_$M.log"
      done ;;
    graph-record)  # the update modes' VMM allocator put pinned_host arrays in device memory (update-modes, f43841a:
                   # "h2d" 1064-1233 GB/s, the random-traffic copy at 140 GB/s), so their step is no offload. Under
                   # the default allocator, 16 layers: how long XLA's update of the step's one big graph takes
                   # (~150 us under VMM back to back, ~3 ms in synchronous steps), as is, with a larger trace
                   # cache for its captured commands, and with JAX's preallocated BFC pool; a profiled run for
                   # the host's events (GR_VARIANTS picks; default and profile ~360 s, 410 s at most)
      A="--lengths 131072 --batches 8 --layers ${GR_LAYERS:-16} --repeats 12 --modes sparda --reuse-fractions 0.88 --copy-start doorbell"
      XF0="${XLA_FLAGS:-}"
      for V in ${GR_VARIANTS:-default profile}; do  # also trace256 prealloc (150 s each): not in the same call
        F=""; P=false; [ $V = trace256 ] && F="--xla_cmd_buffer_trace_cache_size=256"; [ $V = prealloc ] && P=true
        # profile: 3 traced steps a row, the host's events and CUDA calls by time (bench/profile.py host_top,
        # host_api); XLA runs op by op under a profiler unless told to keep its command buffers
        [ $V = profile ] && F="--xla_enable_command_buffers_during_profiling=true"
        # the default also times the overlap's three (step, compute alone, copies alone) at 16 and 8 layers:
        # their difference is a layer's, free of the step's fixed costs (bench.decode.marginal)
        X=""; T=150; [ $V = default ] && X="--overlap --marginal-layers 8" && T=230
        [ $V = profile ] && X="--profile-steps 3" && T=180
        # XLA reads a XLA_FLAGS of blanks as a file name and aborts (the default variant at 2e96975): set it only when there are flags
        FL="$XF0${XF0:+${F:+ }}$F"; if [ -n "$FL" ]; then export XLA_FLAGS="$FL"; else unset XLA_FLAGS; fi
        XLA_PYTHON_CLIENT_PREALLOCATE=$P TF_CPP_MIN_LOG_LEVEL=0 \
          TF_CPP_VMODULE=command_buffer_thunk=3 timeout $T python3 -m sparda_jax.cli bench decode $A $X --budget-s $((T - 30)) \
          --out "$OUT/decode_record_$V.json" 2> "$OUT/record_$V.log" | grep -E "^\| SparDA|^doorbell timeline|^overlap|marginal|^ +(host|cuda) "
        echo "$V: big graph updates (us): $(grep -E 'Updated command buffer.*num_commands=[0-9]{3,}( |$)' "$OUT/record_$V.log" \
          | grep -o 'in [0-9]* ' | awk '{printf "%s ", $2}')"
        gzip -f "$OUT/record_$V.log"
      done
      if [ -n "$XF0" ]; then export XLA_FLAGS="$XF0"; else unset XLA_FLAGS; fi ;;
    pool-check)  # the engine's host pool check on the failure it guards against: under the VMM allocator that
                 # SKIP_TEMP forces, the benchmark's state build must refuse its pinned_host pool (~40 s)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 90 python3 -m sparda_jax.cli \
        bench decode --lengths 131072 --batches 8 --layers 4 --modes sparda --reuse-fractions --budget-s 60 \
        --out "$OUT/decode_pool_check.json" > "$OUT/pool_check.log" 2>&1
      echo "pool-check: rc $? (the bench records a failed row and exits 0: its row must read unavailable, refused pool)"
      grep -E "places it|RuntimeError|^\| SparDA" "$OUT/pool_check.log" | cut -c1-300 | head -4; gzip -f "$OUT/pool_check.log" ;;
    tests-memory-type)  # the host pool check's GPU test (~20 s)
      timeout 60 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_copy_engine.py -k memory_type 2>&1 | tail -2 ;;
    interference)  # does a UVA copy slow the HBM work beside it? scripts/probes/overlap_probe.cu outside XLA, the
                   # copy's pool 512 MiB and 16 GiB (the engine's spans 33 GB) (~100 s)
      PROBE_CONNS=inherited PROBE_POOLS=16384 bash scripts/probes/overlap_probe.sh ;;
    graph-updates)  # which of SparDA's graphs XLA re-records each step and how many allocations moved: 4 layers,
                    # batch 8, 128K, XLA's command-buffer log by step (scripts/probes/graph_updates.py): the
                    # engine's step, the step reading its positions input in every layer, and that with one
                    # input buffer for all steps; the thunk sequence after XLA's passes (~170 s)
      for V in fresh plain same; do  # staged positions (the engine's), unstaged, unstaged with one input buffer
        F=""; [ $V = plain ] && F="--no-staging"; [ $V = same ] && F="--same-inputs --no-staging"
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/thunks_$V --xla_dump_hlo_module_re=.*engine_decode.*" \
        TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_conversion_pass=2 timeout 150 \
          python3 scripts/probes/graph_updates.py --mode sparda --layers 4 --steps 6 $F > "$OUT/graph_updates_$V.log" 2>&1
        python3 scripts/probes/graph_updates.py --summarize "$OUT/graph_updates_$V.log"
      done
      find /tmp/thunks_fresh -name "*thunk_sequence*" -exec cp {} "$OUT/" \; ; ls "$OUT"
      gzip -f "$OUT"/graph_updates_*.log ;;
    hlo-graphs)  # which ops of the decode step XLA leaves outside its command buffers (CUDA graphs): at full
                 # depth SparDA ran 33 graphs of 5 commands a step, Sparse one graph of every kernel
                 # (decode_depth_*.json, XLA's VLOG). The optimized HLO of both steps at 4 layers, batch 8, 128K
                 # (~80 s), summarised by scripts/probes/graph_cuts.py, kept as one archive
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo_graphs --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*engine_decode.*" \
      timeout 150 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --modes sparse sparda \
        --reuse-fractions 0.88 --budget-s 100 --repeats 2 --out "$OUT/decode_hlo_graphs.json" 2>&1 | grep -E "^\| (Sparse|SparDA)"
      find "$OUT/hlo_graphs" -type f ! -name "*after_optimizations.txt" -delete
      python3 scripts/probes/graph_cuts.py "$OUT"/hlo_graphs/*after_optimizations.txt
      tar czf "$OUT/hlo_graphs.tgz" -C "$OUT" hlo_graphs && rm -rf "$OUT/hlo_graphs" "$OUT/decode_hlo_graphs.png" ;;
    decode-depth-one)  # SparDA at full depth with K and V in one start (half the graph cuts), launch queues 4x,
                       # random and reuse=0.88 rows (~150 s)
      timeout 175 python3 -m sparda_jax.cli bench decode --lengths 131072 --batches 8 --layers 32 --repeats 12 \
        --modes sparda --reuse-fractions 0.88 --copy-start one --budget-s 150 --out "$OUT/decode_depth_one.json" \
        2>&1 | grep -E "^\| (Sparse|SparDA)" ;;
    test-trace)  # the copy engine's timeline test alone
      timeout 120 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_copy_engine.py -k trace 2>&1 | tail -3 ;;
    decode-auto)  # the claims' pairs with the autotuned CTA count (16 CTAs copy a 32 MiB layer at 29 GB/s of the
                  # 51 GB/s bulk rate: copy.json's overlap rows), SmolLM2's miss rates from decode.json
      timeout 300 python3 -m sparda_jax.cli bench decode --modes sparse sparda sparda_sync --batches 8 16 --ctas auto \
        --reuse-fractions --real-miss-rate sparse=0.122 sparda=0.086 --budget-s 200 --out "$OUT/decode_auto.json" 2>&1 | tail -30 ;;
    prefill)     # bench: Dense / Sparse / SparDA prefill tokens/s, batch 4, at 128K only (Table 3's claim;
                 # the two sparse systems alone took 150 s of a 130 s budget in the first run)
      timeout 330 python3 -m sparda_jax.cli bench prefill --lengths 131072 --budget-s 260 \
        --out "$OUT/prefill.json" 2>&1 | tail -20 ;;
    cta)         # bench: decode tokens/s vs CTA quota at 32K (Table 7); 16 timed steps: 6 left 12% noise
      timeout 260 python3 -m sparda_jax.cli bench cta --repeats 16 --budget-s 150 --out "$OUT/cta.json" 2>&1 | tail -20 ;;
    train32k)    # the 8B Forecast step at 32K (fits since the fused-gradient loss)
      timeout 300 python3 -m sparda_jax.cli bench train --preset minicpm4.1-8b --seq-len 32768 --repeats 3 \
        --out "$OUT/train_32k.json" 2>&1 | tail -8 ;;
    train64k)    # the paper's MiniCPM training length
      timeout 400 python3 -m sparda_jax.cli bench train --preset minicpm4.1-8b --seq-len 65536 --repeats 2 \
        --out "$OUT/train_64k.json" 2>&1 | tail -8 ;;
    eval-tasks)  # the accuracy table: every task, every mode, 2K..8K (1K equals dense at budget 24: eval/results/tasks_smollm2_partial.md)
                 # 2K + 4K alone took calls of 566 s (cut at 53 of 64 cells) + 230 s on the H200: use the split stages
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 560 python3 -m sparda_jax.cli eval --suite tasks \
        --lengths 2048 4096 8064 --samples 20 --out "$OUT/tasks_smollm2.json" 2>&1 | tail -40 ;;
    eval-8k-a|eval-8k-b)  # 8K (8064: 8192 positions less the answer) in two calls of 16 cells, 454 s + 399 s on the H200, merged by eval.report
      if [ "$stage" = eval-8k-a ]; then T="niah_single niah_multikey niah_multivalue niah_multiquery"; else T="vt cwe fwe copy"; fi
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 560 python3 -m sparda_jax.cli eval --suite tasks --tasks $T \
        --lengths 8064 --samples 20 --out "$OUT/tasks_smollm2_8k_${stage#eval-8k-}.json" 2>&1 | tail -12 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
