#!/usr/bin/env bash
# The CUDA and nccl paths, run where a GPU is lent: one JSON line per check on stdout.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default OUT_DIR: a fresh folder under /tmp
#
# Sized for under 5 minutes on one H200 (most of it is starting Python and CUDA in each process), each
# check bounded by its own timeout. Exit status: the number of failed checks (0: all passed). A line is
#   {"check": NAME, "ok": true|false, "rc": N, "seconds": S, "detail": {...}}
# plus "tail" (the last lines of its output) and "log" when it failed. Every check's full output is
# OUT_DIR/<check>.log, its run's outputs OUT_DIR/<check>/.
#
# Checks:
#   environment          torch, CUDA, the device, nccl's version
#   cuda_kernels         tests/test_cuda_paths.py: top-k on CUDA sends byte for byte the CPU payload
#                        (sampled and exact selection, float32 and bfloat16 values, up to 11M entries);
#                        quantization keeps the CPU's scales, lands within a level, unbiased
#   nccl_hooks           the same file: the compression and ring hooks (torch_asgc.ddp) on an nccl
#                        group of one rank leave the gradient alone; bfloat16 payload bytes exact
#   cuda_amp             the same file: bf16 autocast on CUDA, fp16's GradScaler skips an overflow
#   ddp_cuda_topk_bf16   run_ddp_training.py --device cuda (nccl), top-k 0.1 with bfloat16 values,
#                        --amp bf16, --collective-timeout 30 (the process group's timeout on nccl)
#   ddp_cuda_fp16        run_ddp_training.py --device cuda --amp fp16 (GradScaler, backend allreduce)
#   baseline_cuda_bf16   run_baseline_training.py --device cuda --amp bf16
#   baseline_cuda_fp16   run_baseline_training.py --device cuda --amp fp16
#   ps_worker_cuda       run_parameter_server_training.py --workers 1 --device cuda
#
# Not covered (one GPU): nccl between two ranks, hence the ring's send/recv on nccl and a hung
# rank on nccl (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 is set by src/ddp_trainer.run_rank).

set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DTS_REQUIRE_CUDA=1  # tests/test_cuda_paths.py then fails instead of skipping without CUDA
failures=0

# run_check NAME TIMEOUT_S COMMAND: runs COMMAND (a bash string) and prints the check's JSON line.
# The last line of the command's output that parses as a JSON object becomes "detail".
run_check() {
    local name=$1 limit=$2 command=$3
    local log="$OUT/$name.log" start end rc
    start=$(date +%s.%N)
    timeout --kill-after=10 "$limit" bash -c "$command" >"$log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    "$PY" - "$name" "$rc" "$start" "$end" "$log" "$limit" <<'EOF'
import json, sys
name, rc, start, end, log, limit = sys.argv[1:]
lines = open(log, errors="replace").read().splitlines()
detail = None
for line in reversed(lines):
    if line.strip().startswith("{"):
        try:
            detail = json.loads(line)
            break
        except ValueError:
            pass
record = {"check": name, "ok": rc == "0", "rc": int(rc), "seconds": round(float(end) - float(start), 1)}
if detail is None and lines:
    detail = {"last_line": lines[-1].strip()}
if detail is not None:
    record["detail"] = detail
if rc != "0":
    record["tail"] = lines[-20:]
    record["log"] = log
    if rc in ("124", "137"):
        record["timed_out_after_s"] = int(limit)
print(json.dumps(record), flush=True)
EOF
    [ "$rc" = 0 ] || failures=$((failures + 1))
}

# summary_ok SUMMARY_JSON MIN_ACCURACY [FIELD=VALUE ...]: the fields that matter as JSON; fails on a miss.
SUMMARY_OK='
import json, sys
path, floor, *expected = sys.argv[1:]
summary = json.load(open(path))
keys = ("final_accuracy", "backend", "comm_hook", "compression_value_dtype", "amp", "amp_skipped_steps", "bytes_sent",
        "collective_timeout_s", "train_time_s", "throughput_samples_per_s")
detail = {key: summary[key] for key in keys if key in summary}
problems = [] if summary["final_accuracy"] >= float(floor) else ["final_accuracy %s < %s" % (summary["final_accuracy"], floor)]
for item in expected:
    key, value = item.split("=", 1)
    if str(summary.get(key)) != value:
        problems.append(f"{key} is {summary.get(key)!r}, expected {value}")
print(json.dumps({**detail, "problems": problems}))
sys.exit(1 if problems else 0)
'
summary_ok() { "$PY" -c "$SUMMARY_OK" "$@"; }
export -f summary_ok
export SUMMARY_OK PY

run_check environment 120 "$PY -c '
import json, torch
ok = torch.cuda.is_available()
print(json.dumps({\"torch\": torch.__version__, \"cuda\": torch.version.cuda, \"available\": ok,
                  \"device\": torch.cuda.get_device_name(0) if ok else None,
                  \"capability\": list(torch.cuda.get_device_capability(0)) if ok else None,
                  \"nccl\": str(torch.cuda.nccl.version()) if ok else None}))
raise SystemExit(0 if ok else 1)
'"

PYTEST="$PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda_paths.py"
run_check cuda_kernels 240 "$PYTEST -k 'kernels or quantization_on_cuda'"
run_check nccl_hooks 120 "$PYTEST -k 'nccl'"
run_check cuda_amp 120 "$PYTEST -k 'mixed_precision'"

DATA="--dataset mnist_5k --num-epochs 1 --batch-size 64"
ddp_run() {  # ddp_run NAME FLAGS...
    local name=$1; shift
    echo "$PY run_ddp_training.py --world-size 1 --device cuda $DATA $* --log-dir $OUT/$name/logs --checkpoint-dir $OUT/$name/checkpoints"
}
run_check ddp_cuda_topk_bf16 180 "$(ddp_run ddp_cuda_topk_bf16 --compression-enabled --compression-type topk --compression-ratio 0.1 \
    --compression-value-dtype bfloat16 --amp bf16 --collective-timeout 30) \
    && summary_ok $OUT/ddp_cuda_topk_bf16/logs/summary.json 0.85 backend=nccl comm_hook=topk compression_value_dtype=bfloat16 amp=bf16"
run_check ddp_cuda_fp16 180 "$(ddp_run ddp_cuda_fp16 --amp fp16) \
    && summary_ok $OUT/ddp_cuda_fp16/logs/summary.json 0.85 backend=nccl amp=fp16"

baseline_run() {  # baseline_run NAME FLAGS...
    local name=$1; shift
    echo "$PY run_baseline_training.py --device cuda $DATA $* --log-dir $OUT/$name/logs --checkpoint-dir $OUT/$name/checkpoints"
}
run_check baseline_cuda_bf16 180 "$(baseline_run baseline_cuda_bf16 --amp bf16) && summary_ok $OUT/baseline_cuda_bf16/logs/summary.json 0.85 amp=bf16"
run_check baseline_cuda_fp16 180 "$(baseline_run baseline_cuda_fp16 --amp fp16) && summary_ok $OUT/baseline_cuda_fp16/logs/summary.json 0.85 amp=fp16"

run_check ps_worker_cuda 240 "$PY run_parameter_server_training.py --workers 1 --device cuda $DATA \
    --log-dir $OUT/ps_worker_cuda/logs --checkpoint-dir $OUT/ps_worker_cuda/checkpoints \
    && summary_ok $OUT/ps_worker_cuda/logs/summary.json 0.85"

echo "{\"check\": \"all\", \"ok\": $([ $failures = 0 ] && echo true || echo false), \"failed\": $failures, \"out\": \"$OUT\"}"
exit $failures
