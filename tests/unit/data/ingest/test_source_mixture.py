"""Mixtures: the sampler's proportions, passes, stopping and rank shares, and the online mixer's update
(by hand, and identical on every rank)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch.multiprocessing as mp

from chattune.data.ingest.mixing_policy import Mixer
from chattune.data.ingest.source_mixture import MixtureSampler, ProbabilitySchedule
from chattune.data.ingest.sources import MixedDocuments
from conftest import ListSource, demo_documents, free_port, init_worker_process_group, spawn

SIZES = [50, 200, 10]
OFFSETS = [0, 50, 250, 260]


def source_of(index: int) -> int:
    return next(k for k in range(len(SIZES)) if index < OFFSETS[k + 1])


def sampler(schedule, rank=0, world_size=1, stopping="all_exhausted", num_epochs=None, chunk=64, seed=3):
    return MixtureSampler(SIZES, schedule, rank, world_size, seed, stopping, num_epochs, chunk)


def records(it, count: int) -> list[int]:
    out: list[int] = []
    while len(out) < count:
        out += next(it)[1]
    return out[:count]


def test_static_proportions_converge_to_the_weights_and_each_pass_is_a_permutation():
    weights = [0.5, 0.3, 0.2]
    drawn = records(sampler(ProbabilitySchedule(weights)), 30000)
    shares = Counter(source_of(i) for i in drawn)
    assert all(abs(shares[k] / len(drawn) - weights[k]) < 0.01 for k in range(3)), shares
    small = [i - OFFSETS[2] for i in drawn if source_of(i) == 2]  # source 2 (10 records) wraps ~600 times
    for start in range(0, len(small) - len(small) % 10, 10):
        assert sorted(small[start : start + 10]) == list(range(10)), "a pass must hold every record once"
    assert small[:10] != small[10:20], "each pass reshuffles"


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_takes_its_own_draws_of_the_same_global_sequence(world_size):
    schedule = ProbabilitySchedule([0.2, 0.5, 0.3])
    single = records(sampler(schedule), 3000)
    shares = [records(sampler(schedule, r, world_size), 3000 // world_size) for r in range(world_size)]
    assert [shares[n % world_size][n // world_size] for n in range(3000)] == single


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_an_epoch_ends_when_the_first_or_every_source_finished_a_pass(stopping):
    it = sampler(ProbabilitySchedule([0.2, 0.5, 0.3]), stopping=stopping, num_epochs=2)
    chunks = list(it)
    closing = [i for i, (_, _, closes) in enumerate(chunks) if closes]
    assert len(closing) == 2 and closing[-1] == len(chunks) - 1 and [c[0] for c in chunks].count(0) == closing[0] + 1
    first_epoch = [i for c in chunks[: closing[0] + 1] for i in c[1]]
    counts = Counter(source_of(i) for i in first_epoch)
    passes = [counts[k] / SIZES[k] for k in range(3)]
    if stopping == "first_exhausted":  # the small source ran out first; nothing else finished a pass
        assert passes[2] == 1.0 and passes[0] < 1 and passes[1] < 1
    else:  # the big source finished last, exactly at the end of the epoch
        assert passes[1] == 1.0 and min(passes) == 1.0 and passes[2] > 1


def test_a_schedule_change_applies_from_its_draw_and_a_restored_sampler_continues_exactly():
    schedule = ProbabilitySchedule([0.5, 0.5, 0.0])
    it = sampler(schedule, chunk=100)
    before = records(it, 500)
    assert all(source_of(i) != 2 for i in before)
    schedule.add(it.draw, [0.0, 0.0, 1.0])
    state = it.state_dict()
    after = records(it, 300)
    assert all(source_of(i) == 2 for i in after)
    restored = sampler(schedule, chunk=100)
    restored.load_state_dict(state)
    assert records(restored, 300) == after
    with pytest.raises(ValueError):
        schedule.add(schedule.starts[-1] - 1, [1, 1, 1])  # an entry may not precede the last one


def test_mixed_documents_address_each_source_by_one_index():
    docs_a = demo_documents(3)
    docs_b = [replace(d, doc_id=i) for i, d in enumerate(demo_documents(2, start=10))]  # a source's own indices
    mixed = MixedDocuments([("a", ListSource(docs_a)), ("b", ListSource(docs_b))])
    got = mixed.get_many([4, 0, 3])
    assert [(d.doc_id, d.source) for d in got] == [(4, 1), (0, 0), (3, 1)]
    assert (
        got[0].input_ids.tolist() == docs_b[1].input_ids.tolist() and docs_b[1].doc_id == 1
    )  # the source's own copy untouched


def figures(losses, units, docs=(1, 1, 1), tokens=(1, 1, 1)) -> dict[str, float]:
    out = {}
    for k in range(3):
        out.update(
            {
                f"source_loss/{k}": losses[k],
                f"source_units/{k}": units[k],
                f"source_documents/{k}": docs[k],
                f"source_tokens/{k}": tokens[k],
            }
        )
    return out


# Per rank: summed token losses and trainable tokens of each source over the update interval.
RANK_FIGURES = [([30.0, 2.0, 0.0], [10, 4, 0]), ([10.0, 1.0, 0.0], [10, 6, 0])]


def _update_on_rank(rank: int, world_size: int, port: int, results) -> None:
    init_worker_process_group(rank, world_size, port)
    mixer = Mixer(["hard", "easy", "unseen"], [1, 1, 2], "online", gamma=0.3, eta=0.5, update_every=2)
    mixer.sampler = sampler(mixer.schedule, rank, world_size)
    records(mixer.sampler, 100 + 40 * rank)  # ranks have generated different numbers of draws
    mixer.observe(figures(*RANK_FIGURES[rank]), finite=True)
    assert mixer.maybe_update(1, torch_cpu()) is None  # not an update step
    logged = mixer.maybe_update(2, torch_cpu())
    results[rank] = (mixer.state_dict(), logged, mixer.sampler.draw)


def torch_cpu():
    import torch

    return torch.device("cpu")


@pytest.mark.launch
def test_online_update_matches_a_hand_computation_and_is_identical_on_every_rank():
    results = mp.Manager().dict()
    spawn(_update_on_rank, args=(2, free_port(), results), nprocs=2)
    (state0, logged0, draw0), (state1, logged1, draw1) = results[0], results[1]
    assert state0["log_weights"] == state1["log_weights"] and state0["schedule"] == state1["schedule"]
    assert logged0 == logged1
    # By hand: the prior is the weights (1:1:2); p = 0.7 * softmax(log w) + 0.3 / 3.
    prior = np.array([0.25, 0.25, 0.5])
    p_before = 0.7 * prior + 0.1
    mean_loss = np.array([40.0 / 20, 3.0 / 10])  # over both ranks
    log_w = np.log(prior) + 0.5 * np.array([mean_loss[0] / p_before[0], mean_loss[1] / p_before[1], 0.0])
    p_after = 0.7 * np.exp(log_w) / np.exp(log_w).sum() + 0.1
    assert np.allclose(state0["log_weights"], log_w, rtol=1e-12)
    assert state0["schedule"]["starts"] == [0, max(draw0, draw1)]  # from the furthest draw any rank generated
    assert np.allclose(state0["schedule"]["probabilities"][1], p_after, rtol=1e-12)
    assert logged0["mix/hard/probability"] > logged0["mix/easy/probability"]
    assert logged0["mix/unseen/reward"] == 0.0 and logged0["mix/hard/reward"] == pytest.approx(2.0)


def test_split_records_keep_every_piece_and_every_record_after_them(tmp_path):
    """data.overlong=split: one record gives several documents. The records after a split one in the same
    read must not be lost (they were, when outcomes were matched to records one to one)."""
    from chattune.data.ingest.formats import SourceSpec
    from chattune.data.ingest.records import RecordSource
    from chattune.data.stream import documents_of
    from chattune.data.templates.sft_documents import SFTDocuments
    from conftest import DEMO_ASSETS, demo_tokenizer

    data = tmp_path / "chats.jsonl"
    data.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:12]))
    tokenizer = demo_tokenizer()

    def source():
        return SFTDocuments(RecordSource([SourceSpec(str(data))]), tokenizer, 48, overlong="split")

    mixed = MixedDocuments([("a", source()), ("b", source())])
    indices = [13, 2, 0, 20, 5, 11, 3]  # both sources, out of order
    got = mixed.get_many(indices)
    # Independently: each record read on its own, re-addressed by its source's offset.
    want = [(i, d.piece, d.input_ids.tolist()) for i in indices for d in documents_of(source(), [i % 12])]
    assert len(want) > len(indices), "the budget should split some records"
    assert [(d.doc_id, d.piece, d.input_ids.tolist()) for d in got] == want
    assert [d.source for d in got if d.piece == 0] == [int(i >= 12) for i in indices]
