"""Record formats become the right conversations; tool calls are trained exactly as rendered."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from chattune.data.documents import IGNORE_INDEX
from chattune.data.ingest.formats import Conversation, DataError, SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import probe_template, tokenize_conversation
from chattune.data.templates.sft_documents import SFTDocuments
from conftest import SHARED_ASSETS

USER, ASSISTANT = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}


def convert(record: dict, **spec) -> Conversation:
    return to_conversation(record, SourceSpec(path="x.jsonl", **spec), "x.jsonl record 0")


def test_each_format_by_hand():
    assert convert({"messages": [USER, ASSISTANT]}) == Conversation([USER, ASSISTANT])
    assert convert(
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}], "system": "Be kind."},
        format="sharegpt",
    ) == Conversation([{"role": "system", "content": "Be kind."}, USER, ASSISTANT])
    assert convert({"prompt": "Hi", "completion": "Hello!"}, format="prompt_completion") == Conversation(
        [USER, ASSISTANT]
    )
    assert convert({"prompt": [USER], "completion": [ASSISTANT]}, format="prompt_completion") == Conversation(
        [USER, ASSISTANT]
    )
    assert convert({"instruction": "Add.", "input": "2 and 3", "output": "5"}, format="alpaca") == Conversation(
        [{"role": "user", "content": "Add.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]
    )
    assert (
        convert({"instruction": "Say hi.", "input": "", "output": "Hi"}, format="alpaca").messages[0]["content"]
        == "Say hi."
    )


def test_renamed_columns_and_roles():
    record = {"chat": [{"speaker": "me", "text": "Hi"}, {"speaker": "bot", "text": "Hello!"}]}
    got = convert(
        record,
        format="sharegpt",
        columns={"conversations": "chat", "role": "speaker", "content": "text"},
        roles={"me": "user", "bot": "assistant"},
    )
    assert got == Conversation([USER, ASSISTANT])
    assert convert(
        {"q": "Hi", "a": "Hello!"}, format="prompt_completion", columns={"prompt": "q", "completion": "a"}
    ).messages == [USER, ASSISTANT]


@pytest.mark.parametrize(
    ("record", "spec", "problem"),
    [
        ({"msgs": [USER, ASSISTANT]}, {}, r"no 'messages' field for the messages format \(fields: \['msgs'\]\)"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, {"format": "sharegpt"}, "turn 0 has role 'robot'"),
        (
            {"conversations": [{"from": "function_call", "value": "{not json"}]},
            {"format": "sharegpt"},
            "not valid JSON",
        ),
        ({"prompt": "Hi"}, {"format": "prompt_completion"}, "no 'completion' field"),
        (
            {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": []}]},
            {},
            "tool_calls must be a non-empty list",
        ),
        ({"messages": [USER, ASSISTANT], "tools": "[oops"}, {}, "tools is not valid JSON"),
    ],
)
def test_bad_records_name_the_record(record, spec, problem):
    with pytest.raises(DataError, match=rf"x\.jsonl record 0: .*{problem}"):
        convert(record, **spec)


def test_bad_source_specs():
    with pytest.raises(DataError, match="unknown format 'csv'"):
        SourceSpec("a.jsonl", format="csv")
    with pytest.raises(DataError, match=r"has no column\(s\) \['chat'\]; its columns are"):
        SourceSpec("a.jsonl", columns={"chat": "c"})
    with pytest.raises(DataError, match="roles` applies to the sharegpt format only"):
        SourceSpec("a.jsonl", roles={"bot": "assistant"})
    with pytest.raises(DataError, match="needs `path`"):
        SourceSpec.from_config({"file": "a.jsonl"})
    assert SourceSpec.from_config("a.jsonl") == SourceSpec("a.jsonl")
    assert SourceSpec.from_config({"path": "a.json", "format": "alpaca"}).format == "alpaca"


def qwen3_expected_turns(messages: list[dict]) -> list[str]:
    """The trained text of each assistant turn, written from Qwen3's template: content, then each tool
    call as <tool_call> JSON, then <|im_end|>; an empty think block opens the final turn when it follows
    the last user message."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        text = message["content"]
        for k, call in enumerate(message.get("tool_calls", [])):
            function = call["function"]
            arguments = function["arguments"]
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            text += "\n" if (k == 0 and message["content"]) or k > 0 else ""
            text += '<tool_call>\n{"name": "' + function["name"] + '", "arguments": ' + arguments + "}\n</tool_call>"
        prefix = "<think>\n\n</think>\n\n" if i == len(messages) - 1 and i > last_user else ""
        turns.append(prefix + text + "<|im_end|>")
    return turns


def test_sharegpt_tool_calls_on_qwen3_train_exactly_the_rendered_calls():
    data, tokenizer_dir = SHARED_ASSETS / "data" / "sharegpt_toolcall_300.json", SHARED_ASSETS / "tokenizers" / "qwen3"
    if not data.exists() or not tokenizer_dir.exists():
        pytest.skip("shared test assets not available")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    markers = probe_template(tokenizer)
    spec = SourceSpec(str(data), format="sharegpt")
    records = json.loads(data.read_text())
    calls_seen = 0
    for index, record in enumerate(records):
        conversation = to_conversation(record, spec, f"record {index}")
        calls_seen += sum(len(m.get("tool_calls", [])) for m in conversation.messages)
        tokenized = tokenize_conversation(tokenizer, conversation.messages, markers, tools=conversation.tools)
        reference = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True)
        assert tokenized.input_ids == reference["input_ids"], index
        mask, ids = tokenized.assistant_mask, tokenized.input_ids
        runs, start = [], None
        for position, flag in enumerate(mask + [False]):
            if flag and start is None:
                start = position
            elif not flag and start is not None:
                runs.append(tokenizer.decode(ids[start:position], clean_up_tokenization_spaces=False))
                start = None
        assert runs == qwen3_expected_turns(conversation.messages), index
        assert (conversation.tools is not None) == ("<tools>" in tokenizer.decode(ids)), index
    assert calls_seen >= 200  # the file is mostly tool-call conversations


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def trained_text(tokenizer, document) -> str:
    return tokenizer.decode([label for label in document.labels.tolist() if label != IGNORE_INDEX])


def test_train_on_modes(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "Sys."},
        USER,
        ASSISTANT,
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Hello again!"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])

    def document(train_on):
        return SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, 512, train_on=train_on).get(0)

    assert trained_text(tokenizer, document("assistant")) == "Hello!<|im_end|>Hello again!<|im_end|>"
    assert trained_text(tokenizer, document("last_assistant")) == "Hello again!<|im_end|>"
    everything = document("all")
    assert (
        everything.labels[:-1].tolist() == everything.input_ids[1:].tolist()
    )  # every next token, the first has no context
    with pytest.raises(ValueError, match="train_on"):
        document("prompts")


def test_parquet_source_matches_jsonl(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [
        {"messages": [USER, ASSISTANT]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    from_jsonl = SFTDocuments(RecordSource([SourceSpec(jsonl)]), tokenizer, 512)
    from_parquet = SFTDocuments(RecordSource([SourceSpec(str(parquet))]), tokenizer, 512)
    assert len(from_parquet) == 2
    for i in range(2):
        assert from_parquet.get(i).input_ids.tolist() == from_jsonl.get(i).input_ids.tolist()
        assert from_parquet.get(i).labels.tolist() == from_jsonl.get(i).labels.tolist()


def test_readme_source_overrides_compose():
    """The manual's `data.train`/`data.eval` example (docs/data.md) parses into the sources it describes."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import PROJECT_ROOT

    overrides = [
        "data.train=[/data/chats.jsonl,{path:/data/tools.json,format:sharegpt,roles:{bot:assistant}}]",
        "data.eval=[{path:/data/held_out.parquet,format:prompt_completion,columns:{prompt:question,completion:answer}}]",
    ]
    page = (PROJECT_ROOT / "docs" / "data.md").read_text()
    assert all(f"'{override}'" in page for override in overrides)
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "configs"), version_base=None):
        cfg = compose("sft/tiny", overrides=overrides)
    specs = [
        SourceSpec.from_config(e)
        for e in OmegaConf.to_container(cfg.data.train) + OmegaConf.to_container(cfg.data.eval)
    ]
    assert specs == [
        SourceSpec("/data/chats.jsonl"),
        SourceSpec("/data/tools.json", format="sharegpt", roles={"bot": "assistant"}),
        SourceSpec(
            "/data/held_out.parquet", format="prompt_completion", columns={"prompt": "question", "completion": "answer"}
        ),
    ]


@pytest.mark.parametrize(
    ("record", "spec", "problem"),
    [
        ({"messages": [{"role": ["user"], "content": "hi"}, ASSISTANT]}, {}, r"message 0 has role \['user'\]"),
        ({"conversations": [{"from": {}, "value": "x"}]}, {"format": "sharegpt"}, "turn 0 has role {}"),
        ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": ["x"]}]}, {}, "a tool call must be"),
        (
            {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
            {},
            "a tool call must be",
        ),
        (
            {"instruction": "Add.", "input": 42, "output": "5"},
            {"format": "alpaca"},
            "'input' must be a string, got int",
        ),
        ({"instruction": ["a"], "output": "5"}, {"format": "alpaca"}, "'instruction' must be a string, got list"),
        (
            {"conversations": [{"from": "human", "value": "x"}], "system": 3},
            {"format": "sharegpt"},
            "'system' must be a string",
        ),
    ],
)
def test_odd_types_are_data_errors(record, spec, problem):
    with pytest.raises(DataError, match=rf"x\.jsonl record 0: .*{problem}"):
        convert(record, **spec)


def test_bad_source_config_types():
    for entry, problem in (
        (5, "a path or a mapping"),
        ({"path": "a", "columns": ["x"]}, "`columns` must map"),
        ({"path": "a", "format": "sharegpt", "roles": {"bot": ["assistant"]}}, "`roles` must map"),
    ):
        with pytest.raises(DataError, match=problem):
            SourceSpec.from_config(entry)


def test_prompt_completion_trains_only_the_completion(tmp_path, tokenizer):
    prompt = [USER, ASSISTANT, {"role": "user", "content": "And?"}]
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": "Bye."}])
    spec = SourceSpec(path, format="prompt_completion")
    document = SFTDocuments(RecordSource([spec]), tokenizer, 512).get(0)
    assert trained_text(tokenizer, document) == "Bye.<|im_end|>"


def test_tools_on_a_template_that_cannot_render_them_are_refused(tmp_path, tokenizer):
    """The demo template has no tool support: training would silently drop the schemas and calls."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    records = [
        {"messages": [USER, ASSISTANT], "tools": [{"name": "f", "parameters": {}}]},
        {"messages": [USER, call, {"role": "tool", "content": "1"}, ASSISTANT]},
    ]
    documents = SFTDocuments(RecordSource([SourceSpec(write_jsonl(tmp_path / "t.jsonl", records))]), tokenizer, 512)
    for index in (0, 1):
        with pytest.raises(
            DataError, match=rf"t\.jsonl record {index + 1} \(line {index + 1}\): .*does not render them"
        ):
            documents.get(index)


def test_undecodable_bytes_name_the_record(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"messages": [USER, ASSISTANT]}).encode() + b"\n" + b'{"messages": "caf\xe9"}\n')
    documents = SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, 512)
    assert documents.get(0).doc_id == 0
    with pytest.raises(DataError, match=r"latin1\.jsonl record 2 \(line 2\): not UTF-8 text \(byte 18 of the line"):
        documents.get(1)


def test_a_record_broken_over_lines_is_placed_where_its_line_ends(tmp_path):
    """A JSONL record broken after a comma used to be reported at column 1 (json placed the error on a line 2 of the
    one line it parsed, its newline included); a .json file cut short, on the blank line after it."""
    whole = json.dumps({"messages": [USER, ASSISTANT]})
    cut = whole.index("}, ") + 2  # the first line stops after the user turn's comma
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{whole}\n{whole[:cut]}\n{whole[cut:].lstrip()}\n")
    _, where, error = RecordSource([SourceSpec(str(path))]).locate(1)
    assert str(error) == (
        f"{path} record 2 (line 2): unparseable JSON at column {cut + 1} (the end of the line: a record of a .jsonl "
        "file is one whole line): Expecting value"
    )
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(f"{whole[:cut]}\r\n".encode())
    assert f"unparseable JSON at column {cut + 1} (the end" in str(RecordSource([SourceSpec(str(crlf))]).locate(0)[2])

    truncated = tmp_path / "truncated.json"
    truncated.write_text(f"[\n{whole},\n{whole[:cut]}\n\n")  # line 3 stops after its comma, two blank lines follow
    with pytest.raises(DataError) as raised:
        RecordSource([SourceSpec(str(truncated))])
    assert str(raised.value).startswith(
        f"{truncated}: unparseable JSON at line 3, column {cut + 1} (the end of the file: it ends before its JSON "
        "does): Expecting value; "
    )
