#!/usr/bin/env bash
# One call on the one-GPU machine (nvidia-h200) for CPU offload, within BUDGET_S seconds (default
# 520: the device tool stops a command at 600). Installs the wheels carried in .whl/ (DeepSpeed,
# its missing requirements, torchao) into /tmp/site, builds shardopt through device_run.sh (no
# stage named: the build alone, TORCH_CUDA_ARCH_LIST=9.0, which DeepSpeed's op builder also
# needs numeric; its log lands in $OUT/logs.tgz), then runs the named stages (default: all, in
# this order):
#   tests     tests/offload/test_offload_cuda.py (exactness and memory under NCCL, world 1), or the test
#             files (pytest arguments) in OFFLOAD_TESTS
#   bits      probe_offload_bits.py: the CPU and CUDA kernels on the same inputs, every distributed
#             class with and without offload element by element (cap BITS_S, 120)
#   trace     trace_offload.py at 2048 x 24, clipping off and on, once per environment setting in
#             TRACE_SETTINGS (default: "default BENCH_OFFLOAD_SWITCH_INTERVAL=none"), each capped
#             at TRACE_S (60)
#   ds_op     DeepSpeed's CPU Adam op, JIT-built (its offload contenders load this build)
#   cpu_adam  bench_cpu_adam.py, every core, 268M params (builds DeepSpeed's CPU Adam op first)
#   bench14   bench_offload.py at 2048 x 24 (1.4B), clipping off and on
#   settings  the 1.4B offload contender (clipping off and on) once per environment setting in
#             OFFLOAD_SETTINGS (default: "default BENCH_OFFLOAD_THREADS=12 BENCH_OFFLOAD_THREADS=14
#             OMP_WAIT_POLICY=PASSIVE BENCH_OFFLOAD_BLOCKING_SYNC=1"), each capped at SETTINGS_S
#             (80): an A/B of what the step is sensitive to, every row on the same host; with
#             launch_scripts/device/ab_tree.sh, of another revision's Python against this tree's
#             (SETTINGS_ARGS: more bench_offload.py arguments for these runs; BENCH_ARGS is not used;
#             e.g. OFFLOAD_SETTINGS="default BENCH_OFFLOAD_BUCKET_MB=200" for larger buckets; a
#             setting of several variables joins them with commas: BENCH_OFFLOAD_BUCKET_MB=400,BENCH_OFFLOAD_SLOTS=2)
#   bandwidth probe_host_bandwidth.py: the host's copy/read bandwidth against the CPU Adam alone,
#             per bucket, and beside the pipeline's DMA (cap BANDWIDTH_S, 120), once per
#             argument set in BANDWIDTH_ARGS (';'-separated, e.g. " ;--buckets 330 --numel 4194304")
#   pages     probe_host_pages.py: the CPU update over host state allocated several ways (pages,
#             who touches them first, the bench's chunks or the pipeline's flat state); PAGES_ARGS:
#             its arguments (default: 1.32B params in buckets of 26M, two rounds; cap PAGES_S, 150)
#   bench28   bench_offload.py at 2560 x 32 (2.8B), clipping off and on
#             (BENCH_ARGS: more bench_offload.py arguments, e.g. "--contenders offload,fsdp2_offload")
#   largest   bench_offload.py --largest in what is left of the budget (LARGEST_BUDGET_S caps it;
#             LARGEST_ARGS: more of its arguments, e.g. "--largest-contenders deepspeed_offload")
# Each stage gets at most its cap and never more than what is left; a bench that runs out of time
# records its remaining contenders as skipped. Whatever did not fit runs in a second call on the
# warm machine (the build is kept in .build): bash launch_scripts/device/device_offload.sh bench28 largest
# Logs and per-worker logs are packed into $OUT/offload.tgz; the JSON results and summary.md
# (every printed table) are copied to $OUT.
#   device tool: run(command="bash launch_scripts/device/device_offload.sh", carry=[".whl"])
# The wheels (Python 3.12 there, no network), made here in the repository root:
#   python -m venv --system-site-packages /tmp/dsvenv && /tmp/dsvenv/bin/pip install wheel
#   /tmp/dsvenv/bin/pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w .whl
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection \
#     typing-extensions
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
#     --platform any -d .whl torchao==0.18.0     # pure Python: its CPUOffloadOptimizer needs no C++ op
# (the image has DeepSpeed's other requirements: einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo, tqdm; typing-extensions is carried because pydantic needs >= 4.15)
set -uo pipefail
START=$SECONDS
BUDGET_S=${BUDGET_S:-520}
FINAL=${OUT:-/tmp/shardopt-out}
LOG=$FINAL/offload
mkdir -p "$LOG"
SUMMARY=$FINAL/summary.md
finish() {
  cp "$LOG"/*.json "$FINAL"/ 2>/dev/null
  tar czf "$FINAL/offload.tgz" -C "$FINAL" offload && rm -rf "$LOG"
}
trap finish EXIT
left() { echo $((BUDGET_S - (SECONDS - START))); }
# the seconds a stage may take: its cap, or what is left less a margin for packing the logs
allot() { local l=$(($(left) - 15)); echo $(($1 < l ? $1 : l)); }
stage() { echo "== $1 $(date +%T) ($(left) s left)" | tee -a "$SUMMARY"; }

# the same build settings as device_run.sh's, so its build is the one every stage imports
export TORCH_CUDA_ARCH_LIST=9.0 SHARDOPT_BUILD_CUDA=1 PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-32} SHARDOPT_BUILD_DIR=${SHARDOPT_BUILD_DIR:-$PWD/.build}
NCORES=$(nproc)

stage wheels
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$LOG/wheels.log" 2>&1 || { tail -5 "$LOG/wheels.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import deepspeed, torchao; print('deepspeed', deepspeed.__version__, '/ torchao', torchao.__version__)" \
    2>&1 | tail -1 | tee -a "$SUMMARY"
else
  echo "no .whl/ here: DeepSpeed and torchao contenders will be skipped" | tee -a "$SUMMARY"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

stage build
timeout "$(allot 400)" bash launch_scripts/device/device_run.sh 2>&1 | tail -3 | tee -a "$SUMMARY"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "build failed (log in logs.tgz)" | tee -a "$SUMMARY"; exit 1; }

bench() {  # bench NAME WIDTH DEPTH CAP
  local t; t=$(allot "$4")
  [ "$t" -ge 40 ] || { echo "skipped: time budget spent" | tee -a "$SUMMARY"; return; }
  timeout "$t" python3 launch_scripts/bench/bench_offload.py --width "$2" --depth "$3" \
    --warmup 2 --steps 5 --budget-s $((t - 10)) --contender-timeout-s 150 \
    --log-dir "$LOG/workers_$1" --out "$LOG/bench_offload_$1.json" ${BENCH_ARGS:-} \
    > "$LOG/bench_offload_$1.log" 2>&1
  sed -n '/^| contender/,$p' "$LOG/bench_offload_$1.log" | tee -a "$SUMMARY"
}

ds_op() {  # DeepSpeed's CPU Adam op, JIT-built once here (its offload contenders load this build)
  timeout "$(allot 240)" python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$LOG/deepspeed_op_build.log" 2>&1
  local rc=$?
  # a build killed midway leaves its lock, and the next build would wait on it
  [ $rc = 124 ] && find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -delete
  echo "DeepSpeed CPU Adam op build: exit code $rc" | tee -a "$SUMMARY"
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests cpu_adam bench14 bench28 largest)
for s in "${stages[@]}"; do
  stage "$s"
  if [ "$(allot 30)" -lt 30 ]; then
    echo "skipped: time budget spent (run: bash launch_scripts/device/device_offload.sh $s)" | tee -a "$SUMMARY"
    continue
  fi
  case $s in
    tests) read -r -a tests <<< "${OFFLOAD_TESTS:-tests/offload/test_offload_cuda.py}"
           timeout "$(allot 150)" python3 -m pytest "${tests[@]}" -q -p no:cacheprovider \
             > "$LOG/test_offload_cuda.log" 2>&1
           grep -E "^(FAILED|ERROR)" "$LOG/test_offload_cuda.log" | head -20 | tee -a "$SUMMARY"
           tail -1 "$LOG/test_offload_cuda.log" | tee -a "$SUMMARY" ;;
    bits) timeout "$(allot "${BITS_S:-120}")" python3 launch_scripts/probe/probe_offload_bits.py \
            --out "$LOG/probe_offload_bits.json" > "$LOG/probe_offload_bits.log" 2>&1
          echo "probe_offload_bits: exit code $?" | tee -a "$SUMMARY"
          tail -25 "$LOG/probe_offload_bits.log" | tee -a "$SUMMARY" ;;
    trace) read -r -a sets <<< "${TRACE_SETTINGS:-default BENCH_OFFLOAD_SWITCH_INTERVAL=none}"
           for kv in "${sets[@]}"; do
             for clip in off on; do
               t=$(allot "${TRACE_S:-60}")
               [ "$t" -ge 30 ] || { echo "trace $kv clip $clip skipped: time budget spent" | tee -a "$SUMMARY"; continue; }
               echo "-- trace: $kv, clip $clip" | tee -a "$SUMMARY"
               ( [ "$kv" = default ] || { IFS=, read -r -a kvs <<< "$kv"; export "${kvs[@]}"; }
                 timeout "$t" python3 launch_scripts/probe/trace_offload.py --clip "$clip" \
                   > "$LOG/trace_${kv//[^A-Za-z0-9_.-]/_}_$clip.log" 2>&1 )
               grep -E "interval|iteration ms|kernel|update|job |wait_bucket|ev_sync|step\(\)|forward|backward|submit_early|stage|slot_take|copy_issue|restart|release|rs_wait|hand|finish|thread" \
                 "$LOG/trace_${kv//[^A-Za-z0-9_.-]/_}_$clip.log" | head -100 | tee -a "$SUMMARY"
             done
           done ;;
    bandwidth) n=0  # once per argument set in BANDWIDTH_ARGS, split on ';'
               IFS=';' read -r -a bsets <<< "${BANDWIDTH_ARGS:- }"
               for bargs in "${bsets[@]}"; do
                 n=$((n + 1)); read -r -a bv <<< "$bargs"
                 echo "-- probe_host_bandwidth ${bargs}" | tee -a "$SUMMARY"
                 timeout "$(allot "${BANDWIDTH_S:-120}")" python3 launch_scripts/probe/probe_host_bandwidth.py "${bv[@]}" \
                   --out "$LOG/probe_host_bandwidth_$n.json" > "$LOG/probe_host_bandwidth_$n.log" 2>&1
                 echo "probe_host_bandwidth: exit code $?" | tee -a "$SUMMARY"
                 tail -12 "$LOG/probe_host_bandwidth_$n.log" | tee -a "$SUMMARY"
               done ;;
    pages) read -r -a pargs <<< "${PAGES_ARGS:---params 1320000000 --chunk 27262976}"
           timeout "$(allot "${PAGES_S:-150}")" python3 launch_scripts/probe/probe_host_pages.py "${pargs[@]}" \
             > "$LOG/probe_host_pages.log" 2>&1
           echo "probe_host_pages: exit code $?" | tee -a "$SUMMARY"
           grep -E "^\||THP" "$LOG/probe_host_pages.log" | tee -a "$SUMMARY" ;;
    ds_op) ds_op ;;
    cpu_adam) ds_op
              OMP_NUM_THREADS=$NCORES timeout "$(allot 150)" python3 launch_scripts/bench/bench_cpu_adam.py \
                --threads "$NCORES" --out "$LOG/bench_cpu_adam.json" > "$LOG/bench_cpu_adam.log" 2>&1
              sed -n '/^| kernel/,$p' "$LOG/bench_cpu_adam.log" | tee -a "$SUMMARY" ;;
    bench14) bench 1.4b 2048 24 "${BENCH14_S:-200}" ;;
    settings) read -r -a sets <<< "${OFFLOAD_SETTINGS:-default BENCH_OFFLOAD_THREADS=12 BENCH_OFFLOAD_THREADS=14 OMP_WAIT_POLICY=PASSIVE BENCH_OFFLOAD_BLOCKING_SYNC=1}"
              n=0
              for kv in "${sets[@]}"; do
                n=$((n + 1))
                echo "-- setting $n: $kv" | tee -a "$SUMMARY"
                ( [ "$kv" = default ] || { IFS=, read -r -a kvs <<< "$kv"; export "${kvs[@]}"; }
                  BENCH_ARGS="--contenders offload ${SETTINGS_ARGS:-}" bench "1.4b_${n}_${kv//[^A-Za-z0-9_.-]/_}" 2048 24 "${SETTINGS_S:-80}" )
              done ;;
    bench28) bench 2.8b 2560 32 "${BENCH28_S:-260}" ;;
    largest) t=$(allot "${LARGEST_BUDGET_S:-600}")
             if [ "$t" -ge 60 ]; then
               timeout "$t" python3 launch_scripts/bench/bench_offload.py --largest --budget-s $((t - 10)) \
                 --attempt-timeout-s 150 ${LARGEST_ARGS:-} --log-dir "$LOG/workers_largest" --out "$LOG/bench_offload_largest.json" \
                 > "$LOG/bench_offload_largest.log" 2>&1
               grep -E "^  |^\|" "$LOG/bench_offload_largest.log" | tee -a "$SUMMARY"
             else
               echo "skipped: time budget spent (run: bash launch_scripts/device/device_offload.sh largest)" | tee -a "$SUMMARY"
             fi ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done
stage done
