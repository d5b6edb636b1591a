#!/usr/bin/env bash
# One device call that checks, then times, what the open issues still need measured, each phase
# under its own budget so a slow one cannot starve the rest. Results land in $OUT (the device
# tool's folder; ./gpu-out elsewhere), one file per phase, plus <phase>.log with its output.
#
#   bash bench/gpu_session.sh tests families moe train decode dpo
#   LIMIT_train=250 LIMIT_decode=280 bash bench/gpu_session.sh train decode   # per-phase limits
#
# Phases:
#   tests     pytest -m gpu over the data, decode, kernel and model rooms' CUDA tests (gradio is absent there)
#   picked    pytest -m gpu over the files TESTS names (space-separated), e.g. the tests of what changed since the
#             last call, in PICKED_WORKERS (4) processes (in session 36 the default, one per core, spent 200 s starting)
#   traintests  pytest -m gpu over recompute and training's CUDA tests
#   families  Qwen3.5 and Gemma 4 QLoRA against Unsloth, packed batches (issue 26's dense target);
#             FAMILIES=gemma4-e2b runs one of them
#   qwen35pair  Qwen3.5-9B QLoRA packed, Kestrel (auto, settled: its packed batches make one layout) and
#             Unsloth in one call (side by side), one process each, the same adapters; a fresh machine spends
#             about 100 s building the 9B folder first, and Unsloth's warm-up took 160 s with .gpu-autotune.tar
#   lintests  the linear-attention GPU tests alone (flash-linear-attention tunes each kernel on first use:
#             the 17 tests took more than 240 s in one process on an H200)
#   moe       Qwen3-MoE and gpt-oss 16-bit LoRA against HF+PEFT (issue 26's MoE target)
#   train     the 8B QLoRA bench, offloaded checkpointing, Kestrel and Unsloth (issue 25's figure)
#   decode    batch-1 and rollout decode at the 8B shape, Kestrel and Unsloth (issue 25's figure)
#   dpo       DPO QLoRA at the 8B shape (issue 27's target): Kestrel (the default, auto checkpointing: offload
#             on one GPU), TRL and Unsloth, each in its own process, 60 steps (median, settled and mean rates)
#   dpoeval   Kestrel's DPO: one short warm-up run with evaluation (12 steps: a process's first steps,
#             and its first generation check's decode, compile Triton kernels into the machine's cache,
#             which made a fresh machine's first run about 9 s slower, and its first check 5 s slower),
#             then DPOEVAL_STEPS (160) steps four times in the order with, without, without, with
#             evaluation (5% of the pairs held out, the default interval; ABBA, so a drift over the call
#             cancels). What evaluation adds is the mean of the two "with" runs' wall time over the mean
#             of the two "without" (issue 27: at most 5%)
#   gencheck  the end-of-run generation check alone on the 8B QLoRA shape (8 prompts of 512 tokens, 256 new):
#             as the product runs it (uncompiled; twice, then once profiled: kernel time by kind per
#             decode step), then with a compiled generator in a process of its own (what it replaced)
#   reserved  what holds a padded cell's reserved memory (Llama-3.2-1B LoRA padded, auto graphs, 80 steps):
#             reserved by pool (default, each CUDA-graph pool) after the step that set the run's reserved
#             peak, and each step's allocated and reserved peaks (bench/graph_memory.py)
#   poolfree  whether dropping the graphs gives their pool back at once (a re-timing drops them: Qwen3-14B packed
#             kept 0.5 GiB of pool beside its eager steps, session 41): POOL_MODEL (qwen3-4b) QLoRA packed, graphs on,
#             12 steps, released after step 8; the pools right after (bench/graph_memory.py)
#   capture   where the backward graphs are captured (`performance.backward_graph_capture`): CAPTURE_MODEL (qwen3-14b)
#             QLoRA CAPTURE_LAYOUT (packed), graphs auto, CAPTURE_STEPS (30) steps, once per mode in CAPTURE_MODES (backward, then first_pass), each
#             step's allocated and reserved peaks (bench/graph_memory.py; CAPTURE_TRACE=-1 records the whole run and
#             reports the moment of its reserved peak by stream and site); session 42 traced the run's reserved peak,
#             0.46 GiB over Unsloth's, to the step that captured the backward graphs after an eager first pass
#   glutiles  the 16-bit MLP's GLU with the adapters' rank terms inside, its tilings swept against the plain GLU
#             (bench/glu_lowrank_tiles.py: chosen on --tune shapes, reported on --check shapes)
#   dpostd    Kestrel's DPO with standard checkpointing, 60 steps; then one untimed run that records the
#             allocator to say which step set the run's memory peak, and where
#   q35mem    what is alive at Qwen3.5-9B QLoRA's eager memory peak (graphs off: the peak the chooser's eager
#             steps set, 0.30 GiB over Unsloth's in session 34), by allocating site
#   gemma4peak what is alive at Gemma-4-E2B QLoRA's whole-run memory peak (set while the layer graphs are
#             captured; 0.08 GiB over Unsloth's in session 22), by allocating site
#   nf4       NF4 decode (issue 24): the GEMV tile sweep, then its second phase (block parts and
#             pipelined stages around the fastest tiles); writes the plans it picked
#   nf4decode 8B NF4 decode at batch 1 and 8 against its bandwidth bound and the dequantized 16-bit
#             path's tokens, with the plans in the checkout (commit the sweep's table first)
#   qwen35    where a Qwen3.5-9B QLoRA step's time goes (bench/profile_train.py): where flash-linear-attention
#             refuses its backward (Hopper under Triton 3.4-3.7.0), its gated-delta-rule layers train on
#             Kestrel's stand-in (kestrel/kernels/gated_delta.py) once its probe passes
#   gated     one gated-delta-rule op at Qwen3.5-9B's shape (1 x 4,096), forward and backward: Kestrel's stand-in,
#             flash-linear-attention's own (where its backward runs) and HF's PyTorch function, each checked
#             against HF's in fp32, then timed (bench/gated_delta.py)
#   packing   the linear-attention short convolution at Qwen3.5-9B's shape (bench/short_conv.py: HF's, fla's,
#             Kestrel's kernel and reference), then, each in its own process, the packed-rows tests (the CUDA
#             one: a packed tiny Qwen3.5 equals each sample alone), the kernel's tests and the patched-model test
#   conv      the short convolution alone: bench/short_conv.py (as in `packing`), again at 3 x 1,000 tokens (a
#             row count the backward's settings were not timed at), and its kernel's CUDA tests
#   moedecode a MoE layer's decode step at the Qwen3-30B-A3B and gpt-oss-20b shapes: gathered weights
#             against the expert GEMV kernel, 16-bit and NF4 (bench/moe_decode.py)
#   gate      what paging the MLP gate product out costs or saves (offloaded checkpointing): QLoRA packed, graphs
#             forced on, for each of GATE_MODELS (qwen2.5-7b,qwen3-4b) at KESTREL_OFFLOAD_GATE = each of GATES
#             (1 0.5 0: the share of layers that page it out), one process each, into $OUT/gate-<share>.jsonl,
#             then a line a record. On a card whose host link is slow against its matrix rate,
#             a forward whose copies out take longer than its work waits for them (bench/RESULTS.md, session 35)
#   expand    reserved memory and speed with torch's fixed segments against expandable ones (`performance.cuda_allocator`,
#             expandable by default since session 39): Kestrel (auto) on EXPAND_MODELS (qwen3-0.6b,llama-3.2-1b) QLoRA,
#             EXPAND_LAYOUTS (padded,packed), PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False then :True (the variable
#             wins over the run's setting), one process a cell (records say `alloc_conf` and `cuda_allocator`)
#   capstream the layer graphs captured on a side stream against the steps on a stream of their own with the graphs
#             captured there (`performance.capture_stream`, KESTREL_CAPTURE_STREAM=side then steps), Kestrel (auto) on
#             CAPSTREAM_CELLS (model:method:layout, comma-separated), one process a cell, ABBA (side, steps, steps, side:
#             a drift over the call cancels); records say `capture_stream`. Its GPU test runs first
#   cefloor   the fused loss's chunk rows (128-768) against 512, the frozen head's floor, on every (hidden, vocabulary)
#             of the matrix's models at 4,096 and 8,192 tokens: time and peak memory, and the chunk the device's ridge
#             point names (bench/ce_floor.py; the 148 MiB chunk buffer sat at a small model's reserved peak, session 46)
#   productloop the product's own SFT loop (kestrel.training.run, as the studio runs it) with the host a step ahead of
#             the GPU (the default on CUDA since session 48) against step by step, ABBA, one process a run, on
#             LOOP_MODEL (llama-3.2-1b) LOOP_METHOD (lora), packed rows of 4,096 (bench/product_loop.py): wall-clock tokens/s
#   gradprod  the adapters' fp32 weight-gradient products at GRAD_SHAPE's (qwen2.5-7b) shapes: cuBLAS with an fp32
#             output, upcast with TF32, upcast fp32, with their errors and kernel names (bench/lora_grad_products.py)
#   imagehead an image-text checkpoint trained on text: Kestrel's head (the chunked loss) against HF's image-text
#             forward, HEAD_MODEL's (gemma3-4b) language model in its image-text class, HEAD_METHOD (qlora),
#             HEAD_LAYOUT (packed), ABBA, one process a run (bench/image_text_head.py)
#   lorastep  where a long step's time goes under 16-bit LoRA and under QLoRA (LORASTEP_METHODS): LORASTEP_SHAPE's
#             (llama-3.2-1b) matrix long cell as the matrix runs it (one row of 8,192 through the product's batch plan,
#             checkpointing and allocator: bench/profile_train.py --layout long), graphs auto as the cell's, 30 warm-ups
#             (forced on, a first pass is never timed, so keep_attention: auto keeps nothing: session 46): its kernel kinds
#             (the 16-bit LoRA long cells sit at 1.14-1.19x Unsloth while QLoRA's reach 1.21x; session 40). Until
#             session 42 the profile fed a plain (1, 8192) batch, which took the SDPA path, not the matrix's varlen one;
#             LORASTEP_UNSLOTH=1 profiles Unsloth's step on the same row after each, in its own process
#   defer     the recomputed MLP deferred to its backward wherever that saves memory (KESTREL_DEFER_MLP=memory, the
#             default) and only where whole rows would not fit (fit: whole rows, their gate product paged), then
#             Unsloth, for each of DEFER_MODELS (llama-3.2-3b,gemma3-1b,qwen3-4b), QLoRA, DEFER_LAYOUTS (default long), one process each;
#             DEFER_WAYS picks among "memory fit unsloth" (fit's records give the link rate and layer times
#             it decided from); DEFER_HARD (230) the seconds a run may take (Unsloth's Gemma-3-1B long run did not
#             finish in 230 s in session 38: DEFER_HARD=400 with LIMIT_defer_gemma3_1b_unsloth=420)
#   keepattn  the attention op alone at 8,192 tokens (bench/kept_attention.py: recomputed against kept, errors and
#             times), then long rows keeping each layer's attention output for its recompute (KESTREL_KEEP_ATTENTION=on / auto): graphs
#             off without and with it, then auto graphs without it and with keep_attention auto, for each of
#             KEEP_MODELS (default llama-3.2-1b,qwen3-4b,mistral-7b), QLoRA, one process each; KEEP_RUNS picks
#             graphs:keep[:defer_mlp[:keep_projection[:keep_qkv]]] runs (default "off:off off:on auto:off auto:auto";
#             defer_mlp defaults to KESTREL_DEFER_MLP or memory, keep_projection to on, keep_qkv to off). Q, K and V kept
#             too, against the default: KEEP_RUNS="auto:auto:memory:on:off auto:auto:memory:on:on", KEEP_LAYOUTS the layouts (long),
#             KEEP_OP= (empty) skips the op alone. The output projection kept too, against the default:
#             KEEP_RUNS="auto:auto:memory:off auto:auto:memory:on"
#             The link plan, every combination: KEEP_RUNS="auto:off:memory auto:off:fit auto:auto:memory auto:auto:fit"
#   matrix    issue 24's whole matrix (bench/matrix.py: every model, method, layout and system) on every
#             GPU of the host (--gpus all), one chunk under the phase's limit, Kestrel's chooser settled
#             (--settle $MATRIX_SETTLE, default 160). It resumes from bench/results/$MATRIX_FILE (default
#             matrix-all.jsonl) when the checkout has it, and writes $OUT/$MATRIX_FILE: after the call, copy
#             it back from the reply's files_at (cp <files_at>/matrix-all.jsonl bench/results/) and commit,
#             so the next call's checkout carries it and runs only the pairs still missing.
#             MATRIX_ARGS adds options (e.g. MATRIX_ARGS="--models qwen3-4b,gemma3-4b"). To measure again the cells short
#             of a target whose Kestrel record predates today's default settings, into a file of their own (copied back
#             into bench/results/ after each call, so the next call resumes it):
#             MATRIX_FILE=again.jsonl MATRIX_ARGS="--cells $(python bench/matrix.py --behind bench/results/matrix-all.jsonl)"
#
# Needs .gpu-site (and .gpu-anchors for the baselines; .gpu-fla, flash-linear-attention, for Qwen3.5)
# carried with the checkout; see bench/RESULTS.md for how they are built.
#
# Two phases at once on a host with two GPUs: one run of this script per GPU, each with its own OUT and its own
# matrix model folders (a matrix run removes the other models' folders under its root):
#   CUDA_VISIBLE_DEVICES=0 KESTREL_MATRIX_MODELS=/tmp/m0 OUT=$OUT/a bash bench/gpu_session.sh qwen35pair &
#   CUDA_VISIBLE_DEVICES=1 KESTREL_MATRIX_MODELS=/tmp/m1 OUT=$OUT/b bash bench/gpu_session.sh matrix & wait
# The device tool brings back at most eight files a call (session 42 lost a sweep's results to that): by default
# everything this run wrote under $OUT is packed into $OUT/results.tar at the end (appending to one already there)
# and the loose files removed (gpu-autotune.tar stays beside it); BUNDLE=0 leaves them loose.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
KEEP_MODELS="${KEEP_MODELS:-llama-3.2-1b,qwen3-4b,mistral-7b}" DEFER_MODELS="${DEFER_MODELS:-llama-3.2-3b,gemma3-1b,qwen3-4b}" GATE_MODELS="${GATE_MODELS:-qwen2.5-7b,qwen3-4b}" GATES="${GATES:-1 0.5 0}" EXPAND_MODELS="${EXPAND_MODELS:-qwen3-0.6b,llama-3.2-1b}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# flash-linear-attention (Qwen3.5's gated-delta-rule kernels, requirements.txt), when carried as .gpu-fla
[ -d .gpu-fla ] && export PYTHONPATH="$PWD/.gpu-fla:$PYTHONPATH"

# Triton's autotuning results. flash-linear-attention tunes every kernel at each new shape, which took
# 258-303 s of a fresh machine's first Qwen3.5-9B steps (sessions 32-33). Each call's results (the small
# *.autotune.json files, not the compiled kernels) come back as one archive, $OUT/gpu-autotune.tar (the
# device tool returns a limited number of files per call: 6 of 39 loose files came back in session 33).
# Copy it into the checkout (cp <files_at>/gpu-autotune.tar .gpu-autotune.tar) and carry it: the next call
# starts with them, and adds its own. Tuning happens before any timed step, so no timing changes; every
# system shares the cache.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpu-autotune.tar ] && tar -xkf .gpu-autotune.tar -C "$TRITON_CACHE_DIR" 2>/dev/null
save_autotune() {
    (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 | tar --null -cf "$OUT/gpu-autotune.tar" -T -)
    echo "$(tar -tf "$OUT/gpu-autotune.tar" | grep -c autotune.json) autotuning results in $OUT/gpu-autotune.tar"
}
bundle() {  # one archive of everything under $OUT, the loose files removed (BUNDLE=0: not); appended to, so a
    # second run of this script in one call adds to the first's archive (it used to replace it: session 41)
    [ "${BUNDLE:-1}" = 1 ] || return 0
    (cd "$OUT" && find . -type f ! -name results.tar ! -name gpu-autotune.tar -print0 | tar --null -rf results.tar -T - --remove-files)
    echo "results in $OUT/results.tar"
}
trap 'save_autotune; bundle' EXIT

# Two phases, each within one call: 215 tests took more than 420 s on an H200 (session 22).
GPU_TESTS=(tests/data/test_flat_batches.py tests/decode tests/kernels tests/model)
GPU_TRAIN_TESTS=(tests/recompute tests/training/test_small_updates.py tests/training/test_train_gpu.py
                 tests/training/test_preference_ahead.py)

phase() {  # phase NAME SECONDS COMMAND...: run it with a wall-clock limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    local override="LIMIT_${1//[^A-Za-z0-9_]/_}"  # e.g. LIMIT_train=240 shortens one phase to fit a call
    limit=${!override:-$limit}
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout --kill-after=20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name exit $? $(date +%T)"
}

records() {  # one line a matrix record of the files given: what ran, under which settings, how fast, how large
    python -c "import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        print(path.rsplit('/', 1)[-1], r['model'], r['layout'], r['system'], 'offload_gate', r.get('offload_gate'),
              'alloc_conf', repr(r.get('alloc_conf')), 'defer', r.get('defer_mlp'), r.get('mlp_deferral'), 'keep_attention',
              r.get('keep_attention'), r.get('attention_kept'), 'projection', r.get('keep_projection'), r.get('projection_kept'), 'qkv', r.get('qkv_kept'), 'capture', r.get('backward_graph_capture'), 'link', r.get('host_link'), r.get('cuda_graphs'),
              round(r.get('tokens_per_s') or 0), 'tok/s, peak GiB alloc',
              r.get('peak_alloc_gib'), 'reserved', r.get('peak_reserved_gib'), r.get('error', '')[-200:])" "$@"
}

matrix() {  # the whole matrix, resumed from bench/results/$MATRIX_FILE; a pair is started until 170 s
    # before the phase's limit and one still running 40 s before it is stopped and left for the next call
    local file="${MATRIX_FILE:-matrix-all.jsonl}" limit=${LIMIT_matrix:-570}
    [ -f "bench/results/$file" ] && [ ! -f "$OUT/$file" ] && cp "bench/results/$file" "$OUT/$file"
    # shellcheck disable=SC2086  # MATRIX_ARGS holds several options
    phase matrix "$limit" python bench/matrix.py --models all --methods all --layouts all --systems all \
        --gpus all --settle "${MATRIX_SETTLE:-160}" --budget-s $((limit - 170)) --hard-s $((limit - 40)) \
        --out "$OUT/$file" ${MATRIX_ARGS:-}
    grep -hE "pairs to run|budget of|chunk's end|ahead did not" "$OUT/matrix.log" | tail -n 20
    echo "$(wc -l <"$OUT/$file" 2>/dev/null || echo 0) records in $OUT/$file"
}

for want in "$@"; do
    case $want in
        tests)    phase tests 420 python -m pytest -q -m gpu -p no:cacheprovider -rf "${GPU_TESTS[@]}" ;;
        picked)   phase picked "${LIMIT_picked:-300}" python -m pytest -q -m gpu -p no:cacheprovider -rf -n "${PICKED_WORKERS:-4}" \
                      ${TESTS:?TESTS names the test files} ;;
        traintests) phase traintests 420 python -m pytest -q -m gpu -p no:cacheprovider -rf "${GPU_TRAIN_TESTS[@]}" ;;
        families) phase families "${LIMIT_families:-330}" python bench/matrix.py --models "${FAMILIES:-qwen3.5-9b,gemma4-e2b}" \
                      --methods qlora --layouts packed --systems kestrel,unsloth --budget-s $((${LIMIT_families:-330} - 60)) \
                      --out "$OUT/families.jsonl" ;;
        qwen35pair) phase qwen35pair 560 python bench/matrix.py --models qwen3.5-9b --methods qlora --layouts packed \
                      --systems kestrel,unsloth --settle 120 --budget-s 380 --hard-s 540 --cell-timeout 400 \
                      --out "$OUT/qwen35pair.jsonl" ;;
        lintests) phase lintests 560 python -m pytest -q -n0 -m gpu -p no:cacheprovider -rf \
                      tests/model/test_linear_attention.py tests/kernels/test_gated_delta.py ;;
        moe)      phase moe 330 python bench/matrix.py --models qwen3-30b-a3b,gpt-oss-20b --methods lora \
                      --layouts packed --systems kestrel,hf --budget-s 270 --out "$OUT/moe.jsonl" ;;
        train)    phase train 300 python bench/train.py --all --impls unsloth,kestrel --checkpointing offload \
                      --steps 8 --warmup 12 --out "$OUT/train_off.json" ;;
        decode)   phase decode 300 python bench/decode.py --baseline unsloth --skip-hf --out "$OUT/decode.json" ;;
        dpo)      phase dpo 540 python bench/dpo.py --impls kestrel,trl,unsloth --steps 60 --warmup 3 --out "$OUT/dpo.json" ;;
        dpoeval)  phase dpoeval 560 bash -c "python bench/dpo.py --impls kestrel --steps 12 --warmup 3 --eval-split 0.05 --out $OUT/dpo-warm.json \
                      || exit 1; for e in 0.05 0 0 0.05; do n=\$((n + 1)); python bench/dpo.py --impls kestrel \
                      --steps ${DPOEVAL_STEPS:-160} --warmup 3 --eval-split \$e --out $OUT/dpo-eval\$e-run\$n.json \
                      || exit 1; done" ;;
        gencheck) phase gencheck 500 bash -c "python bench/decode_memory.py --layers 0 --prompts 8 --prompt-len 512 \
                      --new 256 --profile $OUT/gencheck-prof.txt --out $OUT/gencheck.txt && python bench/decode_memory.py \
                      --layers 0 --prompts 8 --prompt-len 512 --new 256 --compile --out $OUT/gencheck-compiled.txt" ;;
        reserved) phase reserved 400 python bench/graph_memory.py --model llama-3.2-1b --method lora --layout padded \
                      --graphs auto --steps 80 --out "$OUT/reserved.txt" ;;
        poolfree) phase poolfree 300 python bench/graph_memory.py --model "${POOL_MODEL:-qwen3-4b}" --method qlora \
                      --layout packed --graphs on --steps 12 --release-at 8 --out "$OUT/poolfree.txt" ;;
        capture)  for mode in ${CAPTURE_MODES:-backward first_pass}; do
                      phase "capture-$mode" 200 env KESTREL_BACKWARD_CAPTURE=$mode python bench/graph_memory.py \
                          --model "${CAPTURE_MODEL:-qwen3-14b}" --method qlora --layout "${CAPTURE_LAYOUT:-packed}" \
                          --graphs auto --steps "${CAPTURE_STEPS:-30}" --trace-step "${CAPTURE_TRACE:-0}" \
                          --out "$OUT/capture-$mode.txt"; done ;;
        glutiles) phase glutiles "${LIMIT_glutiles:-500}" python bench/glu_lowrank_tiles.py --out "$OUT/glu_lowrank_tiles.json" ;;
        dpostd)   phase dpostd 300 bash -c "python bench/dpo.py --impls kestrel --checkpointing standard --steps 60 --warmup 3 \
                      --out $OUT/dpo-standard.json && python bench/dpo.py --impl kestrel --steps 8 \
                      --memory-history $OUT/dpo-peak.txt --out $OUT/dpo-history.json" ;;
        # The sweep writes its plans into kestrel/kernels/decode/nf4_gemv_tiles.json there and beside
        # $OUT: copy that file into the checkout and commit it before `nf4decode` (a later call starts fresh).
        # Each shape's plan is stored as soon as it is done; NF4_SHAPES=qkv,o (then gate_up,down) splits it over calls.
        nf4)      phase nf4 560 python bench/nf4_gemv_sweep.py --shapes "${NF4_SHAPES:-qkv,o,gate_up,down}" \
                      --out "$OUT/nf4_sweep.json" ;;
        q35mem)   phase q35mem 300 python bench/graph_memory.py --model qwen3.5-9b --graphs off --steps 5 \
                      --trace-step -1 --out "$OUT/qwen35-mem.txt" ;;
        gemma4peak) phase gemma4peak 540 python bench/graph_memory.py --model gemma4-e2b --graphs auto --steps 20 \
                      --trace-step -1 --out "$OUT/gemma4-peak.txt" ;;
        nf4decode) phase nf4decode 540 python bench/nf4_decode.py --skip-modules --dense separate --new-tokens 128 \
                      --out "$OUT/nf4_decode.json" ;;
        gated)    phase gated 200 python bench/gated_delta.py --shape qwen3.5-9b --seq 4096 --out "$OUT/gated_delta.json" ;;
        qwen35)   phase qwen35 300 python bench/profile_train.py --shape qwen3.5-9b --method qlora --stack --out "$OUT/qwen35-prof.txt" ;;
        packing)  phase packing 540 bash -c "python bench/short_conv.py --out $OUT/short_conv.json; for t in \
                      tests/model/test_linear_attention_packing.py tests/kernels/test_short_conv.py \
                      tests/model/test_linear_attention.py::test_patched_qwen3_5_trains_on_cuda_with_whatever_fla_allows; \
                      do python -m pytest -q -n0 -p no:cacheprovider -rf --durations=5 \$t; done" ;;
        conv)     phase conv 240 bash -c "python bench/short_conv.py --out $OUT/short_conv.json; python bench/short_conv.py \
                      --batch 3 --seq 1000 --out $OUT/short_conv-3x1000.json; python -m pytest -q -n0 \
                      -p no:cacheprovider -rf tests/kernels/test_short_conv.py" ;;
        moedecode) phase moedecode 240 python bench/moe_decode.py --out "$OUT/moe_decode.json" ;;
        expand)   for way in off on; do
                      conf="expandable_segments:False"; [ "$way" = on ] && conf="expandable_segments:True"
                      phase "expand-$way" 280 env PYTORCH_CUDA_ALLOC_CONF="$conf" python bench/matrix.py \
                          --models "$EXPAND_MODELS" --methods qlora --layouts "${EXPAND_LAYOUTS:-padded,packed}" --systems kestrel --settle 160 \
                          --budget-s 200 --hard-s 270 --out "$OUT/expand-$way.jsonl"; done
                  records "$OUT"/expand-*.jsonl ;;
        productloop) phase productloop "${LIMIT_productloop:-420}" python bench/product_loop.py --model "${LOOP_MODEL:-llama-3.2-1b}" \
                      --method "${LOOP_METHOD:-lora}" --out "$OUT/product_loop.json" ;;
        imagehead) phase imagehead "${LIMIT_imagehead:-420}" python bench/image_text_head.py --model "${HEAD_MODEL:-gemma3-4b}" \
                      --method "${HEAD_METHOD:-qlora}" --layout "${HEAD_LAYOUT:-packed}" --out "$OUT/image_text_head.json" ;;
        cefloor)  phase cefloor "${LIMIT_cefloor:-180}" python bench/ce_floor.py --out "$OUT/ce_floor.json" ;;
        capstream) phase capstream-test 150 python -m pytest -q -n0 -p no:cacheprovider -rf tests/recompute/test_capture_stream.py
                  n=0; for way in side steps steps side; do n=$((n + 1))
                      phase "capstream-$n-$way" "${LIMIT_capstream:-150}" env KESTREL_CAPTURE_STREAM="$way" python bench/matrix.py \
                          --cells "${CAPSTREAM_CELLS:-qwen3-0.6b:qlora:packed,qwen2.5-0.5b:qlora:padded}" --systems kestrel \
                          --settle 160 --budget-s $((${LIMIT_capstream:-150} - 60)) --hard-s $((${LIMIT_capstream:-150} - 10)) \
                          --out "$OUT/capstream-$n-$way.jsonl"; done
                  records "$OUT"/capstream-*.jsonl ;;
        lorastep) for method in ${LORASTEP_METHODS:-lora qlora}; do  # where the 16-bit step's time goes, beside QLoRA's
                      phase "lorastep-$method" 200 python bench/profile_train.py \
                          --shape "${LORASTEP_SHAPE:-llama-3.2-1b}" --method "$method" --layout long \
                          --warmup 30 --out "$OUT/lorastep-$method.txt"
                      # LORASTEP_UNSLOTH=1: Unsloth's step on the same row (one row of 8,192, its own offloaded
                      # checkpointing), in a process of its own, for the kernel-by-kernel comparison
                      [ -n "${LORASTEP_UNSLOTH:-}" ] && phase "lorastep-$method-unsloth" 240 env \
                          PYTHONPATH="$PWD/.gpu-anchors:$PYTHONPATH" python bench/profile_train.py --impl unsloth \
                          --shape "${LORASTEP_SHAPE:-llama-3.2-1b}" --method "$method" --batch 1 --seq 8192 \
                          --checkpointing offload --warmup 16 --out "$OUT/lorastep-$method-unsloth.txt"; done ;;
        gradprod) phase gradprod 120 python bench/lora_grad_products.py --shape "${GRAD_SHAPE:-qwen2.5-7b}" \
                      --out "$OUT/grad_products.json" ;;
        gate)     for model in ${GATE_MODELS//,/ }; do for g in $GATES; do
                      phase "gate-$model-$g" 200 env KESTREL_OFFLOAD_GATE="$g" python bench/matrix.py --models "$model" \
                          --methods qlora --layouts packed --systems kestrel-on --budget-s 150 --hard-s 190 \
                          --out "$OUT/gate-$g.jsonl"; done; done
                  records "$OUT"/gate-*.jsonl ;;
        defer)    for model in ${DEFER_MODELS//,/ }; do for way in ${DEFER_WAYS:-memory fit unsloth}; do
                      sys=kestrel; [ "$way" = unsloth ] && sys=unsloth
                      phase "defer-$model-$way" 240 env KESTREL_DEFER_MLP="${way/unsloth/memory}" python bench/matrix.py \
                          --models "$model" --methods qlora --layouts "${DEFER_LAYOUTS:-long}" --systems $sys \
                          --budget-s 180 --hard-s "${DEFER_HARD:-230}" --out "$OUT/defer-$way.jsonl"; done; done
                  records "$OUT"/defer-*.jsonl ;;
        keepattn) [ -n "${KEEP_OP-1}" ] && phase keepattn-op 120 bash -c "python bench/kept_attention.py --shape qwen3-4b \
                      --out $OUT/kept_attention.json; python bench/kept_attention.py --shape llama-3.2-1b --out $OUT/kept_attention-1b.json"
                  for model in ${KEEP_MODELS//,/ }; do for run in ${KEEP_RUNS:-off:off off:on auto:off auto:auto}; do
                      IFS=: read -r graphs keep defer proj qkv <<<"$run"
                      sys=kestrel-$graphs; sys=${sys/-auto/}; name=${run//:/-}
                      phase "keepattn-$model-$name" 240 env KESTREL_KEEP_ATTENTION="$keep" KESTREL_KEEP_PROJECTION="${proj:-on}" KESTREL_KEEP_QKV="${qkv:-on}" \
                          KESTREL_DEFER_MLP="${defer:-${KESTREL_DEFER_MLP:-memory}}" python bench/matrix.py \
                          --models "$model" --methods qlora --layouts "${KEEP_LAYOUTS:-long}" --systems "$sys" --budget-s 180 \
                          --hard-s 230 --out "$OUT/keepattn-$name.jsonl"; done; done
                  records "$OUT"/keepattn-*.jsonl ;;
        matrix)   matrix ;;
        *)        echo "unknown phase: $want (tests, traintests, families, qwen35pair, lintests, moe, train, decode, dpo, dpoeval, gencheck, reserved, dpostd, gemma4peak, q35mem, nf4, nf4decode, gated, qwen35, packing, conv, moedecode, gate, expand, capstream, productloop, imagehead, cefloor, gradprod, lorastep, matrix)" >&2; exit 2 ;;
    esac
done
grep -hE "passed|failed" "$OUT/tests.log" "$OUT/traintests.log" 2>/dev/null | tail -2 || true  # no test phase: not a failure
