"""The rules a run's layout must keep, written once: `chattune validate` (and a recipe's start-up check,
`chattune.launch.run_rules`) reports each as a problem of its key, and the runtime code that depends on it
raises the same words if it is ever reached with a config that skipped the check (a library caller, a test).

Each function returns the problem (without its key) or None.
"""

from __future__ import annotations


def pad_multiple_problem(budget: int | None, multiple: int | None) -> str | None:
    """data.max_tokens_per_microbatch against data.pad_to_multiple_of: a row is padded up to the multiple."""
    if budget and multiple and multiple > 0 and budget % multiple:
        return f"{budget} is not a multiple of data.pad_to_multiple_of {multiple}: padding could exceed the budget"
    return None


def context_ranks_problem(context: int, world_size: int) -> str | None:
    """parallel.context against the number of ranks: each group of `context` consecutive ranks shares a row."""
    if context > 1 and world_size >= 1 and world_size % context:
        return (
            f"{context} does not divide the {world_size} ranks of this launch: each group of {context} ranks "
            f"shares a row; launch a multiple of {context} ranks (--nproc_per_node) or choose a divisor of the "
            "number of ranks"
        )
    return None


def tensor_ranks_problem(tensor: int, context: int, world_size: int) -> str | None:
    """parallel.tensor against the number of ranks: each group of `tensor` consecutive ranks splits the layers,
    inside each context group's ranks."""
    if tensor > 1 and context >= 1 and world_size >= 1 and world_size % (tensor * context):
        within = f" x parallel.context={context}" if context > 1 else ""
        return (
            f"{tensor}{within} does not divide the {world_size} ranks of this launch: each group of {tensor} ranks "
            f"splits every layer; launch a multiple of {tensor * context} ranks or choose a divisor"
        )
    return None


def replicate_ranks_problem(replicate: int, context: int, world_size: int) -> str | None:
    """parallel.replicate against the number of ranks: the ranks form `replicate` groups of equal size, each a
    whole number of context groups."""
    if replicate > 1 and context >= 1 and world_size >= 1 and world_size % (replicate * context):
        groups = f" of whole context groups of {context}" if context > 1 else ""
        return (
            f"{replicate} does not divide the {world_size} ranks of this launch into equal groups{groups}: each "
            f"group holds a sharded copy of the parameters; launch a multiple of {replicate * context} ranks or "
            "choose a divisor"
        )
    return None


def expert_ranks_problem(expert: int, shard_ranks: int, tensor: int = 1) -> str | None:
    """parallel.expert against the ranks FSDP2 shards over (the ranks / parallel.replicate / parallel.tensor, context
    ranks included): groups of `expert` consecutive ones each split every MoE layer's experts. Not composed with
    tensor parallelism (the ranks of a tp group compute the same tokens: each would send them to the experts again)."""
    if expert <= 1:
        return None
    if tensor > 1:
        return (
            f"expert parallelism is not composed with parallel.tensor={tensor} yet (the ranks of a tp group compute "
            "the same tokens, which each would dispatch to the experts again); set parallel.tensor=1 or "
            "parallel.expert=1"
        )
    if shard_ranks >= 1 and shard_ranks % expert:
        return (
            f"{expert} does not divide the {shard_ranks} ranks each parameter is sharded over (the ranks / "
            "parallel.replicate): each group of that many ranks splits the experts; choose a divisor of "
            f"{shard_ranks} or launch a multiple of {expert} ranks per replica"
        )
    return None


# A MoE config's routed experts per layer, by the names transformers' families give it
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# Why LoRA is refused under expert parallelism: peft wraps the stacked experts in modules of its own, which the
# expert split does not take apart yet.
EXPERT_LORA_REFUSED = (
    "LoRA with parallel.expert>1 is not built yet (peft wraps the stacked experts, and each expert's adapters would "
    "have to be split with them)"
)


def experts_split_problem(expert: int, num_experts: int) -> str | None:
    """parallel.expert against a MoE model's experts per layer: each rank of an expert group holds as many whole."""
    if expert > 1 and num_experts % expert:
        return (
            f"{expert} does not divide the model's {num_experts} experts per layer: each rank of an expert group "
            f"holds num_experts / {expert} whole ones; choose a divisor of {num_experts}"
        )
    return None


def microbatch_ranks_problem(microbatches: int, world_size: int, context: int) -> str | None:
    """data.microbatches_per_step against the data-parallel ranks (ranks / parallel.context): each takes an
    equal share of a step's microbatches."""
    if world_size < 1 or context < 1 or world_size % context:
        return None  # the context rule's problem
    ranks = world_size // context
    if microbatches % ranks:
        return (
            f"{microbatches} cannot be dealt to {ranks} data-parallel ranks: the number of ranks"
            + (f" divided by parallel.context={context} ({ranks})" if context > 1 else "")
            + " must divide it"
        )
    return None
