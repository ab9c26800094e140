"""Prompt data: dataset presets on the real files, malformed input messages, templates, the resumable sampler, the
arithmetic task and its SentencePiece tokenizer."""
import json

import pytest
from _shared_data import shared_math_file

from megatron_dppo.data import (
    ArithmeticTask,
    DatasetError,
    DatasetFileNotFoundError,
    FieldSpec,
    PromptFormatter,
    PromptRecord,
    PromptSampler,
    check_prompt_fits,
    encode_prompts,
    evaluate,
    load_prompt_dataset,
    load_tokenizer,
    read_prompt_records,
    train_sentencepiece_tokenizer,
)
from megatron_dppo.rewards import arithmetic_reward

_data = shared_math_file


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# datasets


@pytest.mark.parametrize("name, count, first_gold", [
    ("gsm8k_train.jsonl", 7473, "72"),
    ("gsm8k_test.jsonl", 1319, "18"),
    ("math500_test.jsonl", 500, r"\left( 3, \frac{\pi}{2} \right)"),
    ("qwen25math/aime24.jsonl", 30, "204"),
    ("qwen25math/amc23.jsonl", 40, "27"),
    ("qwen25math/minerva_math.jsonl", 272, "1.6"),
    ("qwen25math/olympiadbench.jsonl", 675, "2"),
    ("qwen25math/svamp.jsonl", 1000, "145"),
    ("qwen25math/asdiv.jsonl", 2215, "9"),
    ("qwen25math/gsm8k.jsonl", 1319, "18"),
])
def test_presets_load_every_shared_file(name, count, first_gold):
    dataset = load_prompt_dataset(_data(name))
    assert len(dataset) == count
    assert dataset[0].gold == first_gold
    assert all(r.prompt.strip() and r.gold for r in dataset)
    assert len(set(dataset.ids)) == count


def test_template_prompt_and_units():
    svamp = load_prompt_dataset(_data("qwen25math/svamp.jsonl"))
    row = svamp[0].raw
    assert svamp[0].prompt == f"{row['Body']} {row['Question']}"
    asdiv = load_prompt_dataset(_data("qwen25math/asdiv.jsonl"))
    assert [r.gold for r in asdiv[:2]] == ["9", "15"]
    assert "Mrs. Doyle's class" in {r.gold for r in asdiv}  # text answers stay text


def test_custom_fields_and_limit(tmp_path):
    path = _write(tmp_path / "custom.jsonl", [json.dumps({"q": f"What is {i}+1?", "a": i + 1, "uid": f"u{i}"})
                                              for i in range(5)])
    records = read_prompt_records(path, FieldSpec(prompt="q", answer="a", id="uid"), limit=3)
    assert [(r.id, r.prompt, r.gold) for r in records] == [
        ("custom:u0", "What is 0+1?", "1"), ("custom:u1", "What is 1+1?", "2"), ("custom:u2", "What is 2+1?", "3")]


@pytest.mark.parametrize("lines, fields, message", [
    (['{"question": "a", "answer": "#### 1"}', '{"question": "b", "answer": "#### 2"', '{}'], "gsm8k",
     r":2: invalid JSON"),
    (['{"question": "a", "answer": "#### 1"}', '{"problem": "b", "answer": "#### 2"}'], "gsm8k",
     r":2: missing field 'question' \(the row has: answer, problem\)"),
    (['{"question": "a", "answer": "#### 1"}', '', '{"question": "b", "answer": "2"}'], "gsm8k",
     r":3: field 'answer' has no '#### <answer>' line"),
    (['{"question": 5, "answer": "1"}'], None, r":1: field 'question' must be a string"),
    (['{"question": "  ", "answer": "1"}'], None, r":1: field 'question' is an empty prompt"),
    (['{"question": "a", "answer": null}'], None, r":1: field 'answer' is null"),
    (['["question", "answer"]'], None, r":1: expected a JSON object"),
    (['{"idx": 0, "problem": "a", "solution": "no box"}'], "minerva_math", r":1: field 'solution' has no \\boxed"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, lines, fields, message):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=str(path).replace(".", r"\.") + message):
        read_prompt_records(path, fields)


def test_missing_empty_and_unsupported_files(tmp_path):
    with pytest.raises(DatasetFileNotFoundError, match="dataset file not found: .*nope.jsonl") as info:
        load_prompt_dataset(tmp_path / "nope.jsonl")
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(DatasetError, match="empty.jsonl: the dataset is empty"):
        load_prompt_dataset(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(DatasetError, match="unsupported dataset format '.csv'"):
        load_prompt_dataset(_write(tmp_path / "data.csv", ["a,b"]))
    with pytest.raises(DatasetError, match="unknown dataset preset 'gsm9k'"):
        load_prompt_dataset(_write(tmp_path / "x.jsonl", ['{"question": "a", "answer": "1"}']), "gsm9k")
    with pytest.raises(DatasetError, match="duplicate id 'x:1'"):
        load_prompt_dataset([tmp_path / "x.jsonl", tmp_path / "x.jsonl"])


def test_parquet_reads_or_explains_pyarrow(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path = tmp_path / "data.parquet"
        path.write_bytes(b"PAR1")
        with pytest.raises(DatasetError, match="needs pyarrow, which is not installed"):
            read_prompt_records(path)
        return
    path = tmp_path / "gsm8k_mini.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["x\n#### 3", "#### 1,000"]}), path)
    assert [(r.prompt, r.gold) for r in read_prompt_records(path)] == [("q1", "3"), ("q2", "1000")]


# ---------------------------------------------------------------------------------------------------------------
# templates and lengths


class _NoTemplateTokenizer:
    chat_template = None
    name_or_path = "tiny-base"


def test_tokenizer_without_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="'tiny-base' has no chat template; set the prompt template to 'plain'"):
        PromptFormatter(_NoTemplateTokenizer(), template="chat")
    formatter = PromptFormatter(_NoTemplateTokenizer(), template="plain", instruction="Think.")
    assert formatter.render("1+1?") == "Question: 1+1?\n\nThink.\nAnswer:"
    assert PromptFormatter(_NoTemplateTokenizer(), template="Q: {prompt} A:").render("x") == "Q: x A:"
    with pytest.raises(ValueError, match="must be one of"):
        PromptFormatter(_NoTemplateTokenizer(), template="fancy")


def test_prompt_longer_than_context_names_both_lengths(arithmetic_tokenizer_dir):
    check_prompt_fits(100, 28, 128)
    formatter = PromptFormatter(load_tokenizer(arithmetic_tokenizer_dir), template="raw")
    records = ArithmeticTask.from_difficulty(4).records(3)
    assert [len(ids) for ids in encode_prompts(formatter, records, max_new_tokens=4, context_length=64)] == [
        len(r.prompt) for r in records]  # one token per character of "12+7*3="
    with pytest.raises(ValueError, match=r"prompt 'arith-train-0' is \d+ tokens long but the context length is 8"):
        encode_prompts(formatter, records, max_new_tokens=4, context_length=8)
    with pytest.raises(ValueError, match=r"prompt 'gsm8k_train:7' is 101 tokens long but the context length is 128 "
                                         r"tokens and 28 are reserved.*at most 100 tokens"):
        check_prompt_fits(101, 28, 128, "gsm8k_train:7")


# ---------------------------------------------------------------------------------------------------------------
# sampler


def test_sampler_resume_equals_uninterrupted():
    sizes = [3, 7, 1, 10, 4, 6, 9, 2, 5]  # crosses several epochs of 11 prompts
    straight = PromptSampler(11, seed=7)
    expected = [straight.take(k) for k in sizes]

    first = PromptSampler(11, seed=7)
    got = [first.take(k) for k in sizes[:4]]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(11, seed=7)
    resumed.load_state_dict(state)
    got += [resumed.take(k) for k in sizes[4:]]
    assert got == expected


def test_sampler_epochs_are_seeded_permutations():
    sampler = PromptSampler(50, seed=3)
    epochs = [sampler.take(50) for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert PromptSampler(50, seed=3).take(50) == epochs[0]
    assert PromptSampler(50, seed=4).take(50) != epochs[0]
    assert PromptSampler(5, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="saved with num_prompts=50 but this sampler has num_prompts=49"):
        PromptSampler(49, seed=3).load_state_dict(sampler.state_dict())


# ---------------------------------------------------------------------------------------------------------------
# arithmetic task


def test_arithmetic_task_is_deterministic_and_correct():
    task = ArithmeticTask(min_terms=2, max_terms=4, max_operand=30, operators="+-*", seed=11)
    records = task.records(300)
    assert records == ArithmeticTask(2, 4, 30, "+-*", seed=11).records(300)
    assert records != ArithmeticTask(2, 4, 30, "+-*", seed=12).records(300)
    for record in records:
        expression = record.raw["expression"]
        assert record.prompt == expression + "="
        assert record.gold == str(eval(expression))  # noqa: S307 - our own digits and + - *
        assert arithmetic_reward(record.gold, record.gold) == 1.0
        terms = expression.replace("-", "+").replace("*", "+").split("+")
        assert 2 <= len(terms) <= 4 and all(0 <= int(t) <= 30 for t in terms)
    assert task.records(5, start=100) == records[100:105]


def test_arithmetic_difficulty_and_disjoint_splits():
    easy = ArithmeticTask.from_difficulty(1, seed=0)
    assert all(set(r.prompt) <= set("0123456789+=") and r.prompt.count("+") == 1 for r in easy.records(100))
    task = ArithmeticTask.from_difficulty(3, seed=0)
    train = {r.raw["expression"] for r in task.records(2000)}
    test = {r.raw["expression"] for r in task.records(200, "test")}
    assert train.isdisjoint(test)
    assert task.corpus(2) == [r.prompt + r.gold for r in task.records(2)]
    assert evaluate("2+3*4-5") == 9
    with pytest.raises(ValueError, match="not an integer"):
        evaluate("__import__('os')")


# ---------------------------------------------------------------------------------------------------------------
# sentencepiece tokenizer


@pytest.fixture(scope="module")
def arithmetic_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_sentencepiece_tokenizer(ArithmeticTask.from_difficulty(3).corpus(2000), out)
    return out


def test_sentencepiece_tokenizer_round_trip_and_matches_sentencepiece(arithmetic_tokenizer_dir):
    import sentencepiece as spm

    tok = load_tokenizer(arithmetic_tokenizer_dir)
    sp = spm.SentencePieceProcessor(model_file=str(arithmetic_tokenizer_dir / "sentencepiece.model"))
    lines = ArithmeticTask.from_difficulty(4, seed=5).corpus(200) + ArithmeticTask.from_difficulty(3).corpus(50, "test")
    for line in lines:
        ids = tok(line, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(line)
        assert tok.decode(ids) == line
    assert tok.convert_ids_to_tokens(tok("9876", add_special_tokens=False)["input_ids"]) == list("9876")
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)


def test_sentencepiece_tokenizer_chat_template(arithmetic_tokenizer_dir):
    tok = load_tokenizer(arithmetic_tokenizer_dir)
    formatter = PromptFormatter(tok, template="chat")
    assert formatter.render("12+7=") == "<|user|>12+7=</s><|assistant|>"
    ids = formatter.encode("12+7=")
    assert tok.convert_ids_to_tokens([ids[0], ids[-2], ids[-1]]) == ["<|user|>", "</s>", "<|assistant|>"]
    assert PromptFormatter(tok, template="raw").encode("12+7=") == tok("12+7=", add_special_tokens=False)["input_ids"]
    with_system = PromptFormatter(tok, template="chat", system_prompt="Be brief", instruction="Answer only.")
    assert with_system.render("12+7=") == "<|system|>Be brief</s><|user|>12+7=\n\nAnswer only.</s><|assistant|>"


def test_sentencepiece_byte_fallback_round_trips_any_text():
    tok = train_sentencepiece_tokenizer(["Question: what is 1+1?\nAnswer: 2"] * 20, byte_fallback=True)
    for text in ["héllo wörld ∑ 12+3\n", "Question: 7*8?\nAnswer: 56"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    with pytest.raises(ValueError, match="vocab_size 40 is too small"):
        train_sentencepiece_tokenizer(["abc"], byte_fallback=True, vocab_size=40)


def test_sentencepiece_tokenizer_drives_hf_generate(arithmetic_tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = load_tokenizer(arithmetic_tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    batch = tok(["1+2=", "12*3="], return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id)
    width = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and width < out.shape[1] <= width + 5
    assert int(out.max()) < len(tok)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    assert all(set(t) <= set("0123456789+-*=") for t in texts)  # only corpus characters, no <unk> text


def _byte_level_bpe_tokenizer():
    """A GPT-2/Qwen-style byte-level BPE tokenizer (trained here in milliseconds, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["What is 12 plus 30? The answer is 42.", "Café, naïve, 東京, ﬁnance", "-" * 64,
              "    indented"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["sentencepiece", "sentencepiece_byte_fallback", "byte_level_bpe"])
def test_prefix_bound_is_a_lower_bound_and_refuses_an_enormous_prompt_without_tokenizing(
        kind, arithmetic_tokenizer_dir):
    import time

    tokenizer = {"sentencepiece": lambda: load_tokenizer(arithmetic_tokenizer_dir),
                 "sentencepiece_byte_fallback": lambda: train_sentencepiece_tokenizer(
                     ["Question: what is 1+1?\nAnswer: 2", "Café ﬁ 東京 -----"] * 20, byte_fallback=True),
                 "byte_level_bpe": _byte_level_bpe_tokenizer}[kind]()
    formatter = PromptFormatter(tokenizer, template="raw")
    texts = ["12+7*3=", "What is 12 plus 30?", "-" * 64 + "?", "Café, naïve, 東京, ﬁnance " * 9, "e\u0301" * 40,
             "    " * 30 + "x", "a" * 500, "1234567890" * 40]
    for text in texts:
        for max_tokens in (1, 2, 4, 8):
            bound = formatter.too_long(text, max_tokens)
            assert bound is None or max_tokens < bound <= len(formatter.encode(text)), (text, max_tokens)
    assert formatter.too_long("12 plus 3 " * 2000, 100) is not None  # a long prompt is settled by its prefix
    huge = "12 plus 3 " * 2_000_000  # 20 MB: tokenizing it took ~35 s and 4 GB
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"prompt 'huge:1' is at least \d+ tokens long but the context length is 4096"):
        encode_prompts(formatter, [PromptRecord("huge:1", huge, "5")], max_new_tokens=256, context_length=4096)
    assert time.perf_counter() - start < 3.0
