"""Host memory and time of loading a model directory into the sharded model, and of the final export.

    python scripts/bench/bench_load.py [--ranks 1 2] [--checkout DIR] [--model-dir DIR]

Builds (once, cached under --model-dir) a random-init Qwen3-shaped model of ~1.5B parameters saved as
bf16 safetensors, as checkpoints ship. Then, for each rank count, launches that many gloo ranks on the CPU
that each call the recipes' `chattune.model.build.build_sharded_model` on it and then the final export,
while a thread samples the process's resident memory (VmRSS, every 5 ms). Printed per rank: the peak RSS
while loading, the load time, and the peak RSS added by the export over what the rank held before it.

`--checkout DIR` runs the same measurement against another chattune checkout (its `chattune` package is put
first on the path), e.g. the code before sharded loading:

    git worktree add /tmp/chattune-before e243350
    python scripts/bench/bench_load.py --checkout /tmp/chattune-before

On the CPU the shards themselves live in host memory (fp32, model size / W); on a GPU they would not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from chattune.launch.torchrun import torchrun_command

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
# Qwen2.5-1.5B's shape in Qwen3's architecture (q/k norms): 1.54B parameters, embeddings tied.
QWEN3_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
GIB = 2**30


def make_model(directory: Path) -> None:
    """A random-init bf16 Qwen3 model directory (skipped when it exists)."""
    if (directory / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **QWEN3_1_5B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)


class RssSampler:
    """The process's resident set size, sampled in a thread; `peak()` since the last `reset()`."""

    def __init__(self, interval_s: float = 0.005):
        self._peak, self._interval = 0, interval_s
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def current() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/self/status")

    def _run(self) -> None:
        while True:
            self._peak = max(self._peak, self.current())
            time.sleep(self._interval)

    def reset(self) -> None:
        self._peak = self.current()

    def peak(self) -> int:
        return max(self._peak, self.current())


class VocabularyOnly:
    """Stands in for a tokenizer: the builder only asks its size, the export saves it (nothing to save)."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def save_pretrained(self, directory) -> None:
        pass


def worker(model_dir: str, out_dir: str, result_file: str) -> None:
    """One rank (under torchrun): load, export, report."""
    sampler = RssSampler()
    import inspect

    import torch
    from omegaconf import OmegaConf

    import chattune
    from chattune.distributed import init_distributed
    from chattune.model.build import ModelSections, ModelSource, build_sharded_model
    from chattune.model.io.export import export_hf

    cfg = OmegaConf.create(
        {
            "seed": 0,
            "model": {
                "path": model_dir,
                "config": None,
                "compile": False,
                "fsdp": {"param_dtype": "float32", "reduce_dtype": "float32", "activation_checkpointing": False},
            },
            "loss": {"chunk_size": 1024, "implementation": "chunked", "router_aux_coef": None},
            "data": {"share_prompts": False},
        }
    )
    dims = init_distributed("cpu")
    torch.distributed.barrier()
    before_load = RssSampler.current()
    sampler.reset()
    start = time.perf_counter()
    built = build_sharded_model(
        sections=ModelSections.of(cfg),
        tokenizer=VocabularyOnly(QWEN3_1_5B["vocab_size"]),
        dims=dims,
        source=ModelSource(str(model_dir)),
    )
    hf_model, model = built[0], built[1]  # (hf_model, model[, peft_model]) depending on the checkout
    torch.distributed.barrier()
    load_s, load_peak = time.perf_counter() - start, sampler.peak()
    parameters = sum(p.numel() for p in hf_model.parameters())
    largest = max(p.numel() * 4 for p in hf_model.parameters())
    before_export = RssSampler.current()
    sampler.reset()
    start = time.perf_counter()
    export_args = {}
    if "dtype" in inspect.signature(export_hf).parameters:  # export.dtype=auto: the source's (bf16 here)
        from chattune.model.io.export import export_dtype

        export_args["dtype"] = export_dtype("auto", model.source_dtype)
    export_hf(model, VocabularyOnly(0), Path(out_dir) / "hf", dims.is_main, **export_args)
    torch.distributed.barrier()
    export_s, export_peak = time.perf_counter() - start, sampler.peak()
    exported_bytes = sum(f.stat().st_size for f in (Path(out_dir) / "hf").glob("*.safetensors"))
    record = {
        "rank": dims.rank,
        "world_size": dims.world_size,
        "parameters": parameters,
        "chattune": str(Path(inspect.getfile(chattune)).parent),
        "rss_before_load": before_load,
        "load_peak_rss": load_peak,
        "load_s": load_s,
        "rss_before_export": before_export,
        "export_peak_rss": export_peak,
        "export_added": export_peak - before_export,
        "export_s": export_s,
        "largest_fp32_tensor": largest,
        "exported_bytes": exported_bytes,
    }
    with open(result_file, "a") as f:
        f.write(json.dumps(record) + "\n")
    torch.distributed.destroy_process_group()


def run(ranks: int, model_dir: Path, checkout: Path | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        results = Path(out) / "results.jsonl"
        env = dict(os.environ)
        if checkout is not None:
            env["PYTHONPATH"] = f"{checkout}{os.pathsep}{env.get('PYTHONPATH', '')}"
        subprocess.run(
            [
                *torchrun_command(__file__, nproc=ranks, port=29611),
                "--worker",
                str(model_dir),
                out,
                str(results),
            ],
            env=env,
            check=True,
            cwd=PROJECT_ROOT,
        )
        return sorted((json.loads(line) for line in results.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--checkout", type=Path, default=None, help="measure another chattune checkout")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "chattune-bench-qwen3-1.5b")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    make_model(args.model_dir)
    for ranks in args.ranks:
        for r in run(ranks, args.model_dir, args.checkout):
            model_gib = r["parameters"] * 4 / GIB
            print(
                f"{r['chattune']}: {ranks} rank(s), rank {r['rank']}: {r['parameters'] / 1e9:.2f}B parameters "
                f"({model_gib:.2f} GiB fp32) | load: peak RSS {r['load_peak_rss'] / GIB:.2f} GiB "
                f"(target model/W + 1.5 = {model_gib / ranks + 1.5:.2f}), {r['load_s']:.1f} s "
                f"(RSS before {r['rss_before_load'] / GIB:.2f}) | export: +{r['export_added'] / GIB:.2f} GiB over "
                f"{r['rss_before_export'] / GIB:.2f} (largest fp32 tensor {r['largest_fp32_tensor'] / GIB:.2f}), "
                f"{r['export_s']:.1f} s, {r['exported_bytes'] / GIB:.2f} GiB written",
                flush=True,
            )


if __name__ == "__main__":
    main()
