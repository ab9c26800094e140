"""The ``rollout`` section: the rollout engine (HF or vLLM), its sampling, placement, dtype, memory and partial
rollouts. Every option is documented here, once, in its field's ``help`` (``megatron-dppo train --help-config``);
its ``speculative`` subsection is ``config/speculative.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_dppo.config.fields import _check, opt
from megatron_dppo.config.speculative import SpeculativeConfig


@dataclass
class RolloutConfig:
    """Generation of the G completions per prompt."""

    engine: Literal["hf", "vllm"] = opt("hf", "Rollout engine: hf (transformers generate; CPU default) or vllm "
                                              "(GPU, colocated with training).")
    max_new_tokens: int = opt(256, "Maximum completion length L_max in tokens.")
    temperature: float = opt(1.0, "Sampling temperature T (> 0). The loss trains the policy it samples: every "
                                  "log-prob of the update is of softmax(logits / T), as in verl and TRL; the warm "
                                  "start stays at T = 1 (docs/algorithms.md, \"Temperature and truncated sampling\").")
    top_p: float = opt(1.0, "Nucleus sampling mass in (0, 1]. The trainer's log-probs stay untruncated; the rollout "
                            "correction and rollout/* metrics then include the truncation gap -log Z_K.")
    top_k: int = opt(-1, "Top-k sampling; -1 = off (truncation: as rollout.top_p).")
    batch_size: int = opt(64, "HF engine: sequences generated per forward batch.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Parameter/compute dtype of the rollout engine's model (HF engine and vLLM); auto = model.dtype. "
                "A rollout in a narrower dtype than the trainer (e.g. bfloat16 from a float32 trainer, as GPU runs "
                "do) samples from slightly different numerics: every weight push casts the trainer's weights to "
                "it, and the rollout/trainer mismatch shows in rollout/kl_k1 and is corrected by "
                "loss.rollout_correction (docs/algorithms.md, \"Rollout correction\"; docs/benchmarks.md, bf16 "
                "rollouts). On CPU bfloat16 samples faster where the CPU has AVX512-BF16 / AMX.")
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig,
                                           metadata={"help": "Exact speculative decoding (its options)."})
    gpu_memory_utilization: float = opt(0.5, "vLLM: the most of the GPU's memory (a fraction of its total) vLLM "
                                             "may take for weights + KV cache. When less is free where its engine "
                                             "is built (colocated: after the trainer), vLLM gets the free memory "
                                             "less 1 GiB (logged); start-up is refused, naming this option, when "
                                             "that cannot hold its weights and one full-length sequence.")
    enforce_eager: bool = opt(False, "vLLM: disable CUDA graphs.")
    sleep_between_steps: bool = opt(True, "Release rollout memory while training (sleep/wake): vLLM on GPU sleeps "
                                          "at rollout.sleep_level; the HF engine on GPU moves to host memory; the "
                                          "colocated HF engine on CPU frees its weights (a LoRA run's: kept), which "
                                          "the next push allocates and fills again (the samples are the same).")
    weight_bucket_mb: int = opt(256, "Weight push: bucket size (MiB) of the streaming Megatron->HF export.")
    offload_train_state: bool = opt(False, "vLLM on GPU: move the Megatron parameters, gradients, fp32 master "
                                           "weights and Adam state to CPU while vLLM generates (after the weight "
                                           "push, before the KV cache wakes), and back before training.")
    sleep_level: int = opt(2, "vLLM sleep level: 2 discards the rollout weights while asleep (they are pushed "
                              "again before every generation); 1 keeps a CPU copy.")
    placement: Literal["colocated", "separate"] = opt(
        "colocated", "Where generation runs. colocated: every training process also holds a rollout engine and "
        "generates, then trains, then pushes weights in place (the synchronous loop). separate: the last "
        "rollout.workers processes of the job are rollout workers (an engine each, no Megatron); the other "
        "processes train (Megatron only); weights go trainer -> workers over a process group, stamped with a "
        "version, and batches come back, so generation overlaps training up to train.max_staleness "
        "(docs/async.md). The workers also run DAPO's refill rounds (dynamic_sampling.*) and the evaluations "
        "(eval.every: of exactly the due weight version; the trainer waits for each). With rollout.engine=vllm "
        "the workers form rollout.workers / rollout.tp vLLM engines of rollout.tp ranks each and receive the "
        "weights inside vLLM, in a worker extension (rollout/vllm_weight_sync.py).")
    workers: int = opt(1, "rollout.placement=separate: how many of the job's processes are rollout workers "
                          "(the last ones); they shard each batch's generation (vLLM: over the rollout.workers / "
                          "rollout.tp engines) and scoring.")
    tp: int = opt(1, "rollout.placement=separate with rollout.engine=vllm: tensor-parallel size of each vLLM "
                     "engine; the rollout.workers ranks form rollout.workers / rollout.tp independent engines (data "
                     "parallel), each generating its own shard of the batch. rollout.tp must divide rollout.workers "
                     "and the attention heads. Colocated vLLM uses parallel.tp (the trainer's); the HF engine has "
                     "no tensor parallelism (each worker is an engine): both need rollout.tp=1.")
    max_interruptions: int = opt(0, "rollout.placement=separate, partial rollouts: a worker that receives a new "
                                    "weight version while it generates a batch stops the samples still running at a "
                                    "token boundary, loads the version and continues them under it (HF: re-prefill "
                                    "of prompt + partial completion; vLLM: between chunks of "
                                    "rollout.interrupt_chunk_tokens); every token carries the version and the "
                                    "behaviour log-prob of the policy that sampled it, and the decoupled loss "
                                    "corrects each token by its own (docs/async.md, \"Partial rollouts\"). At most "
                                    "this many versions are taken mid-batch, so a sample runs under at most this "
                                    "many + 1 versions; 0 = off (a batch is generated by one version). Needs "
                                    "train.max_staleness >= 1 (with 0 no version arrives mid-batch) and "
                                    "train.staleness_mode=newest (fixed mode's versions must not depend on timing); "
                                    "not with an env section, algo.screen_k or dynamic_sampling.")
    interrupt_chunk_tokens: int = opt(32, "rollout.max_interruptions >= 1 with rollout.engine=vllm, or "
                                          "rollout.overprovision > 0 (both engines): tokens per generation chunk; a "
                                          "version that arrived is taken between chunks, and over-provisioning "
                                          "checks between chunks whether enough groups are complete.")
    overprovision: float = opt(0.0, "rollout.placement=separate, over-provisioning with abort (APRIL): the worker "
                                    "generates for ceil(B (1 + this)) drawn prompts, ships the B that complete "
                                    "first and keeps the others, partial completions included, for the next step, "
                                    "where they continue under the newer weights. No drawn prompt is dropped (each "
                                    "trains once, weighted by its own 1/pi_q), and a group whose oldest token would "
                                    "leave the train.max_staleness bound finishes in this step (docs/async.md, "
                                    "\"Over-provisioning\"). In [0, 1]; 0 = off. On the HF engine use small "
                                    "rollout.interrupt_chunk_tokens (8 made 1.8x the tokens per worker CPU second "
                                    "of 32 on a long-tail task: docs/benchmarks.md section 21). Needs "
                                    "train.max_staleness >= 2, train.staleness_mode=newest and one rollout worker; "
                                    "not with an env section, algo.screen_k, dynamic_sampling or "
                                    "algo.pruner=adaptive.")
    mask_offpolicy: bool = opt(False, "rollout.max_interruptions >= 1 or rollout.overprovision > 0: train only the "
                                      "tokens of each sample's last version (the segment after its last "
                                      "interruption or carry); the older segments get loss mask 0 and leave the "
                                      "sequence's trained-token count, as an episode's observation tokens do "
                                      "(slime's --mask-offpolicy-in-partial-rollout). Off: every token is trained, "
                                      "corrected by its own behaviour log-prob (loss.rollout_correction).")
    worker_timeout_s: float = opt(600.0, "rollout.placement=separate: every trainer rank fails, naming the worker, "
                                         "when no batch (or awaited evaluation) arrives for this long, or a worker "
                                         "takes no weight bucket within it (hung); a dead worker is reported at once.")

    def validate(self) -> None:
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", self.max_new_tokens, ">= 1")
        _check(self.temperature > 0, "rollout.temperature", self.temperature, "> 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", self.top_k, "-1 or >= 1")
        _check(self.batch_size >= 1, "rollout.batch_size", self.batch_size, ">= 1")
        self.speculative.validate()
        _check(self.engine == "vllm" or self.speculative.method in ("none", "ngram"), "rollout.speculative.method",
               self.speculative.method, "none or ngram with rollout.engine=hf (the HF engine drafts by prompt lookup; "
               "suffix, mtp and eagle are vLLM's)")
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
               self.gpu_memory_utilization, "in (0, 1]")
        _check(self.weight_bucket_mb >= 1, "rollout.weight_bucket_mb", self.weight_bucket_mb, ">= 1")
        _check(self.sleep_level in (1, 2), "rollout.sleep_level", self.sleep_level, "1 or 2")
        _check(self.workers >= 1, "rollout.workers", self.workers, ">= 1")
        _check(self.tp >= 1, "rollout.tp", self.tp, ">= 1")
        _check(self.tp == 1 or (self.placement == "separate" and self.engine == "vllm"), "rollout.tp", self.tp,
               f"1 with rollout.placement={self.placement} and rollout.engine={self.engine} (only separate vLLM "
               "rollout workers take their own tensor-parallel size; colocated vLLM uses parallel.tp)")
        _check(self.workers % self.tp == 0, "rollout.tp", self.tp,
               f"a divisor of rollout.workers={self.workers} (the workers form rollout.workers / rollout.tp vLLM "
               f"engines): one of {[d for d in range(1, self.workers + 1) if self.workers % d == 0]}")
        _check(self.worker_timeout_s > 0, "rollout.worker_timeout_s", self.worker_timeout_s, "> 0")
        _check(self.max_interruptions >= 0, "rollout.max_interruptions", self.max_interruptions, ">= 0")
        _check(self.interrupt_chunk_tokens >= 1, "rollout.interrupt_chunk_tokens", self.interrupt_chunk_tokens,
               ">= 1")
        _check(0 <= self.overprovision <= 1, "rollout.overprovision", self.overprovision, "in [0, 1]")
        _check(self.overprovision == 0 or self.placement == "separate", "rollout.overprovision",
               self.overprovision, "0 with rollout.placement=colocated (the carried groups train at a later step, "
               "with the staleness of separate placement)")
        _check(self.max_interruptions == 0 or self.placement == "separate", "rollout.max_interruptions",
               self.max_interruptions, "0 with rollout.placement=colocated (partial rollouts take weight versions "
               "that arrive at a rollout worker mid-batch)")
