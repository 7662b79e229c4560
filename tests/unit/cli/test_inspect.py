"""`chattune inspect` reports what training will see, checked against counts made by hand."""

from __future__ import annotations

import json

import pytest

from chattune.cli.main import main
from conftest import demo_tokenizer

QUESTIONS = [("What is 2 + 2?", "2 + 2 = 4."), ("Reverse 'abc'.", "cba"), ("Sort 3, 1, 2", "1, 2, 3")]


def test_inspect_counts_fill_and_highlighted_documents(tmp_path, capsys):
    records = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS
    ]
    records.append(
        {"messages": [{"role": "user", "content": "Talk."}, {"role": "assistant", "content": "word " * 200}]}
    )
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = tmp_path / "report.html"

    assert (
        main(
            [
                "inspect",
                "--num-docs",
                "2",
                "--no-color",
                "--html",
                str(page),
                f"data.train=[{data}]",
                "data.max_tokens_per_microbatch=128",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out

    tokenizer = demo_tokenizer()
    lengths = [len(tokenizer.apply_chat_template(r["messages"])["input_ids"]) for r in records[:3]]
    # Trained: each answer's tokens and its <|im_end|> (the demo template puts "\n" before the answer).
    trainable = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for _, a in QUESTIONS)
    assert "records read: 4" in out
    assert "skipped: 1 (overlong 1)\n" in out
    assert "documents: 3" in out
    assert f"tokens: {sum(lengths)}" in out
    assert f"trainable tokens: {trainable} ({trainable / sum(lengths):.1%})" in out
    assert f"microbatches at 128 tokens: 1, fill {sum(lengths) / 128:.2%}" in out
    assert "[[2 + 2 = 4.<|im_end|>]]" in out and "[[cba<|im_end|>]]" in out
    assert "[[What is" not in out and "Sort 3, 1, 2" not in out  # two documents shown, prompts untrained
    text = page.read_text()
    assert '<span class="trained">2 + 2 = 4.&lt;|im_end|&gt;</span>' in text
    assert "records read: 4" in text


def test_inspect_with_split_reads_every_record_of_the_long_chats(capsys):
    """The 5 shared deita conversations, 3 of them over a 4096 budget: split, none lost (3 of 5 were read)."""
    import pytest

    from conftest import SHARED_ASSETS

    if not SHARED_ASSETS.is_dir():
        pytest.skip("../shared/assets is absent")
    assert (
        main(
            [
                "inspect",
                "--num-docs",
                "0",
                "--no-color",
                "data.overlong=split",
                "data.max_tokens_per_microbatch=4096",
                f"data.train=[{SHARED_ASSETS}/data/messages_deita_long.parquet]",
                f"tokenizer.path={SHARED_ASSETS}/tokenizers/qwen3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "records read: 5" in out and "split 3" in out


def test_inspect_reads_preference_pairs_for_a_dpo_config(tmp_path, capsys):
    pairs = [
        {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."},
        {"prompt": "Reverse 'ab'.", "chosen": "ba", "rejected": "ba"},
    ]  # identical replies: a counted skip
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert (
        main(
            [
                "inspect",
                "dpo/tiny",
                "--num-docs",
                "1",
                "--no-color",
                "model.path=null",
                f"data.train=[{{path: {data}, format: preference}}]",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "records read: 2" in out and "skipped: 1 (identical_replies 1)" in out and "documents: 1" in out
    assert "--- document 0 chosen (" in out and "--- document 0 rejected (" in out
    assert "[[4.<|im_end|>]]" in out and "[[5.<|im_end|>]]" in out
    assert "shared prompts" not in out


def test_inspect_says_what_shared_prompts_save_and_shows_each_side_whole(tmp_path, capsys, tokenizer):
    pair = {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."}
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(pair) + "\n")
    command = ["inspect", "dpo/tiny", "--num-docs", "1", "--no-color", "model.path=null"]
    assert main([*command, f"data.train=[{{path: {data}, format: preference}}]", "data.share_prompts=true"]) == 0
    out = capsys.readouterr().out
    question = [{"role": "user", "content": pair["prompt"]}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    saved = len(prompt) - 1  # the prompt less its last token, which predicts each reply's first
    sides = len(tokenizer.apply_chat_template([*question, {"role": "assistant", "content": "4."}])["input_ids"])
    assert f"tokens: {2 * sides - saved}" in out
    assert (
        f"shared prompts: {saved} tokens not computed again ({saved / (2 * sides):.1%} of the unshared tokens)" in out
    )
    assert f"--- document 0 rejected (its first {saved} tokens shared with the chosen side, computed once)" in out
    assert out.count("What is 2 + 2?") == 2 and "[[5.<|im_end|>]]" in out  # the rejected side whole, prompt too


def test_inspect_runs_validates_checks_first_and_never_tries_a_hub(tmp_path, capsys):
    assert (
        main(
            [
                "inspect",
                "sft/tiny",
                "optimizer.lrr=1",
                "data.train=[data/chats.jsonl]",
                "tokenizer.path=tokenizers/qwen3",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "optimizer.lrr: unknown key; did you mean optimizer.lr?" in err
    assert "data.train[0]: data file 'data/chats.jsonl' does not exist" in err
    assert "tokenizer.path: 'tokenizers/qwen3' does not exist (a hub tokenizer is written hf:tokenizers/qwen3)" in err


@pytest.mark.parametrize("tokenizer_dir", ["phi-3-mini", "qwen3", "demo"])
def test_the_highlighted_pieces_are_the_decoded_document(tokenizer_dir):
    """Decoded token by token, a SentencePiece tokenizer (Phi-3's) lost every space a token carries at its
    start ("Whoareyou?"): the pieces now join to exactly the decoded document, trained spans where they are."""
    from transformers import AutoTokenizer

    from chattune.cli.inspect_data import trained_pieces
    from chattune.config.paths import DEMO_ASSETS
    from chattune.data.documents import Document, shifted_labels
    from chattune.data.templates.chat_template import probe_template, tokenize_conversation
    from conftest import SHARED_ASSETS

    directory = DEMO_ASSETS / "tokenizer" if tokenizer_dir == "demo" else SHARED_ASSETS / "tokenizers" / tokenizer_dir
    if not directory.is_dir():
        pytest.skip(f"{directory} is absent")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    messages = [
        {"role": "user", "content": "Who are you? Tell me in two short sentences."},
        {"role": "assistant", "content": "I am a helpful assistant. Ask me anything, café included."},
    ]
    tokenized = tokenize_conversation(tokenizer, messages, probe_template(tokenizer))
    document = Document(0, tokenized.input_ids, shifted_labels(tokenized.input_ids, tokenized.assistant_mask))
    pieces = trained_pieces(tokenizer, document)
    assert "".join(text for text, _ in pieces) == tokenizer.decode(
        tokenized.input_ids, clean_up_tokenization_spaces=False
    )
    trained = "".join(text for text, is_trained in pieces if is_trained)
    assert "I am a helpful assistant. Ask me anything, café included." in trained
    assert "Who are you?" not in trained
