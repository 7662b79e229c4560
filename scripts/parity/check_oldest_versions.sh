#!/usr/bin/env bash
# Checks chattune on the oldest torch and transformers it supports: a fresh venv with those versions,
# `pip install -e ".[dev]"` (which must keep them: the script stops if pip replaced either), then the core
# tests, and one summary line with the versions and the counts.
#
# Not run in CI: it downloads several GB (torch's PyPI wheels are CUDA builds and pull the nvidia-* packages;
# they run on CPU too). Run it by hand after changing the pins in pyproject.toml; its last result is in
# BENCHMARKS.md ("Oldest supported versions").
#
#   scripts/parity/check_oldest_versions.sh [--venv DIR] [--torch VER] [--transformers VER] [--python PY]
#                                    [--wheels DIR] [--workers N] [--keep] [-- extra pytest args]
#
#   --venv DIR          the venv to create (default /tmp/chattune-oldest; removed first unless --keep)
#   --torch VER         default 2.11.0
#   --transformers VER  default 5.17.0
#   --python PY         the interpreter the venv is made from (default python3)
#   --wheels DIR        a folder of wheels pip looks in first (added to PIP_FIND_LINKS), e.g. torch wheels
#                       downloaded before
#   --workers N         pytest-xdist workers (default: the number of cores)
#   --keep              reuse the venv if it exists (the installs are then checked, not redone from scratch)
#
# Exit status: pytest's (0 when every core test passed or skipped with its reason), 2 on a setup failure.
set -euo pipefail

VENV=/tmp/chattune-oldest
TORCH=2.11.0
TRANSFORMERS=5.17.0
PYTHON=python3
WORKERS=auto
KEEP=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) VENV=$2; shift 2 ;;
        --torch) TORCH=$2; shift 2 ;;
        --transformers) TRANSFORMERS=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --wheels) export PIP_FIND_LINKS="$(cd "$2" && pwd)${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"; shift 2 ;;
        --workers) WORKERS=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/../.." && pwd)  # the project: scripts/parity/ is two below it
cd "$ROOT"

# The core tests: the model and attention, the losses, the DPO step, checkpoints, compile, context
# parallelism, FSDP (sharded load, checkpoints), LoRA/QLoRA, resume, the packing probe, the walk over every
# architecture transformers registers, hybrid models and the data pipeline. Left out for time: the
# world-size invariance launches (7 minutes) and the SIGKILL variants of the resume tests (3 minutes).
# About 14 minutes on 2 cores, and 2 for the set-up with the wheels at hand.
CORE_TESTS=(
    tests/unit/model/test_model.py tests/unit/test_layers.py tests/unit/model/packed/test_attention_features.py tests/unit/model/packed/test_varlen_fallback.py
    tests/unit/model/head/test_chunked_loss.py tests/unit/model/head/test_fused_loss.py tests/unit/objectives/test_pair_losses.py tests/unit/model/head/test_output_logits.py
    tests/distributed/test_dpo_step.py tests/distributed/test_checkpoint.py tests/unit/parallel/test_compile.py tests/distributed/test_context_parallel.py
    tests/distributed/test_sharded_load.py tests/unit/model/peft/test_lora.py tests/unit/model/quantization/test_qlora.py tests/e2e/test_resume.py
    tests/unit/model/checks/test_packing_probe.py tests/unit/model/checks/test_every_architecture.py tests/unit/model/packed/test_hybrid_models.py
    tests/unit/data/test_packing.py tests/unit/data/templates/test_sft_documents.py tests/unit/data/test_feed.py
)
DESELECT=(-k "not sigkill_then_resume")

fail() { echo "check_oldest_versions: $*" >&2; exit 2; }
START=$(date +%s)

if [[ $KEEP == 0 || ! -x $VENV/bin/python ]]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV" || fail "cannot create a venv at $VENV with $PYTHON"
fi
PY=$VENV/bin/python
"$PY" -m pip install -q --upgrade pip || fail "pip upgrade failed"
# torch first, alone: the point of the check is that the install of chattune keeps it.
"$PY" -m pip install -q "torch==$TORCH" || fail "cannot install torch==$TORCH"
"$PY" -m pip install -q "transformers==$TRANSFORMERS" || fail "cannot install transformers==$TRANSFORMERS"
versions() { "$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; }
BEFORE=$(versions)
"$PY" -m pip install -q -e ".[dev]" || fail "pip install -e .[dev] failed"
AFTER=$(versions)
[[ $BEFORE == "$AFTER" ]] || fail "pip install -e . replaced torch/transformers: before '$BEFORE', after '$AFTER'"
read -r TORCH_V TF_V <<<"$AFTER"
[[ ${TORCH_V%%+*} == "$TORCH" ]] || fail "torch is $TORCH_V, not $TORCH"
[[ $TF_V == "$TRANSFORMERS" ]] || fail "transformers is $TF_V, not $TRANSFORMERS"
"$PY" -m pip check || fail "pip check found broken requirements"
SETUP_S=$(( $(date +%s) - START ))

REPORT=$VENV/core-tests.xml
TEST_START=$(date +%s)
set +e
"$PY" -m pytest "${CORE_TESTS[@]}" "${DESELECT[@]}" -q -n "$WORKERS" -rfEs --junitxml="$REPORT" "${EXTRA[@]}"
RC=$?
set -e
TEST_S=$(( $(date +%s) - TEST_START ))

COUNTS=$("$PY" - "$REPORT" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"{total - failed - errors - skipped} passed, {skipped} skipped, {failed} failed, {errors} errors")
EOF
)
echo "oldest versions: python $("$PY" -c 'import platform; print(platform.python_version())') torch $TORCH_V" \
     "transformers $TF_V: $COUNTS (${#CORE_TESTS[@]} core test files) in ${TEST_S}s, setup ${SETUP_S}s"
exit $RC
