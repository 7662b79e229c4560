#!/usr/bin/env bash
# The SFT recipe on one GPU at the precisions it offers, and exact resume on CUDA (BENCHMARKS.md, issue 13):
# bf16 / fp16 (loss scaling) / fp32 on the same random-init Qwen3-0.6B shape and data, and 8 steps straight
# vs 4 + resume (the resumed launch with another number of loader workers).
#   bash scripts/gpu_precision_resume.sh PHASES...   (setup bf16 fp16 fp32 resume summary)
# Uses the measuring kit of ../shared/gpu (KIT) and its assets (ASSETS); on a GPU machine without
# internet, WHEELS is a folder of the wheels of ../shared/gpu/fetch_wheels.sh (installed first, with the
# kit's varlen_shim.py for a torch whose varlen_attn lacks enable_gqa). Results (logs, metrics) go to OUT.
set -u
cd "$(dirname "$0")/.."
R=${OUT:-/tmp/gpu-precision}; mkdir -p "$R"
KIT=${KIT:-../shared/gpu}
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export ASSETS=${ASSETS:-$KIT/../assets}
if [ -n "${WHEELS:-}" ] && [ ! -d /tmp/site/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  cp "$KIT/varlen_shim.py" /tmp/site/sitecustomize.py
fi
[ -f /tmp/data/fastchat_20k.jsonl ] || python3 "$KIT/make_corpus.py" /tmp/data > /dev/null
[ -d /tmp/qwen3-0.6b ] || python3 "$KIT/make_model.py" /tmp/qwen3-0.6b 0.6b > /dev/null
C=/tmp/data/fastchat_20k.jsonl
ct() {  # name overrides...
  local name=$1; shift
  local t0=$(date +%s)
  torchrun --standalone --nproc_per_node 1 recipes/sft.py --config-name sft/local_model model.path=/tmp/qwen3-0.6b \
    "data.train=[$C]" data.eval=[] output_dir=/tmp/ct_$name log_every=1 save_every=0 eval_every=0 data.num_workers=2 \
    progress=lines model.fsdp.activation_checkpointing=false "$@" > "$R/ct_$name.log" 2>&1
  echo "ct_$name rc=$? wall=$(( $(date +%s) - t0 ))s"; cp /tmp/ct_$name/metrics.jsonl "$R/ct_$name.jsonl" 2>/dev/null
  grep -m1 "model:" "$R/ct_$name.log"; tail -2 "$R/ct_$name.log"
}
for p in "$@"; do
  case $p in
    setup) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
           python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" ;;
    bf16) ct bf16 max_steps=20 data.max_tokens_per_microbatch=16384 grad_accum_steps=2 ;;
    fp16) ct fp16 max_steps=20 data.max_tokens_per_microbatch=16384 grad_accum_steps=2 model.fsdp.param_dtype=float16 ;;
    fp32) ct fp32 max_steps=20 data.max_tokens_per_microbatch=16384 grad_accum_steps=2 model.fsdp.param_dtype=float32 ;;
    resume) ct straight max_steps=8 data.max_tokens_per_microbatch=8192 save_every=4
            ct resumed max_steps=8 data.max_tokens_per_microbatch=8192 save_every=4 stop_after_step=4
            ct resumed max_steps=8 data.max_tokens_per_microbatch=8192 save_every=4 data.num_workers=0 ;;
    summary) python3 - "$R" <<'PY'
import json, sys, statistics
from pathlib import Path
R = Path(sys.argv[1])
def rows(name):
    p = R / f"ct_{name}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.is_file() else []
for name in ("bf16", "fp16", "fp32"):
    m = [r for r in rows(name) if r["step"] >= 6]
    if m:
        tps = statistics.mean(r["all_tokens_per_sec"] for r in m)
        print(f"{name}: steps 6-{m[-1]['step']} all_tokens_per_sec mean {tps:,.0f}, MFU {6 * 0.596e9 * tps / 989e12:.1%}; "
              f"loss step 1 {rows(name)[0]['loss']:.4f} step {m[-1]['step']} {m[-1]['loss']:.4f}; "
              f"loss_scale {m[-1].get('loss_scale')}; overflow_skipped {m[-1].get('overflow_skipped_steps')}")
ref = rows("fp32")
for name in ("bf16", "fp16"):
    other = rows(name)
    if ref and other:
        rel = [abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(ref, other)]
        print(f"{name} vs fp32 loss, max rel diff {max(rel):.2e}; per step:", " ".join(f"{r:.1e}" for r in rel))
a, c = [r["loss"] for r in rows("straight")], [r["loss"] for r in rows("resumed")]
if a:
    print("resume straight", a); print("resume resumed ", c); print("bitwise equal", a == c)
PY
    ;;
  esac
done
