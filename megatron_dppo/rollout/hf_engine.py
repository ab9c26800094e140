"""The CPU rollout engine: a transformers causal LM (float32 or bfloat16) sampled with ``generate``.

Sampling. Each prompt is repeated n times (its samples are consecutive), rows are left-padded into batches of at
most ``max_batch_size`` and sampled with HF ``generate``: ancestral sampling from softmax(warp(logits)), where
warp applies, in order, temperature (logits / T), top-k and top-p (HF's TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper). No other logits processor runs: the model's own generation defaults (e.g. a repetition penalty
in a Hub ``generation_config.json``) are replaced by a neutral config, so the samples follow exactly the
distribution the log-probs describe.

Log-probs (see ``rollout/base.py``). A recorder placed after the warpers stores log_softmax(warped logits) for the
token sampled at each step: the log-prob under the distribution the token was drawn from (temperature, then top-k
and top-p with the removed tokens at -inf, renormalized). Only one [batch, vocab] step is kept at a time, never the
whole [steps, batch, vocab] score history.

Shared prompt prefill. The n samples of a prompt are n rows with the same prompt; computing that prompt's
attention keys and values n times is most of the cost of short completions on a CPU (47 prompt tokens against 32
new ones: the prefill is ~60% of the generation FLOPs at n = 8). So each distinct prompt of a ``generate`` call's
batch is run once through the model (all but its last token), its cache rows are repeated for its samples
(``DynamicCache.batch_select_indices``), and ``generate`` continues from that cache: the samples, their
log-probs and the random draws are those of the unshared computation (the logits differ by fp32 rounding, ~1e-5,
from the different batch shapes). ``share_prompt_prefill=False`` turns it off.

Reproducibility: with ``SamplingParams.seed`` set, a generate() call draws from a private RNG stream seeded with
it (the global torch RNG is saved and restored), so the same call on the same engine state gives the same samples.

Weights: ``load_weights`` copies HF-named tensors into the model (cast to its dtype: a float32 trainer's weights
pushed into a bfloat16 engine are rounded to nearest, ``Tensor.to``), strictly: an unknown name or a wrong shape
raises ValueError, and by default every parameter must be covered by the stream.

Dtype: the model computes in its parameters' dtype (``from_pretrained(dtype=...)``, ``rollout.dtype``); the
behaviour log-probs are always a float32 log_softmax of the (warped) logits, whatever dtype the logits come in.

Memory (``release_weights_on_sleep``, a colocated CPU engine): ``sleep`` frees the weights and ``needs_weights``
is True until a complete push fills them again (``rollout/hf_memory.py``); generation after the push is the same
as with weights kept.

Speculative decoding (``speculative=PromptLookupDecoding(...)``, ``rollout/speculative.py``): prompt-lookup drafts
verified by the model in one batched forward per round, exact (same distribution and log-probs as without it).

LoRA (``lora=adapter_config``, ``rollout/lora.py``): the model computes ``W x + scaling * B (A x)`` on its adapted
projections. A push then carries the base once (the first) and afterwards only the adapter tensors (PEFT names),
which replace the adapters as a whole; adapters before any base weights are refused (``needs_base``).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron_dppo.rollout import hf_memory
from megatron_dppo.rollout.base import (
    Completion,
    CompletionGroup,
    SamplingParams,
    WeightStream,
    validate_prompts,
)
from megatron_dppo.rollout.lora import HFAdapters, refuse_adapters, split_adapters
from megatron_dppo.rollout.speculative import PromptLookupDecoding

logger = logging.getLogger("megatron_dppo.rollout")


class _StepLogprobRecorder:
    """A logits processor that records log p(y_t) of each sampled token under the scores it sees.

    Called at step t with the sequence so far (whose last token is y_{t-1}) and the step-t scores; it looks up the
    previous step's distribution at y_{t-1}, then keeps the step-t distribution for the next call."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = logp
        return scores

    def finish(self, generated: torch.LongTensor) -> torch.Tensor:
        """[rows, gen_len] log-probs of the generated tokens."""
        gen_len = generated.shape[1]
        steps = list(self.steps[:gen_len])
        if len(steps) < gen_len:  # the final token was sampled after the last call
            steps.append(self.last.gather(1, generated[:, gen_len - 1 : gen_len]).squeeze(1))
        return torch.stack(steps, dim=1)


class _Interrupt:
    """A stopping criterion that stops every row once ``ask()`` returns True (``generate(interrupt=...)``)."""

    def __init__(self, ask: Callable[[], bool]):
        self.ask, self.fired = ask, False

    def check(self) -> bool:
        """Ask (until the first True) and say whether it has fired."""
        self.fired = self.fired or bool(self.ask())
        return self.fired

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.check(), dtype=torch.bool, device=input_ids.device)


def default_device() -> torch.device:
    """The current CUDA device (set per rank from LOCAL_RANK by the launcher) when CUDA is available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class HFRolloutEngine:
    """A RolloutEngine over a transformers causal LM; see the module docstring.

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head (it is put in eval mode).
        eos_token_ids: token ids that end a completion; default: the model config's / generation config's EOS.
        pad_token_id: id used for left padding (masked, never attended); default: config pad id, else first EOS.
        max_batch_size: rows (prompt x sample) per ``generate`` call.
        lora: the adapter_config.json dict of a LoRA run (``convert.peft.peft_config``): the model gets unmerged
            adapters (``rollout.lora.HFAdapters``), filled by the adapter tensors of ``load_weights``.
        share_prompt_prefill: run each distinct prompt of a batch through the model once for all its samples
            (module docstring).
        release_weights_on_sleep: on the CPU, ``sleep`` frees the model's weights (module docstring, "Memory");
            the next ``wake_up(["weights"])`` allocates them and a complete ``load_weights`` fills them.
        speculative: a ``PromptLookupDecoding`` to decode with (exact speculative decoding), or None;
            with ``interrupt`` it is asked after every verification round instead of every token.
    """

    def __init__(self, model, *, eos_token_ids: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 max_batch_size: int = 64, lora: dict | None = None, share_prompt_prefill: bool = True,
                 release_weights_on_sleep: bool = False, speculative: PromptLookupDecoding | None = None):
        from transformers import GenerationConfig

        self.model = model.eval()
        config = model.config
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(getattr(config, "eos_token_id", None)) or _as_id_list(
                getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        self.eos_token_ids = _as_id_list(eos_token_ids)
        if not self.eos_token_ids:
            logger.warning("HFRolloutEngine: the model has no EOS token; completions stop only at stop_token_ids "
                           "or max_new_tokens")
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = int(max_batch_size)
        self.share_prompt_prefill = bool(share_prompt_prefill)
        self.speculative = speculative
        # Neutral generation defaults: nothing from a Hub generation_config.json may reshape the distribution.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_token_ids or None,
                                                        pad_token_id=self.pad_token_id)
        self._device = next(model.parameters()).device
        self._asleep = False
        self._released = False  # the weights were freed by sleep() and not filled by a complete push since
        self.adapters = HFAdapters(self.model, lora) if lora is not None else None
        # False: the model holds the weights to serve; from_pretrained(load_weights=False): True until a complete push
        self.needs_base = False
        if release_weights_on_sleep and lora is not None:
            raise ValueError("release_weights_on_sleep with LoRA: a LoRA run's pushes carry the adapters only, the "
                             "base must stay; build the engine with release_weights_on_sleep=False")
        self.release_weights_on_sleep = bool(release_weights_on_sleep)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, load_weights: bool = False, dtype: torch.dtype = torch.float32,
                        device: str | torch.device | None = None, **kwargs) -> HFRolloutEngine:
        """An engine for the HF model directory ``path`` (config.json; weights optional), on ``device`` (None = this
        process's current CUDA device when there is one, else the CPU).

        ``load_weights=False`` builds the architecture with random weights (the trainer pushes its own weights with
        ``load_weights`` before the first rollout); True also reads the checkpoint in ``path``."""
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        engine = cls(model.to(default_device() if device is None else device), **kwargs)
        engine.needs_base = not load_weights
        return engine

    # ------------------------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 interrupt: Callable[[], bool] | None = None) -> list[CompletionGroup]:
        """n completions per prompt with token ids, the log-probs of the sampled distribution and finish reasons.
        ``interrupt`` (partial rollouts, ``rollout/partial.py``): asked after every sampled token; once it returns
        True the rows still running stop there, finish_reason "interrupted", with the tokens sampled so far."""
        validate_prompts(prompt_token_ids, n)
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.generate() called while asleep; call wake_up() first")
        if self._released:
            raise RuntimeError("HFRolloutEngine.generate(): the weights were freed by sleep(); push them first "
                               "(load_weights)")
        rows = [(p, list(ids)) for p, ids in enumerate(prompt_token_ids) for _ in range(n)]
        groups = [CompletionGroup(list(ids)) for ids in prompt_token_ids]
        rng_guard = (torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else [])
                     if sampling.seed is not None else contextlib.nullcontext())
        with rng_guard:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                for (p, _), completion in zip(chunk, self._generate_rows([ids for _, ids in chunk], sampling,
                                                                         interrupt)):
                    groups[p].completions.append(completion)
        return groups

    @torch.no_grad()
    def _generate_rows(self, rows: list[list[int]], sampling: SamplingParams,
                       interrupt: Callable[[], bool] | None = None) -> list[Completion]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1

        stops = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        sample_recorder = _StepLogprobRecorder()
        processors = []
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=sampling.top_p))
        processors.append(sample_recorder)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, num_return_sequences=1,
            eos_token_id=stops or None, pad_token_id=self.pad_token_id, return_dict_in_generate=True,
            output_scores=False, output_logits=False, use_cache=True,
        )
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        prefill = self._shared_prefill(rows, input_ids, attention_mask) if self.share_prompt_prefill else {}
        stopper = _Interrupt(interrupt) if interrupt is not None else None
        lengths = None  # each row's generated tokens when rows are padded to unequal lengths (speculation)
        if self.speculative is not None:
            generated, sample_logprobs, lengths = self.speculative.decode(
                self.model, rows, input_ids, attention_mask, prefill.get("past_key_values"), sampling, stops,
                self.pad_token_id, interrupt=stopper.check if stopper else None)
        else:
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                      logits_processor=LogitsProcessorList(processors),
                                      stopping_criteria=StoppingCriteriaList([stopper] if stopper else []), **prefill)
            generated = out.sequences[:, width:]
            sample_logprobs = sample_recorder.finish(generated).cpu()
            generated = generated.cpu()

        stop_set = set(stops)
        completions = []
        for i in range(len(rows)):
            tokens = generated[i].tolist() if lengths is None else generated[i, :lengths[i]].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop_set), None)
            finish = "stop" if end is not None else "length"
            if end is None and stopper is not None and stopper.fired and len(tokens) < sampling.max_new_tokens:
                finish = "interrupted"
            end = end if end is not None else len(tokens)
            completions.append(Completion(
                token_ids=tokens[:end],
                logprobs=sample_logprobs[i, :end].tolist(),
                finish_reason=finish,
            ))
        return completions

    def _shared_prefill(self, rows: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """``{"past_key_values": cache}`` of every row's prompt but its last token, each distinct prompt computed
        once (module docstring); {} when no prompt repeats or the prompts are a single token wide."""
        from transformers import DynamicCache

        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(r), i) for i, r in enumerate(rows)]
        unique = sorted(set(owner))
        if len(unique) == len(rows) or input_ids.shape[1] < 2:
            return {}
        ids, mask = input_ids[unique, :-1], attention_mask[unique, :-1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count the real tokens only
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        slot = {row: k for k, row in enumerate(unique)}
        cache.batch_select_indices(torch.tensor([slot[o] for o in owner], device=input_ids.device))
        return {"past_key_values": cache}

    # ------------------------------------------------------------------------------------------------------------
    def load_weights(self, weights: WeightStream, *, require_all: bool = True) -> int:
        """Copy (hf_name, tensor) pairs into the model; returns how many tensors were copied.

        Names are checkpoint names (``hf_layout``: per-expert tensors go into transformers 5's fused expert
        parameters). Raises ValueError on an unknown name or a shape mismatch, and (``require_all``) when some
        parameter got no tensor or only part of one (a fused expert parameter must receive every expert). A tied
        output layer is covered by its embedding. On error the model may be partly updated.

        With LoRA the stream's adapter tensors (PEFT names, after the base ones) replace the adapters; a stream of
        adapters only leaves the base as it is (``require_all`` then concerns the adapters)."""
        if self.adapters is None:
            return self._load_base(refuse_adapters(weights), require_all)
        adapters: dict[str, torch.Tensor] = {}
        count = self._load_base(split_adapters(weights, adapters), require_all)
        if self.needs_base:
            raise ValueError("LoRA adapters pushed before the base weights: the first push of a LoRA run carries the "
                             "base model")
        return count + self.adapters.load(adapters)

    def _load_base(self, weights: WeightStream, require_all: bool) -> int:
        from megatron_dppo.rollout.hf_layout import ParameterLayout

        layout = ParameterLayout(self.model)
        filled: dict[int, dict[str, int]] = {}  # parameter id -> {checkpoint name: elements written}
        count = 0
        with torch.no_grad():
            for name, tensor in weights:
                found = layout.target(name)
                if found is None:
                    raise ValueError(f"unknown weight {name!r} for {type(self.model).__name__} "
                                     f"(its names look like: {', '.join(layout.example_names())}, ...)")
                target, param = found
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} but the model expects "
                                     f"{tuple(target.shape)}")
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                filled.setdefault(id(param), {})[name] = target.numel()
                count += 1
        if count == 0 and self.adapters is not None:  # a LoRA push of the adapters only: the base stays
            return 0
        if require_all:
            missing = [n for n, p in self.model.named_parameters()
                       if sum(filled.get(id(p), {}).values()) < p.numel()]
            if missing:
                raise ValueError(f"the weight stream did not cover {len(missing)} parameters, e.g. {missing[:3]}")
            self.needs_base = False
            self._released = False
        return count

    @property
    def needs_weights(self) -> bool:
        """True while the weights were freed by ``sleep`` (``release_weights_on_sleep``) and no complete push has
        filled them since: ``MemoryHandover.before_generation`` then pushes."""
        return self._released

    def sleep(self) -> None:
        """On CUDA: move the model to CPU and free the cache. On CPU: free the weights with
        ``release_weights_on_sleep``, else nothing (the state is still tracked so that misuse, e.g. generating
        while asleep, fails the same way on both devices)."""
        if self._device.type == "cuda" and not self._asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        elif self._device.type == "cpu" and self.release_weights_on_sleep and not self._released:
            hf_memory.release(self.model)
            self._released = True
        self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo sleep(); ``tags`` exists for protocol parity with vLLM (weights and KV cache wake together here).
        Freed weights come back allocated but empty: ``needs_weights`` stays True until a complete push."""
        if self._device.type == "cuda" and self._asleep:
            self.model.to(self._device)
        if hf_memory.is_released(self.model):
            hf_memory.allocate(self.model)
        self._asleep = False
