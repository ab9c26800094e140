"""A reward model through transformers, on any device: the HF engine of ``rewards.model`` (its protocol there).

Classifier scores are read at the last token of each input by this code, not by the model's own pooling:
transformers' ``*ForSequenceClassification`` pools at the last token that is not ``pad_token_id``, which is the
wrong token when the pad id also ends the input (a tokenizer whose pad is its EOS); the backbone and the score
head are run as the model runs them, and the index is each input's own length. Inputs are right-padded with an
attention mask in micro-batches of ``batch_size``, so a score does not depend on the other inputs of its batch,
their order or the padding (to float rounding of the matmul shapes: <= 1e-5 in fp32, tested).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch


class HFRewardEngine:
    """A sequence classifier (``kind="classifier"``) or causal LM (``kind="judge"``) from an HF folder, offline.
    Its calls involve this process alone, so a call past ``reward.model.timeout_s`` is abandoned (``interruptible``).

    Args:
        path: the HF folder (config.json + safetensors).
        kind: classifier | judge.
        dtype: parameter and compute dtype.
        batch_size: inputs per forward pass.
        device: where it runs (default: the current CUDA device, else the CPU). ``sleep`` moves it to the CPU.
        shard: (index, count) of the groups this process scores (default: every rank its share).
    """

    interruptible = True

    def __init__(self, path: str | Path, kind: str = "classifier", *, dtype: torch.dtype = torch.float32,
                 batch_size: int = 32, device: str | torch.device | None = None,
                 shard: tuple[int, int] | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward.model.path {str(path)!r} is not a Hugging Face model folder (no config.json)")
        if batch_size < 1:
            raise ValueError(f"reward.model.batch_size={batch_size} is invalid: expected >= 1")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if kind == "classifier":
            if getattr(config, "num_labels", 1) != 1:
                raise ValueError(f"reward model {str(path)!r} has num_labels={config.num_labels}; a classifier "
                                 "reward model has exactly one label (its score)")
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype=dtype)
            if not hasattr(self.model, "score"):
                raise ValueError(f"reward model {str(path)!r} ({type(self.model).__name__}) has no 'score' head")
        elif kind == "judge":
            self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        else:
            raise ValueError(f"kind={kind!r} is invalid: expected classifier or judge")
        self.kind, self.batch_size, self.path = kind, batch_size, str(path)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.model.to(self.device).eval()
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self._shard = shard

    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def classify(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N] float32: the score head at the last token of each input."""
        out = [last_token_scores(self.model, inputs[i:i + self.batch_size], self.device).float().cpu()
               for i in range(0, len(inputs), self.batch_size)]
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def next_token_logprobs(self, inputs: Sequence[Sequence[int]], token_ids: Sequence[int]) -> torch.Tensor:
        """[N, K] float32: log p(token_ids[k] | input) of the token after each input (log-softmax in fp32)."""
        out = []
        wanted = torch.tensor(list(token_ids), dtype=torch.long)
        for i in range(0, len(inputs), self.batch_size):
            ids, mask, last = right_padded(inputs[i:i + self.batch_size], self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            rows = torch.arange(ids.shape[0], device=ids.device)
            logp = torch.log_softmax(logits[rows, last].float(), dim=-1)
            out.append(logp[:, wanted.to(logp.device)].cpu())
        return torch.cat(out) if out else torch.zeros(0, len(wanted))

    @torch.no_grad()
    def generate(self, inputs: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seed: int) -> list[list[int]]:
        """A sampled reply to each input (without the prompt; stops at the model's EOS), one at a time with seed
        ``seed + i``, so a reply does not depend on the batch."""
        replies = []
        eos = self.model.generation_config.eos_token_id
        for i, ids in enumerate(inputs):
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed + i)
                prompt = torch.tensor([list(ids)], device=self.device)
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                          temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                          eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None)
            replies.append(out[0, prompt.shape[1]:].tolist())
        return replies

    def shard(self) -> tuple[int, int]:
        if self._shard is not None:
            return self._shard
        from megatron_dppo.distributed import collectives as D

        return D.rank(), D.world_size()

    def wake_up(self) -> None:
        if torch.cuda.is_available() and self.device.type == "cpu" and getattr(self, "_home", None) is not None:
            self.device = self._home
            self.model.to(self.device)

    def sleep(self) -> None:
        """Off the accelerator between scorings (a no-op on the CPU)."""
        if self.device.type == "cuda":
            self._home, self.device = self.device, torch.device("cpu")
            self.model.to(self.device)
            torch.cuda.empty_cache()


def right_padded(inputs: Sequence[Sequence[int]], device: torch.device | str = "cpu"):
    """(ids [b, T] right-padded with 0, attention mask [b, T], index of each input's last token [b])."""
    lengths = torch.tensor([len(x) for x in inputs])
    if not len(inputs) or int(lengths.min()) < 1:
        raise ValueError("a reward model input is empty")
    width = int(lengths.max())
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    for row, x in enumerate(inputs):
        ids[row, :len(x)] = torch.tensor(list(x))
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask.to(device), (lengths - 1).to(device)


def last_token_scores(model: Any, inputs: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N] label-0 scores of a ``*ForSequenceClassification`` at each input's last token: its backbone
    (``base_model``) and ``score`` head as the model runs them, pooled at the index this code knows (module
    docstring)."""
    ids, mask, last = right_padded(inputs, device)
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model.score(hidden[torch.arange(ids.shape[0], device=ids.device), last])[:, 0]


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> Any:
    """The reward model's tokenizer from its folder (offline), of the class its tokenizer_config.json names.

    A generic tokenizer (``tokenizer.json`` alone, e.g. ``megatron-dppo rm train``'s SentencePiece one) is loaded as
    that class: ``AutoTokenizer`` would pick the class of the folder's model_type (Qwen2Tokenizer for a Qwen2
    classifier), which re-tokenizes with Qwen2's own pre-tokenizer and drops the user-defined pieces."""
    import transformers

    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in GENERIC_TOKENIZER_CLASSES and hasattr(transformers, name):
        return getattr(transformers, name).from_pretrained(str(path), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
