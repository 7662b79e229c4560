"""Packed microbatches: documents never see each other, labels never cross a boundary, nothing is lost."""

import pytest
import torch

from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels
from chattune.data.packing import best_fit_decreasing, collate_packed
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout, epoch_share
from chattune.model.packed.attention import ATTENTION_NAME
from conftest import ListSource, demo_documents, tiny_model


@pytest.mark.parametrize("architecture", ["llama", "mistral_sliding_window"])
def test_packed_logits_equal_each_document_alone(architecture):
    docs = demo_documents(6)
    # Mistral with a window shorter than the documents: the window must be applied per document too.
    overrides = {"model_type": "mistral", "sliding_window": 16} if architecture != "llama" else {}
    packed_model = tiny_model(**overrides)
    assert packed_model.config._attn_implementation == ATTENTION_NAME
    assert all(len(d) > 16 for d in docs)
    plain_model = tiny_model(**overrides)  # same seed, same weights, stock SDPA attention
    plain_model.set_attn_implementation("sdpa")
    packed_model.eval(), plain_model.eval()
    batch = collate_packed(docs)
    with torch.no_grad():
        packed = packed_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            cu_seq_lens_q=batch.cu_seqlens,
            cu_seq_lens_k=batch.cu_seqlens,
            max_length_q=batch.max_seqlen,
            max_length_k=batch.max_seqlen,
        ).logits[0]
        # Fallback: boundaries derived from position ids alone.
        from_positions = packed_model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits[0]
        offset = 0
        for doc in docs:
            alone = plain_model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
            n = len(doc)
            assert (packed[offset : offset + n] - alone).abs().max() <= 1e-5
            assert (from_positions[offset : offset + n] - alone).abs().max() <= 1e-5
            offset += n
    # The check can fail: boundaries that claim one document make the row causal across documents.
    whole_row = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    with torch.no_grad():
        leaky = packed_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            cu_seq_lens_q=whole_row,
            cu_seq_lens_k=whole_row,
            max_length_q=batch.num_tokens,
            max_length_k=batch.num_tokens,
        ).logits[0]
    second = slice(len(docs[0]), len(docs[0]) + len(docs[1]))
    assert (leaky[second] - packed[second]).abs().max() > 1e-3


def test_labels_are_shifted_within_each_document():
    docs = demo_documents(5)
    batch = collate_packed(docs)
    ids, labels = batch.input_ids[0].tolist(), batch.labels[0].tolist()
    ends = batch.cu_seqlens[1:].tolist()
    for end in ends:
        assert labels[end - 1] == IGNORE_INDEX  # the last token of a document predicts nothing
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX:
            assert label == ids[i + 1] and (i + 1) not in ends
    assert batch.position_ids[0].tolist() == [p for d in docs for p in range(len(d))]
    assert batch.num_trainable_tokens == sum(l != IGNORE_INDEX for d in docs for l in d.labels)


def test_shifted_labels_by_hand():
    # position 0 predicts 11 (untrained), position 1 predicts 12 (trained), position 2 predicts 13 (trained)
    assert shifted_labels([10, 11, 12, 13], [False, False, True, True]) == [IGNORE_INDEX, 12, 13, IGNORE_INDEX]


def test_best_fit_decreasing_keeps_every_document_within_budget():
    torch.manual_seed(0)
    lengths = torch.randint(1, 100, (300,)).tolist()
    docs = [Document(i, [1] * n, [IGNORE_INDEX] * n) for i, n in enumerate(lengths)]
    bins = best_fit_decreasing(docs, max_tokens=128)
    assert sorted(d.doc_id for b in bins for d in b) == list(range(300))
    assert all(sum(len(d) for d in b) <= 128 for b in bins)
    fill = sum(lengths) / (128 * len(bins))
    assert fill > 0.95, fill
    with pytest.raises(ValueError, match="more than the budget"):
        best_fit_decreasing([Document(0, [1] * 200, [IGNORE_INDEX] * 200)], max_tokens=128)


def _best_fit_by_scanning(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Best-fit decreasing the plain way: for each document, longest first (stable), scan every bin for
    the one with the least room that still fits it, the first such bin on a tie."""
    bins, free = [], []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [b for b, room in enumerate(free) if room >= lengths[index]]
        if fitting:
            best = min(fitting, key=lambda b: free[b])
            bins[best].append(index)
            free[best] -= lengths[index]
        else:
            bins.append([index])
            free.append(max_tokens - lengths[index])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_is_the_plain_scan(seed):
    """Same bins, same order, as scanning every bin, with many equal lengths and rooms (ties)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (400,), generator=generator).mul(6).tolist()
    docs = [Document(i, [1] * n, [IGNORE_INDEX] * n) for i, n in enumerate(lengths)]
    bins = best_fit_decreasing(docs, max_tokens=120)
    assert [[d.doc_id for d in b] for b in bins] == _best_fit_by_scanning(lengths, 120)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_document_once_per_epoch_across_ranks(world_size):
    docs = [Document(i, [1] * (5 + i % 17), [2] * (5 + i % 17)) for i in range(101)]
    seen = {0: [], 1: []}
    for rank in range(world_size):
        stream = PackedStream(
            ListSource(docs), StreamLayout(rank, world_size, num_epochs=2), 7, PackingBudget(64, 0, buffer_records=10)
        )
        for batch in stream:  # a microbatch never mixes epochs
            seen[stream.epoch] += batch.doc_ids
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(101)), f"epoch {epoch}"
    # Deterministic, and a new permutation each epoch.
    assert epoch_share(101, 0, 7, 0, 2) == epoch_share(101, 0, 7, 0, 2)
    assert epoch_share(101, 0, 7, 0, 2) != epoch_share(101, 1, 7, 0, 2)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.launch
def test_stream_state_dict_resumes_the_same_microbatches(num_workers):
    docs = [Document(i, [1] * (3 + i % 11), [2] * (3 + i % 11)) for i in range(80)]

    def stream():
        return PackedStream(
            ListSource(docs), StreamLayout(), 3, PackingBudget(40, 0, buffer_records=16), num_workers=num_workers
        )

    uninterrupted = iter(stream())
    expected = [next(uninterrupted).doc_ids for _ in range(60)]  # about three epochs
    boundaries = [i + 1 for i in range(59) if set(expected[i]) & set(expected[i + 1]) == set()]
    # Every point with workers in-process; with worker processes (slower to start), a spread of points.
    stops = range(1, 60) if num_workers == 0 else sorted({1, 2, 13, 29, 30, 31, 44, 59})
    for stop in stops:
        first = stream()
        batches = iter(first)
        got = [next(batches).doc_ids for _ in range(stop)]
        resumed = stream()
        resumed.load_state_dict(first.state_dict())
        batches = iter(resumed)
        got += [next(batches).doc_ids for _ in range(60 - stop)]
        assert got == expected, f"resuming after {stop} microbatches diverged"
    assert boundaries


@pytest.mark.launch
def test_workers_yield_identical_microbatches(tokenizer):
    """Tokenizing in 2 worker processes gives the same microbatches, in the same order, as in-process."""
    from chattune.config.paths import DEMO_ASSETS
    from chattune.data.ingest.formats import SourceSpec
    from chattune.data.ingest.records import RecordSource
    from chattune.data.templates.sft_documents import SFTDocuments

    documents = SFTDocuments(RecordSource([SourceSpec(str(DEMO_ASSETS / "chat_train.jsonl"))]), tokenizer, 1024)

    def first_batches(num_workers):
        stream = PackedStream(
            documents, StreamLayout(1, 2), 5, PackingBudget(1024, 0, buffer_records=64), num_workers=num_workers
        )
        batches = iter(stream)
        return [next(batches) for _ in range(30)]

    in_process, in_workers = first_batches(0), first_batches(2)
    for a, b in zip(in_process, in_workers):
        assert a.doc_ids == b.doc_ids
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.cu_seqlens, b.cu_seqlens)


def test_a_rank_without_records_gets_empty_microbatches_in_a_finite_stream():
    docs = [Document(0, [1, 2, 3], [2, 3, IGNORE_INDEX])]
    batches = list(PackedStream(ListSource(docs), StreamLayout(1, 2, num_epochs=2), 0, PackingBudget(8, 0)))
    assert len(batches) == 2 and all(b.num_trainable_tokens == 0 and b.doc_ids == [] for b in batches)
    with pytest.raises(ValueError, match="cannot be shared"):
        PackedStream(ListSource(docs), StreamLayout(1, 2), 0, PackingBudget(8, 0))


def test_a_buffer_must_hold_at_least_one_record():
    with pytest.raises(ValueError, match="buffer_records must be at least 1"):
        PackedStream(
            ListSource([Document(0, [1], [IGNORE_INDEX])]), StreamLayout(), 0, PackingBudget(8, 0, buffer_records=0)
        )


def test_padding_to_a_multiple_is_never_attended_nor_trained():
    docs = demo_documents(5)
    plain, padded = collate_packed(docs), collate_packed(docs, pad_to_multiple_of=64, pad_token_id=0)
    assert padded.num_tokens % 64 == 0 and padded.num_tokens > plain.num_tokens
    assert padded.num_trainable_tokens == plain.num_trainable_tokens
    assert padded.doc_ids == plain.doc_ids
    assert padded.cu_seqlens[:-1].tolist() == plain.cu_seqlens.tolist()  # the padding is a segment of its own
    model = tiny_model().eval()

    def logits(batch):
        return model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            cu_seq_lens_q=batch.cu_seqlens,
            max_length_q=batch.max_seqlen,
        ).logits[0]

    with torch.no_grad():
        assert (logits(padded)[: plain.num_tokens] - logits(plain)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="must be a multiple"):
        PackedStream(ListSource(docs), StreamLayout(), 0, PackingBudget(100, 0, pad_to_multiple_of=64))
    stream = PackedStream(ListSource(docs), StreamLayout(num_epochs=1), 0, PackingBudget(512, 0, pad_to_multiple_of=64))
    batches = list(stream)
    assert all(b.num_tokens % 64 == 0 for b in batches)
    assert sorted(d for b in batches for d in b.doc_ids) == list(range(5))


def test_share_sampler_chunks_close_each_epoch():
    from chattune.data.stream import ShareSampler

    items = list(ShareSampler(8, 0, 1, seed=0, shuffle=False, num_epochs=2, chunk_records=4))
    assert items == [
        (0, [0, 1, 2, 3], False),
        (0, [4, 5, 6, 7], True),
        (1, [0, 1, 2, 3], False),
        (1, [4, 5, 6, 7], True),
    ]
    assert list(ShareSampler(5, 0, 1, seed=0, shuffle=False, num_epochs=1, chunk_records=3)) == [
        (0, [0, 1, 2], False),
        (0, [3, 4], True),
    ]
    # rank 1 of 2 has no record of a one-record data set: one empty chunk closes each of its epochs
    assert list(ShareSampler(1, 1, 2, seed=0, shuffle=False, num_epochs=2, chunk_records=3)) == [
        (0, [], True),
        (1, [], True),
    ]


def test_a_microbatch_and_host_values_reach_the_device_unchanged():
    from chattune.distributed import host_values_on

    batch = collate_packed(demo_documents(3))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    moved = batch.to(device)
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segment_ids", "document_ids"):
        original, copy = getattr(batch, name), getattr(moved, name)
        assert copy.device.type == device.type and copy.dtype == original.dtype
        assert torch.equal(copy.cpu(), original)
    values = host_values_on(device, [3, 1, 4], torch.int64)
    assert values.device.type == device.type and values.tolist() == [3, 1, 4]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only: whether a host-to-device copy waits for the device"
)
def test_on_cuda_a_microbatch_and_host_values_go_to_the_device_without_a_host_sync():
    from chattune.distributed import host_values_on

    batch = collate_packed(demo_documents(3))
    torch.cuda.set_sync_debug_mode("error")  # a synchronising copy raises
    try:
        moved = batch.to("cuda")
        values = host_values_on(torch.device("cuda"), [3, 1], torch.int64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(moved.input_ids.cpu(), batch.input_ids) and values.tolist() == [3, 1]


def test_a_continuing_segment_starts_where_its_shared_prompt_ends_and_names_it():
    """data.share_prompts: [prompt + X][Y] with Y continuing the first 3 tokens; a plain document and padding around."""
    plain = Document(0, list(range(10, 14)), [IGNORE_INDEX] * 4)
    pair = Document(1, list(range(20, 31)), [IGNORE_INDEX] * 11, segments=(6, 5), shared_prefix=3)
    batch = collate_packed([plain, pair], pad_to_multiple_of=8)
    assert batch.cu_seqlens.tolist() == [0, 4, 10, 15, 16]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 0]
    assert batch.prefixes.tolist() == [[0, 0], [0, 0], [4, 3], [0, 0]]  # the prompt: the row's tokens 4 to 6
    assert batch.shared_prompt_tokens == 3 and batch.to("cpu").prefixes is batch.prefixes
    assert collate_packed([plain]).prefixes is None and collate_packed([plain]).shared_prompt_tokens == 0
    for shared, segments in ((6, (6, 5)), (3, ())):  # the whole first segment; no segment to continue it
        bad = Document(2, list(range(11)), [IGNORE_INDEX] * 11, segments=segments, shared_prefix=shared)
        with pytest.raises(ValueError, match=r"document 2: a shared prompt of \d+ tokens needs a first segment"):
            collate_packed([bad])
