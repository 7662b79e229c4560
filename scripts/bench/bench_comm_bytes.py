"""Bytes each rank sends in one training step, per layout of 4 ranks, counted against the formula.

    python scripts/bench/bench_comm_bytes.py [--ranks 4] [--layouts 1x1x1 2x1x1 1x2x1 2x2x1 1x1x2 1x2x2]
    python scripts/bench/bench_comm_bytes.py --moe --layouts 1x1x1 1x1x1x2 1x1x1x4   # experts: FSDP only, ep 2, ep 4

A layout RxCxT is parallel.replicate=R, parallel.context=C, parallel.tensor=T; RxCxTxE adds parallel.expert=E. Each run spawns the ranks on gloo, builds a random-init
Qwen3-shaped model (hidden 256, 4 layers, the demo tokenizer's vocabulary) sharded by chattune's `shard_model`,
trains one step (its first, not counted) and then counts a second step's collectives: every call of
torch.distributed's all-gather, reduce-scatter, all-reduce and all-to-all is wrapped, and its payload and group
size are recorded. What a rank sends is taken as a ring algorithm sends it, which gloo and NCCL's rings do:

    all-gather of an output of B bytes over g ranks       B (g-1)/g
    reduce-scatter of an input of B bytes over g ranks    B (g-1)/g
    all-reduce of B bytes over g ranks                    2 B (g-1)/g
    all-to-all of B bytes over g ranks                    B (g-1)/g

The formula for the parameters' traffic, P the model's parameter bytes (fp32 here: the CPU computes in fp32), L
those of its decoder layers, S = ranks / (R T) the ranks a parameter is sharded over: the forward's and the
backward's all-gathers (P + L) (S-1)/S (each layer is resharded after its forward and gathered again for its
backward; the root's parameters, the embeddings and the final norm, stay gathered), the gradients'
reduce-scatter P (S-1)/S, and under HSDP their all-reduce across the R replicas 2 (P/S) (R-1)/R. Under tensor
parallelism P and L count a rank's part: the split linear layers' bytes and the vocabulary's (the tied
embedding and output layer) / T. Tensor parallelism's own exchanges of activations, with the stream between the
blocks split by tokens (sequence parallelism), move a rank's hidden states of the row, B = (N / C) x H x 4
bytes, as B (T-1)/T each: per block (attention, MLP) an all-gather of its input and a reduce-scatter of its
partial sums in the forward, and the same two in the backward (4 per block, 8 per layer, as many bytes as the 2
all-reduces a block sends with the stream whole); the split embedding's reduce-scatter and the final hidden
states' all-gather in the forward, and their transposes in the backward (4 more). Half are all-gathers, half
reduce-scatters. The split vocabulary's loss gathers 2 fp32 a token from each rank of the group, in the forward
and again in the backward's recompute (one loss chunk here): 2 x 2 x T x (N / C) x 4 (T-1)/T. FSDP2 pads each
parameter's rows to a multiple of S, so the counted figures may exceed the formula by that padding. The step's own small all-reduces (its counts, the gradient norm;
under tp, each norm's weight gradient summed over the group) and context parallelism's all-to-alls are listed
apart.

With --moe the model is Qwen3-MoE-shaped (the same attention, 8 experts of width 256 per layer, top 2), X the bytes
of its experts (all in the decoder layers) and Xl one layer's. Without expert parallelism FSDP2 gathers every
expert of a layer for its forward and again for its backward, as above (X is in P and L). With parallel.expert=E
each rank holds X/E of them, sharded over the S/E ranks holding the same ones: the experts' all-gathers send
2 (X/E)(S/E-1)/(S/E) and their reduce-scatter (X/E)(S/E-1)/(S/E), the rest (P - X, L - X) as above over S; a
layer gathers Xl/E of experts, not Xl. The tokens move instead: per MoE layer the forward exchanges the (token,
choice) pairs' counts per expert (num_experts int64) and their hidden states (N k H fp32) to the ranks holding their
experts, and the results back (N k H); the backward sends the hidden states' gradients both ways again. A rank sends the pairs whose expert another rank holds: with routing spread evenly (E-1)/E of them, the
formula's figure; the counted one is the model's real routing. The backward's exchanges run inside autograd,
where no Python wrapper sees them: each sends back exactly what its forward received (counted from the forward
call's split sizes).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
sys.path.insert(0, str(PROJECT_ROOT))
MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)
# torch.distributed's collectives (the names of several torch versions), how a ring sends each: (kind, which
# argument holds the B of the docstring's table, the factor of B (g-1)/g)
COLLECTIVES = {
    "all_gather_single": ("all-gather", 0, 1),
    "all_gather_into_tensor": ("all-gather", 0, 1),
    "reduce_scatter_single": ("reduce-scatter", 1, 1),
    "reduce_scatter_tensor": ("reduce-scatter", 1, 1),
    "all_reduce": ("all-reduce", 0, 2),
    "all_to_all_single": ("all-to-all", 1, 1),
}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# DTensor's own (tensor parallelism's activations, its redistributions) go through the functional collectives:
# (kind, the factor of the input's bytes B (g-1)/g; an all-gather's output is g inputs)
FUNCTIONAL = {
    "all_reduce": ("all-reduce", 2),
    "all_to_all_single_autograd": ("all-to-all", "splits"),
    "all_gather_tensor": ("all-gather", "g"),
    "all_gather_single": ("all-gather", "g"),
    "reduce_scatter_tensor": ("reduce-scatter", 1),
    "reduce_scatter_single": ("reduce-scatter", 1),
}


def _group_size(group) -> int:
    if isinstance(group, tuple):  # (mesh, its dimension)
        mesh, dim = group
        return mesh.size(dim)
    if isinstance(group, (list, range)):
        return len(group)
    return group.size()  # a process group or a 1-D mesh


class Counter:
    """Wraps torch.distributed's collectives and the functional ones DTensor uses; while `counting`, adds each
    call's ring bytes to its kind."""

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.counting = False
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name, (kind, index, factor) in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, index, factor))
        for name, (kind, factor) in FUNCTIONAL.items():
            original = getattr(funcol, name, None)
            if original is not None:
                setattr(funcol, name, self._wrap_functional(original, kind, factor))

    def _wrap_functional(self, original, kind: str, factor):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if self.counting and factor == "splits":  # an uneven all-to-all through autograd: its rows to others
                arguments = signature.bind(*args, **kwargs).arguments
                self._count_exchange(arguments["self"], arguments["input_split_sizes"], arguments["group"])
                if arguments["self"].requires_grad:  # its backward sends back what the forward received
                    self._count_exchange(arguments["self"], arguments["output_split_sizes"], arguments["group"])
            elif self.counting:
                arguments = signature.bind(*args, **kwargs).arguments
                ranks = _group_size(arguments["group"])
                if ranks > 1:
                    scale = ranks if factor == "g" else factor
                    self.sent[kind] += scale * _nbytes(arguments["self"]) * (ranks - 1) / ranks
                    self.calls[kind] += 1
            return original(*args, **kwargs)

        return counted

    def _count_exchange(self, tensor: torch.Tensor, splits: list[int] | None, group) -> None:
        """An all-to-all's rows sent to the other ranks (`splits`: rows per rank; None: even)."""
        ranks = _group_size(group) if group is not None else dist.get_world_size()
        if ranks == 1:
            return
        row = _nbytes(tensor) // max(tensor.shape[0], 1)
        rows = list(splits) if splits is not None else [tensor.shape[0] // ranks] * ranks
        own = dist.get_rank(group if isinstance(group, dist.ProcessGroup) else None)
        if not isinstance(group, dist.ProcessGroup) and hasattr(group, "get_local_rank"):
            own = group.get_local_rank()
        self.sent["all-to-all"] += row * (sum(rows) - rows[own])
        self.calls["all-to-all"] += 1

    def _wrap(self, original, kind: str, index: int, factor: int):
        signature = inspect.signature(original)
        tensor_name = list(signature.parameters)[index]

        def counted(*args, **kwargs):
            if self.counting:
                arguments = signature.bind(*args, **kwargs).arguments
                tensor = arguments[tensor_name]
                ranks = dist.get_world_size(arguments.get("group"))
                if kind == "all-to-all" and arguments.get("input_split_sizes") is not None:  # uneven: exact rows
                    if ranks > 1:
                        self._count_exchange(tensor, arguments["input_split_sizes"], arguments.get("group"))
                elif ranks > 1:
                    self.sent[kind] += factor * _nbytes(tensor) * (ranks - 1) / ranks
                    self.calls[kind] += 1
            return original(*args, **kwargs)

        return counted


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)  # --moe: Qwen3-MoE's shape


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def worker(rank: int, world_size: int, degrees: tuple[int, int, int, int], moe: bool, port: int, out: str) -> None:
    """`degrees`: (replicate, context, tensor, expert)."""
    replicate, context, tensor, expert = degrees
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    counter = Counter()  # before chattune and FSDP2 look the collectives up
    from transformers import AutoConfig, AutoTokenizer

    from chattune.config.paths import DEMO_ASSETS
    from chattune.config.schema import ParallelConfig
    from chattune.data.documents import IGNORE_INDEX, Document
    from chattune.data.feed import StepBatches
    from chattune.data.packing import collate_packed
    from chattune.distributed import init_distributed, shutdown_distributed
    from chattune.model.causal_lm import PackedCausalLM, build_hf_model
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.expert_parallel import experts_modules
    from chattune.parallel.fsdp import shard_model
    from chattune.parallel.tensor_parallel import PLAN
    from chattune.train.step import UpdateRule, train_step

    layout = ParallelConfig(replicate=replicate, context=context, tensor=tensor, expert=expert)
    dims = init_distributed("cpu", layout)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **MODEL, **MOE) if moe else AutoConfig.for_model("qwen3", **MODEL)
    hf_model = build_hf_model(tokenizer, config)
    expert_bytes = [sum(_nbytes(p) for p in m.parameters(recurse=False)) for _, _, m in experts_modules(hf_model)]
    split = {  # (tensor parallelism's linears; a MoE block's experts are not split over tp)
        id(p)
        for layer in hf_model.model.layers
        for name in PLAN
        if _has_submodule(layer, name)
        for p in layer.get_submodule(name).parameters()
    }
    split.add(id(hf_model.get_input_embeddings().weight))  # the vocabulary (tied: the output layer's too)

    def part(p: torch.Tensor) -> float:  # what one rank of a tp group holds of `p`
        return _nbytes(p) / tensor if id(p) in split else _nbytes(p)

    parameter_bytes = sum(part(p) for p in hf_model.parameters())
    layer_bytes = sum(part(p) for layer in hf_model.model.layers for p in layer.parameters())
    model = PackedCausalLM(hf_model, context_group=dims.cp_group)
    placement = shard_model(model, dims)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(dims.data_rank)
    ids = torch.randint(16, len(tokenizer), (512,), generator=generator)
    labels = ids.roll(-1).clone()
    labels[-1] = IGNORE_INDEX
    row = collate_packed([Document(0, ids.numpy(), labels.numpy())])
    for step in range(2):
        counter.counting = step == 1
        train_step(model, TokenCrossEntropy(), StepBatches([row]), UpdateRule(optimizer, scheduler, 1.0), placement)
    counter.counting = False
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "sent": counter.sent,
                    "calls": counter.calls,
                    "P": parameter_bytes,
                    "L": layer_bytes,
                    "X": sum(expert_bytes),
                    "Xl": max(expert_bytes, default=0),
                    "moe_layers": len(expert_bytes),
                    "row": 512 // context * MODEL["hidden_size"] * 4,  # a rank's hidden states of the row
                    "tokens": 512 // context,
                }
            )
        )
    shutdown_distributed()


def formula(found: dict, world_size: int, replicate: int, tensor: int, expert: int = 1) -> dict[str, float]:
    parameter_bytes, layer_bytes = found["P"], found["L"]
    shards = world_size // (replicate * tensor)
    experts = found["X"] if expert > 1 else 0  # sharded apart: 1/E of them over S/E ranks
    gathered = (parameter_bytes - experts + layer_bytes - experts) * (shards - 1) / shards  # the root's: once
    scattered = (parameter_bytes - experts) * (shards - 1) / shards
    if expert > 1:
        holders = shards // expert
        gathered += 2 * (experts / expert) * (holders - 1) / holders
        scattered += (experts / expert) * (holders - 1) / holders
    across = 2 * (parameter_bytes / shards) * (replicate - 1) / replicate
    # (each kind: half of the 8 per layer and 4 for the vocabulary)
    activations = (4 * MODEL["num_hidden_layers"] + 2) * found["row"] * (tensor - 1) / tensor
    loss = 2 * 2 * tensor * found["tokens"] * 4 * (tensor - 1) / tensor
    kinds = {
        "all-gather": gathered + activations + loss,
        "reduce-scatter": scattered + activations,
        "all-reduce": across,
    }
    if expert > 1:  # per MoE layer: the split sizes, hidden states and indices there, the results back; the backward's
        # two exchanges of hidden-state gradients; (E-1)/E of the pairs to other ranks with routing spread evenly
        pairs = found["tokens"] * MOE["num_experts_per_tok"]
        layer = MOE["num_experts"] * 8 + pairs * 4 * MODEL["hidden_size"] * 4
        kinds["all-to-all"] = found["moe_layers"] * layer * (expert - 1) / expert
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=["1x1x1", "2x1x1", "1x2x1", "2x2x1", "1x1x2", "1x2x2"])
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model (8 experts, top 2)")
    args = parser.parse_args()
    from chattune.distributed import free_port

    mib = 2**20
    axes = "R x C x T x E" if any(layout.count("x") == 3 for layout in args.layouts) else "R x C x T"
    print(f"| layout ({axes}) on {args.ranks} ranks | collective | counted MiB/rank | formula MiB/rank | calls |")
    print("|---|---|---:|---:|---:|")
    for layout in args.layouts:
        replicate, context, tensor, expert = [*map(int, layout.split("x")), 1][:4]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "sent.json")
            spawned = (args.ranks, (replicate, context, tensor, expert), args.moe, free_port(), out)
            mp.spawn(worker, args=spawned, nprocs=args.ranks, join=True)
            found = json.loads(Path(out).read_text())
        want = formula(found, args.ranks, replicate, tensor, expert)
        for kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
            counted = found["sent"].get(kind, 0.0)
            expected = want.get(kind)
            shown = f"{expected / mib:.3f}" if expected is not None else "(measured only)"
            if kind == "all-reduce":
                shown += " + the step's counts and norm" + (", the norms' gradients" if tensor > 1 else "")
            print(f"| {layout} | {kind} | {counted / mib:.3f} | {shown} | {found['calls'].get(kind, 0)} |")
        print(f"| {layout} | (P, L of a rank's part) | {found['P'] / mib:.3f}, {found['L'] / mib:.3f} | | |")
        if args.moe:
            per_layer = found["Xl"] / expert / mib
            print(f"| {layout} | (experts gathered per layer) | {per_layer:.3f} of {found['Xl'] / mib:.3f} | | |")


if __name__ == "__main__":
    main()
