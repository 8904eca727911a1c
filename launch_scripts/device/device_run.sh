#!/usr/bin/env bash
# One call on a lent GPU machine: build the CUDA extension, then run the named stages, logging to
# $OUT. Stages: tests (pytest -m cuda), parity (NCCL parity, contract and DTensor suites), kernels
# (bench_kernels.py), train (bench_train.py, 2 GPUs), ckpt (bench_checkpoint.py, 2 GPUs),
# example (train_gpt.py, 2 GPUs), scaling (bench_train.py at 2, 4, ... up to all GPUs, weak
# scaling, then the scaling table and plot; for nvidia-h200-x4 / -x8). Multi-GPU stages use
# every GPU of the machine. More stages: formats (bench_state_formats.py), formats_train (the
# compact-storage modes of bench_train.py beside FSDP2), host (bench_host.py: single-process step overhead), deepspeed (installs the
# wheels carried in .dswheels/, then bench_train.py's deepspeed_zero2 beside DDP; make them here
# with `pip wheel deepspeed --no-deps --no-build-isolation -w .dswheels` and `pip download hjson
# py-cpuinfo pydantic msgpack psutil einops ninja --python-version 3.12 --only-binary=:all:
# --platform manylinux2014_x86_64 -d .dswheels`, and name .dswheels in the tool's carry), quality
# (train_gpt.py per state format; QUALITY_MODEL, QUALITY_STEPS, QUALITY_ARGS, QUALITY_TIMEOUT),
# contract (the parity stage's tests/zero/nccl_contract.py alone), apex (tests/zero/apex_script.py: Apex-style scripts against DDP + AdamW, on every GPU), apex_suite (Apex's own
# test_dist_adam.py against shardopt, launch_scripts/device/apex_suite.py; its files and an expecttest
# wheel in $APEX_DIR, default .apex: `python launch_scripts/device/apex_suite.py extract --from APEX_GIT`
# and `pip download expecttest --no-deps -d .apex/wheels` here, and name .apex in the carry). Logs land in $OUT/logs/ and are packed into $OUT/logs.tgz at
# the end (the device tool returns at most 8 files).
# muon_train: bench_train.py's Muon modes on every GPU (2+ GPUs; MUON_MODES; .dswheels in the carry for DeepSpeed's).
# muon: bench_muon.py (MUON_ARGS, MUON_BUDGET, MUON_TAG) (FusedMuon against torch.optim.Muon and the peers, Newton-Schulz against the bf16
# GEMM rate) after installing the wheels carried in .muonwheels/ (name .muonwheels in the carry).
# launch_scripts/device/carry_wheels.sh makes .muonwheels/, .dswheels/ and .apex/ here in one command.
#   bash launch_scripts/device/device_run.sh tests parity kernels
set -uo pipefail
FINAL=${OUT:-/tmp/shardopt-out}
OUT=$FINAL/logs
mkdir -p "$OUT"
trap 'tar czf "$FINAL/logs.tgz" -C "$FINAL" logs && rm -rf "$OUT"' EXIT
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} SHARDOPT_BUILD_CUDA=1 PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-32} SHARDOPT_BUILD_DIR=${SHARDOPT_BUILD_DIR:-$PWD/.build}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} APEX_DIR=${APEX_DIR:-$PWD/.apex}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
stage() { echo "== $1 $(date +%T)"; }

stage build
python3 - <<'PY' 2>&1 | tee "$OUT/build.log" | tail -4
import time, torch
t = time.time()
import shardopt
assert shardopt.cuda_available(), "CUDA kernels were not built"
print(f"built in {time.time() - t:.0f} s; torch {torch.__version__}, {torch.cuda.get_device_name()}")
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

for s in "$@"; do
  stage "$s"
  case $s in
    tests) timeout 300 python3 -m pytest tests -q -m cuda -p no:cacheprovider \
             > "$OUT/cuda_tests.log" 2>&1; grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.log" | head -20; tail -2 "$OUT/cuda_tests.log" ;;
    parity) timeout 240 torchrun --standalone --nproc-per-node "$NGPU" tests/zero/nccl_parity.py \
             > "$OUT/nccl_parity.log" 2>&1; grep -E "PASS|FAIL|passed" "$OUT/nccl_parity.log" | tail -15
            timeout 120 torchrun --standalone --nproc-per-node "$NGPU" tests/zero/nccl_contract.py \
             > "$OUT/nccl_contract.log" 2>&1; grep -E "PASS|FAIL" "$OUT/nccl_contract.log" | tail -8
            timeout 120 torchrun --standalone --nproc-per-node "$NGPU" tests/optimizers/nccl_dtensor.py \
             > "$OUT/nccl_dtensor.log" 2>&1; grep -E "PASS|FAIL" "$OUT/nccl_dtensor.log" | tail -8 ;;
    kernels) timeout 280 python3 launch_scripts/bench/bench_kernels.py --out "$OUT/bench_kernels.json" \
             > "$OUT/bench_kernels.log" 2>&1; tail -45 "$OUT/bench_kernels.log" ;;
    train) timeout 400 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/bench/bench_train.py \
             --out "$OUT/bench_train.json" > "$OUT/bench_train.log" 2>&1; tail -40 "$OUT/bench_train.log" ;;
    ckpt) timeout 200 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/bench/bench_checkpoint.py \
             --dir /tmp/shardopt-ckpt --out "$OUT/bench_checkpoint.json" > "$OUT/bench_checkpoint.log" 2>&1;
          grep -E "rank=|Error" "$OUT/bench_checkpoint.log" | tail -6 ;;
    example) timeout 200 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/train/train_gpt.py \
             --out-dir "$OUT/example" --no-progress > "$OUT/example.log" 2>&1; tail -8 "$OUT/example.log" ;;
    scaling) runs=()
             for n in 2 4 8; do
               [ "$n" -le "$NGPU" ] || continue
               timeout 400 torchrun --standalone --nproc-per-node "$n" launch_scripts/bench/bench_train.py \
                 --out "$OUT/bench_train_w$n.json" > "$OUT/bench_train_w$n.log" 2>&1
               tail -10 "$OUT/bench_train_w$n.log"; runs+=("$OUT/bench_train_w$n.json")
             done
             python3 launch_scripts/bench/plot_benchmarks.py --scaling "${runs[@]}" --out "$OUT" \
               > "$OUT/scaling.md" 2>&1; cat "$OUT/scaling.md" ;;
    formats) timeout 200 python3 launch_scripts/bench/bench_state_formats.py --out "$OUT/bench_state_formats.json" \
             > "$OUT/bench_state_formats.log" 2>&1; tail -25 "$OUT/bench_state_formats.log" ;;
    formats_train) timeout 400 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/bench/bench_train.py \
             --modes shardopt_adam_overlap,shardopt_adam_scaled,shardopt_adam_int8,shardopt_adam_bf16,shardopt_adam_bf16_remainders,shardopt_adam_bf16_remainders_int8,fsdp2 \
             --out "$OUT/bench_train_formats.json" > "$OUT/bench_train_formats.log" 2>&1; tail -14 "$OUT/bench_train_formats.log" ;;
    host) timeout 200 python3 launch_scripts/bench/bench_host.py --out "$OUT/bench_host.json" \
             > "$OUT/bench_host.log" 2>&1; tail -45 "$OUT/bench_host.log" ;;
    deepspeed) python3 -m pip install -q --no-index --no-deps .dswheels/*.whl > "$OUT/deepspeed_install.log" 2>&1
             # DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers ("9.0a" fails)
             TORCH_CUDA_ARCH_LIST=9.0 timeout 500 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/bench/bench_train.py \
             --modes "${PEER_MODES:-compute_floor,ddp_adamw,shardopt_adam_overlap,deepspeed_zero2,ddp_adamw_compiled,shardopt_adam_compiled}" \
             --out "$OUT/bench_train_peers.json" > "$OUT/bench_train_peers.log" 2>&1; tail -14 "$OUT/bench_train_peers.log" ;;
    muon_train) [ -d .dswheels ] && python3 -m pip install -q --no-index --no-deps .dswheels/*.whl > "$OUT/deepspeed_install.log" 2>&1
             # Muon across GPUs (bench_train_muon_modes.py): DDP + torch.optim.Muon, DistributedFusedMuon,
             # DeepSpeed ZeRO-2's muon (where .dswheels is carried); MUON_MODES replaces the list
             TORCH_CUDA_ARCH_LIST=9.0 timeout 500 torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/bench/bench_train.py \
             --modes "${MUON_MODES:-compute_floor,ddp_adamw,ddp_muon,shardopt_muon,deepspeed_zero2_muon}" \
             --out "$OUT/bench_train_muon.json" > "$OUT/bench_train_muon.log" 2>&1; tail -14 "$OUT/bench_train_muon.log" ;;
    contract) timeout 120 torchrun --standalone --nproc-per-node "$NGPU" tests/zero/nccl_contract.py \
             > "$OUT/nccl_contract.log" 2>&1; grep -E "PASS|FAIL|refused" "$OUT/nccl_contract.log" | tail -8 ;;
    apex) timeout 200 torchrun --standalone --nproc-per-node "$NGPU" tests/zero/apex_script.py \
             > "$OUT/apex_script.log" 2>&1; grep -E "PASS|FAIL|refused" "$OUT/apex_script.log" | tail -8 ;;
    apex_suite) python3 -c "import expecttest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$APEX_DIR"/wheels/*.whl
             # -v: each test's line as it ends, so a cut run still says where it was
             timeout "${APEX_TIMEOUT:-500}" python3 launch_scripts/device/apex_suite.py run --apex "$APEX_DIR" \
               -v --durations=8 > "$OUT/apex_suite.log" 2>&1
             grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/apex_suite.log" | tail -12
             grep -cE " (PASSED|FAILED|SKIPPED|ERROR)" "$OUT/apex_suite.log" | sed 's/^/tests ended: /';
             tail -3 "$OUT/apex_suite.log" ;;
    quality) for f in fp32 bf16 scaled_fp16 int8; do
               # QUALITY_ARGS: more train_gpt.py flags, e.g. "--batch-size 8 --block-size 512"
               timeout "${QUALITY_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NGPU" launch_scripts/train/train_gpt.py \
                 --state-format "$f" --steps "${QUALITY_STEPS:-300}" --model "${QUALITY_MODEL:-small}" \
                 ${QUALITY_ARGS:-} --out-dir "/tmp/quality_$f" --no-progress > "$OUT/quality_$f.log" 2>&1
               echo "$f: $(grep -E "^final:" "$OUT/quality_$f.log" | tail -1)"
             done ;;
    muon) [ -d /tmp/muonsite ] || for w in .muonwheels/*.whl; do  # one at a time: a wheel that fails leaves its peer out
               python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/muonsite "$w" \
                 >> "$OUT/muon_install.log" 2>&1 || echo "not installed: $w"
             done
             # MUON_ARGS: more bench_muon.py flags (--sets, --contenders); MUON_TAG names the run's files
             m=$OUT/bench_muon${MUON_TAG:-}; b=${MUON_BUDGET:-235}
             PYTHONPATH=$PYTHONPATH:/tmp/muonsite timeout $((b + 35)) python3 launch_scripts/bench/bench_muon.py --budget-s "$b" \
               ${MUON_ARGS:-} --out "$m.json" --jsonl "$m.jsonl" --md "$m.md" > "$m.log" 2>&1
             cat "$m.md" 2>/dev/null || tail -40 "$m.log" ;;
    *) echo "unknown stage $s" ;;
  esac
done
stage done
