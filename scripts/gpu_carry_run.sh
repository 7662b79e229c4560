#!/usr/bin/env bash
# chattune's GPU check on a machine without internet, in one call. Built into the carry folder by
# scripts/gpu_carry.py (this file is its template); run from the project's root, or anywhere when the machine
# was not given the checkout (the folder's project.tar.gz is unpacked then):
#   bash .gpu-carry/run.sh --results "$OUT" [--budget 540] [--dry-run]
# It checks python/torch/transformers, installs the folder's wheels into --target, checks the imports the runs
# need (naming what is missing), runs scripts/gpu_check and scripts/bench/bench_gpu.py in their shares of
# --budget (seconds, the install included), leaves at most 8 files in --results (logs in logs.tar.gz), prints
# a summary and the second command for what did not fit.
# Options: --target DIR (/tmp/chattune-site)  --work DIR (/tmp/chattune-gpu-work: models, data, runs)
#   --check-share PCT (100: gpu_check's share of what is left after the install, its first ten items' 8 minutes;
#     bench_gpu gets the rest, here none: the summary prints its call)
#   --check-budget S (gpu_check's seconds, instead of the share)  --check-args "..." (to gpu_check)
#   --runs "..." (bench_gpu.py's --runs)  --bench-args "..."  --no-check  --no-bench
#   --extra-wheels DIR (more wheels, e.g. .gpu-carry-bnb/wheels; repeatable)  --project DIR  --python PY
#   --dry-run (check the environment and print the commands; install and run nothing)
#   --allow-cpu (run without a CUDA device: the test of this script, with stand-in scripts)
set -u
FOLDER=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TARGET=/tmp/chattune-site WORK=/tmp/chattune-gpu-work RESULTS=/tmp/chattune-gpu-results BUDGET=540
CHECK_SHARE=100 CHECK_BUDGET="" CHECK_ARGS="" RUNS="" BENCH_ARGS="" DO_CHECK=1 DO_BENCH=1 EXTRA=() PROJECT=""
PY=python3 DRY=0 CPU="" RESERVE=20 GRACE=30 MIN_SHARE=45
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit "${1:-2}"; }
need() { [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; usage 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    --results) need "$@"; RESULTS=$2; shift 2 ;;
    --target) need "$@"; TARGET=$2; shift 2 ;;
    --work) need "$@"; WORK=$2; shift 2 ;;
    --budget) need "$@"; BUDGET=$2; shift 2 ;;
    --check-share) need "$@"; CHECK_SHARE=$2; shift 2 ;;
    --check-budget) need "$@"; CHECK_BUDGET=$2; shift 2 ;;
    --check-args) need "$@"; CHECK_ARGS=$2; shift 2 ;;
    --runs) need "$@"; RUNS=$2; shift 2 ;;
    --bench-args) need "$@"; BENCH_ARGS=$2; shift 2 ;;
    --no-check) DO_CHECK=0; shift ;;
    --no-bench) DO_BENCH=0; shift ;;
    --extra-wheels) need "$@"; EXTRA+=("$2"); shift 2 ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --python) need "$@"; PY=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --allow-cpu) CPU=--allow-cpu; shift ;;
    -h|--help) usage 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done
for n in "$BUDGET" "$CHECK_SHARE" ${CHECK_BUDGET:+"$CHECK_BUDGET"}; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "run.sh: not a number of seconds or percent: $n" >&2; exit 2; }
done
for d in ${EXTRA[@]+"${EXTRA[@]}"}; do ls "$d"/*.whl >/dev/null 2>&1 || { echo "run.sh: no wheels in $d" >&2; exit 2; }; done
SECONDS=0
mkdir -p "$RESULTS" "$WORK" || exit 2
RESULTS=$(cd "$RESULTS" && pwd) WORK=$(cd "$WORK" && pwd)
say() { echo "[gpu_carry $SECONDS s] $*"; }
act() {  # print, and run unless --dry-run
  say "+ $*"; [ "$DRY" = 1 ] || "$@"
}

# The project: the checkout the device tool sent (the current directory or the folder's parent), else the archive.
is_checkout() { [ -f "$1/scripts/gpu_check/__main__.py" ] && [ -f "$1/scripts/bench/bench_gpu.py" ] && [ -d "$1/chattune" ]; }
if [ -z "$PROJECT" ]; then
  for c in "$PWD" "$(dirname "$FOLDER")"; do is_checkout "$c" && { PROJECT=$c; break; }; done
fi
if [ -z "$PROJECT" ]; then
  PROJECT=$WORK/project; say "no checkout here: unpacking $FOLDER/project.tar.gz into $PROJECT"
  mkdir -p "$PROJECT" && tar xzf "$FOLDER/project.tar.gz" -C "$PROJECT" || exit 2
fi
PROJECT=$(cd "$PROJECT" && pwd)
is_checkout "$PROJECT" || { echo "run.sh: $PROJECT is not chattune's checkout" >&2; exit 2; }
case $FOLDER in "$PROJECT"/*) CARRY=${FOLDER#"$PROJECT"/} ;; *) CARRY=$FOLDER ;; esac
ASSETS=""
if [ -f "$FOLDER/assets.tar.gz" ]; then
  ASSETS=$WORK/assets; mkdir -p "$ASSETS" && tar xzf "$FOLDER/assets.tar.gz" -C "$ASSETS" || exit 2
fi
say "project $PROJECT; folder $FOLDER; assets ${ASSETS:-none (the demo ones)}; results $RESULTS; budget $BUDGET s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# The wheels, then the environment check (versions, imports, the wheels' needs the machine must meet).
wheels=("$FOLDER"/wheels/*.whl)
for d in ${EXTRA[@]+"${EXTRA[@]}"}; do wheels+=("$d"/*.whl); done
say "installing ${#wheels[@]} wheels into $TARGET"
if [ "$DRY" = 1 ]; then
  say "+ $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $TARGET ${wheels[*]}"
else
  mkdir -p "$TARGET"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "${wheels[@]}" \
    > "$RESULTS/install.log" 2>&1 || { cat "$RESULTS/install.log"; say "the install failed"; exit 2; }
fi
export PYTHONPATH=$TARGET:$PROJECT${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 WANDB_MODE=disabled
"$PY" "$FOLDER/gpu_carry.py" --check-env "$FOLDER" "$TARGET" $([ "$DRY" = 1 ] && echo --dry-run) $CPU 2>&1 | tee "$RESULTS/env.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { say "stopped before the runs (the environment check above names what is missing)"; exit "$rc"; }

# The two runs, each under its budget (the scripts' --budget) and a hard stop GRACE seconds later.
left() { echo $(( BUDGET - SECONDS - RESERVE )); }
# SIGINT, not timeout's default SIGTERM: Python turns it into KeyboardInterrupt, on which the scripts stop their
# launches' process groups (torchrun and its workers run in sessions of their own) and write their reports.
stop() { if command -v timeout >/dev/null; then echo "timeout -s INT --kill-after=10 $(( $1 + GRACE ))"; fi; }
check_rc=skipped bench_rc=skipped
cd "$PROJECT" || exit 2
if [ "$DO_CHECK" = 1 ]; then
  if [ -n "$CHECK_BUDGET" ]; then s1=$CHECK_BUDGET; elif [ "$DO_BENCH" = 1 ]; then s1=$(( $(left) * CHECK_SHARE / 100 )); else s1=$(left); fi
  [ "$s1" -gt "$(left)" ] && s1=$(left)
  if [ "$s1" -lt "$MIN_SHARE" ]; then say "gpu_check not run: $s1 s left"; else
    # shellcheck disable=SC2086
    act $(stop "$s1") "$PY" scripts/gpu_check --budget "$s1" --out "$RESULTS/gpu_check" --work "$WORK/gpu_check" \
      ${ASSETS:+--assets "$ASSETS"} $CHECK_ARGS 2>&1 | tee "$RESULTS/gpu_check.log"
    check_rc=${PIPESTATUS[0]}
    [ "$DRY" = 1 ] && SECONDS=$(( SECONDS + s1 ))  # as if it took its whole budget
  fi
fi
if [ "$DO_BENCH" = 1 ]; then
  s2=$(left)
  if [ "$s2" -lt "$MIN_SHARE" ]; then say "bench_gpu not run: $s2 s left"; else
    [ -n "$ASSETS" ] || say "bench_gpu needs the shared assets, which this folder lacks"
    # shellcheck disable=SC2086
    act $(stop "$s2") "$PY" scripts/bench/bench_gpu.py --budget "$s2" --work "$WORK/bench" ${ASSETS:+--assets "$ASSETS"} \
      ${RUNS:+--runs $RUNS} $BENCH_ARGS 2>&1 | tee "$RESULTS/bench_gpu.log"
    bench_rc=${PIPESTATUS[0]}
    [ -f "$WORK/bench/results.json" ] && cp "$WORK/bench/results.json" "$RESULTS/bench_gpu.json"
  fi
fi
# At most 8 files come back from $OUT: the logs go into one archive.
( cd "$RESULTS" && logs=$(find . -name '*.log' -type f) && [ -n "$logs" ] && tar czf logs.tar.gz $logs && rm -f $logs )
say "done: gpu_check rc=$check_rc, bench_gpu rc=$bench_rc"
[ "$DRY" = 1 ] && exit 0
[ "$DO_BENCH" = 1 ] || RUNS=none
[ "$DO_CHECK" = 1 ] || CHECK_ARGS=none
"$PY" "$FOLDER/gpu_carry.py" --summary "$FOLDER" "$RESULTS" "$CHECK_ARGS" "$RUNS" "$CARRY" "$BUDGET" \
    ${EXTRA[@]+"${EXTRA[@]}"}
case "$check_rc $bench_rc" in "0 0"|"0 skipped"|"skipped 0"|"skipped skipped") exit 0 ;; *) exit 1 ;; esac
