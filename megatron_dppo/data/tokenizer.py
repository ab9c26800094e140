"""A tiny SentencePiece tokenizer trained in-process on a task corpus, usable as a transformers tokenizer.

``train_sentencepiece_tokenizer(corpus, out_dir)`` trains a SentencePiece model (unigram by default) in memory,
converts it to a ``tokenizers`` pipeline that segments exactly like the SentencePiece model (transformers'
``SpmConverter.build_tokenizer_from_spm_proto``), wraps it as a ``PreTrainedTokenizerFast`` with
``<pad>``=0, ``<unk>``=1, ``<s>``=2, ``</s>``=3 and a small chat template, and saves it with ``save_pretrained``
(plus the raw ``sentencepiece.model``). ``load_tokenizer(out_dir)`` reads it back with ``AutoTokenizer``, offline.

Training settings chosen for exact, reversible segmentation of small task corpora: identity normalization, no
dummy prefix, whitespace kept as is, digits always split into single-digit pieces (arithmetic sees one token per
digit). Characters absent from the corpus become ``<unk>`` unless ``byte_fallback=True`` (then they become UTF-8
byte pieces and every string round-trips; this needs a vocabulary of at least ~260).

The chat template (``DEFAULT_CHAT_TEMPLATE``) renders ``<|role|>content</s>`` per message and ``<|assistant|>`` as
the generation prompt; the role markers are single user-defined pieces.
"""
from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
SPM_MODEL_FILE = "sentencepiece.model"


def train_sentencepiece_tokenizer(corpus: Iterable[str], out_dir: str | Path | None = None, *,
                                  vocab_size: int | None = None, model_type: str = "unigram",
                                  byte_fallback: bool = False, chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
                                  user_symbols: Iterable[str] = ROLE_TOKENS):
    """Train a SentencePiece model on ``corpus`` (one text per item) and return it as a transformers tokenizer.

    vocab_size: upper bound on the vocabulary; None picks the characters of the corpus + special pieces + 32.
    model_type: "unigram" | "bpe" | "char". Saved to ``out_dir`` when given. See the module docstring.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    if model_type not in ("unigram", "bpe", "char"):
        raise ValueError(f"model_type {model_type!r} is not one of 'unigram', 'bpe', 'char'")
    texts = [str(t) for t in corpus if str(t)]
    if not texts:
        raise ValueError("the tokenizer corpus is empty")
    user_symbols = list(user_symbols)
    required = len(set("".join(texts))) + 4 + len(user_symbols) + (256 if byte_fallback else 0)
    if vocab_size is None:
        vocab_size = required + 32
    elif vocab_size < required:
        raise ValueError(f"vocab_size {vocab_size} is too small for this corpus: it needs at least {required} "
                         f"({len(set(''.join(texts)))} characters + 4 special + {len(user_symbols)} user symbols"
                         f"{' + 256 byte pieces' if byte_fallback else ''})")

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        hard_vocab_limit=False, character_coverage=1.0, byte_fallback=byte_fallback, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, user_defined_symbols=user_symbols,
        max_sentence_length=1 << 16, minloglevel=2, num_threads=1,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if model_type == "unigram":
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, pieces)
    else:  # bpe / char: a BPE vocabulary; merges are rebuilt from the piece scores
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, {p: i for i, (p, _) in enumerate(pieces)})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    if chat_template is not None:
        missing = [t for t in ROLE_TOKENS if t not in user_symbols]
        if chat_template == DEFAULT_CHAT_TEMPLATE and missing:
            raise ValueError(f"the default chat template needs the role tokens {missing} among user_symbols")
        tokenizer.chat_template = chat_template
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out_dir)
        (out_dir / SPM_MODEL_FILE).write_bytes(model.getvalue())
    return tokenizer


def load_tokenizer(path: str | Path):
    """A tokenizer saved by ``train_sentencepiece_tokenizer`` (or any local HF tokenizer directory), offline."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory not found: {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
