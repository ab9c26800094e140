"""The sections of the run configuration (one dataclass per section of the YAML file), each option documented
once, in its field's ``help``. The root ``Config``, loading and overrides are in ``megatron_dppo.config``, which
re-exports every section; the data, pruning (algo), rollout, dynamic-sampling and overlong sections have modules of
their own."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_dppo.config.fields import _check, opt

# --------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------
# LoRA target names (megatron.lora.VALID_TARGETS; tests/unit/test_config.py checks that the two agree)
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "q", "k", "v", "gate", "up")


@dataclass
class LoraSection:
    """LoRA: train low-rank adapters on the frozen pretrained model (docs/lora.md); the reference is the base, with
    model.lora.init's adapter where there is one (frozen)."""

    rank: Optional[int] = opt(None, "r of every adapter; null = 16, or the rank of the adapter in model.lora.init.")
    alpha: Optional[float] = opt(None, "The adapter update is alpha / rank * B @ A (alpha / sqrt(rank) with "
                                       "use_rslora); null = 2 * rank, or the alpha of model.lora.init's adapter.")
    dropout: float = opt(0.0, "Dropout on the adapters' input in training forwards (PEFT's lora_dropout); the "
                              "old-policy, reference and rollout forwards never drop.")
    target_modules: Optional[list[str]] = opt(
        None, "Layers that get adapters: qkv (q, k, v: one adapter per HF projection), proj (attention output, "
              "o_proj), fc1 (gate, up), fc2 (down_proj), or single projections q, k, v, gate, up. null = "
              "[qkv, proj, fc1, fc2] ([qkv, proj] on Mixture-of-Experts models, whose experts are not adapted), "
              "or the projections of model.lora.init's adapter.")
    use_rslora: Optional[bool] = opt(None, "Rank-stabilized scaling alpha / sqrt(rank) (PEFT's use_rslora); null "
                                           "= false, or model.lora.init's.")
    seed: int = opt(0, "Seed of the adapters' initialisation (A uniform in +-1/sqrt(in), B = 0: the run starts at "
                       "the base model exactly); the same adapters at every TP/PP layout.")
    init: Optional[str] = opt(None, "A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, "
                                    "e.g. trained with peft, or written by `megatron-dppo convert megatron-to-peft`)"
                                    " to start from instead of a fresh adapter: a warm start. It is also the "
                                    "reference policy's adapter (kept frozen: a KL term measures the distance from "
                                    "it). Its rank, alpha, projections and use_rslora are used; set ones must agree.")

    def validate(self) -> None:
        _check(self.rank is None or self.rank >= 1, "model.lora.rank", self.rank, "null or an integer >= 1")
        _check(self.alpha is None or (math.isfinite(self.alpha) and self.alpha > 0), "model.lora.alpha",
               self.alpha, "null or a finite number > 0")
        _check(0.0 <= self.dropout < 1.0, "model.lora.dropout", self.dropout, "a number in [0, 1)")
        if self.target_modules is not None:
            bad = [t for t in self.target_modules if t not in LORA_TARGETS]
            _check(bool(self.target_modules) and not bad, "model.lora.target_modules", self.target_modules,
                   f"null or a non-empty list of {list(LORA_TARGETS)}" + (f" (unknown: {bad})" if bad else ""))
        _check(self.init is None or Path(self.init).is_dir(), "model.lora.init", self.init,
               "null or an existing PEFT adapter folder")


@dataclass
class ModelConfig:
    """The policy model (one of the HF families llama | qwen2 | qwen3 | qwen3_moe | mixtral | deepseek_v3 |
    glm4_moe) and its tokenizer."""

    path: Optional[str] = opt(None, "Pretrained weights: a Hugging Face model directory (config.json + "
                                    "safetensors), a .gguf file (converted once into <output_dir>/hf-<name>, or "
                                    "into model.gguf_cache), or 'package:<python package>/<file>' for a file shipped "
                                    "inside an installed package. null = random init from model.hf_config.")
    gguf_cache: Optional[str] = opt(None, "Folder where a .gguf model.path is converted once and reused by every "
                                          "run that names the same folder (<gguf_cache>/<name>-<file size>; "
                                          "concurrent runs wait for one conversion); null = per run, into "
                                          "<output_dir>/hf-<name>.")
    hf_config: dict = opt({}, "HF config.json fields for a from-scratch model (model_type llama|qwen2|qwen3|"
                              "qwen3_moe|mixtral|deepseek_v3|glm4_moe, "
                              "hidden_size, num_hidden_layers, ...). Used when model.path is null; otherwise "
                              "entries here override the pretrained config (e.g. max_position_embeddings).")
    tokenizer: Optional[str] = opt(None, "Tokenizer: an HF tokenizer directory, a sentencepiece .model file, "
                                         "or 'train-sentencepiece' to train one on the task corpus (quickstart). "
                                         "null = the tokenizer next to model.path.")
    tokenizer_vocab_size: int = opt(512, "Vocabulary size when model.tokenizer='train-sentencepiece'.")
    chat_template: Optional[str] = opt(None, "Jinja chat template overriding the tokenizer's own (data.template="
                                             "chat needs one: from the tokenizer or from here).")
    dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "Parameter/compute dtype of the policy and its reference model, on CPU and GPU. bfloat16/float16: "
                   "Megatron's mixed precision (16-bit parameters and compute, fp32 gradient reduction, fp32 master "
                   "weights and Adam state in the optimizer and checkpoints; log-probs and the loss in fp32 from the "
                   "16-bit logits); float16 also scales the loss dynamically (its first ~15-20 updates overflow and "
                   "are skipped). The rollout engine samples in it too. At a small learning rate over few steps the "
                   "16-bit weights lag the fp32 masters (an update below half a bf16 step does not show in the "
                   "forward), so learning per step can be slower than in float32: docs/benchmarks.md, bf16 learning.")
    init_seed: int = opt(1234, "Seed of the random initialization of a from-scratch model.")
    attention_backend: Literal["auto", "te", "varlen", "sdpa"] = opt(
        "auto", "Core attention of packed (THD) micro-batches: te (Transformer Engine fused attention, GPU), varlen "
                "(torch's FlashAttention varlen kernels, GPU, no TE needed), sdpa (per-sequence "
                "scaled_dot_product_attention, any device), auto (te when it imports and works on CUDA, else varlen "
                "on CUDA for a float16/bfloat16 model whose head dim is a multiple of 8 up to 256, else sdpa). An "
                "explicit choice that cannot work is an error, never a silent fallback.")
    moe_aux_loss_coeff: float = opt(0.0, "Mixture-of-Experts models: weight of the router's load-balancing "
                                         "auxiliary loss (Megatron's switch loss of each MoE layer and "
                                         "micro-batch, averaged over the step's micro-batches weighted by their "
                                         "tokens, summed over layers, added to the policy loss); 0 = off (the "
                                         "default for RL: the router follows the reward only).")
    moe_routing_replay: bool = opt(False, "Mixture-of-Experts models: the training forward reuses the experts "
                                          "recorded for each token (by the old-log-prob pass, which then always "
                                          "runs) instead of routing again, so a policy update cannot flip a "
                                          "token's experts between the pass that scored it and the update.")
    lora: Optional[LoraSection] = opt(None, "LoRA (docs/lora.md): a section of adapter options (model.lora.rank=16 "
                                            "on the command line turns it on with the other defaults); null = "
                                            "full fine-tuning of every weight.")

    def validate(self) -> None:
        if self.path is None:
            _check(bool(self.hf_config), "model.hf_config", self.hf_config,
                   "a non-empty dict of HF config fields when model.path is null")
            mt = self.hf_config.get("model_type")
            families = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "ministral", "phi3",
                        "deepseek_v3", "glm4_moe")
            _check(mt in families, "model.hf_config.model_type", mt, f"one of {', '.join(families)} (docs/models.md)")
        _check(self.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, ">= 0")
        _check(self.tokenizer_vocab_size >= 64, "model.tokenizer_vocab_size", self.tokenizer_vocab_size, ">= 64")
        if self.lora is not None:
            if self.path is None:
                raise ValueError("model.lora is set but model.path is null: LoRA adapts pretrained weights; set "
                                 "model.path, or model.lora=null to train every weight")
            self.lora.validate()


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")  # Transformer Engine's context-parallel K/V exchanges (cp_comm_type)


@dataclass
class ParallelConfig:
    """Megatron model parallelism; data parallel size = world_size / (tp * pp * cp)."""

    tp: int = opt(1, "Tensor-parallel size.")
    pp: int = opt(1, "Pipeline-parallel size.")
    vpp: Optional[int] = opt(None, "Virtual pipeline stages per pipeline rank (interleaved schedule); null = off.")
    sp: bool = opt(False, "Sequence parallelism (needs tp > 1).")
    cp: int = opt(1, "Context-parallel size: every packed sequence is split over cp ranks in 2*cp load-balanced "
                     "chunks (long completions whose activations exceed one device). Sequences are padded to a "
                     "multiple of 2*tp*cp; packing.capacity still counts a micro-batch's tokens over all cp ranks. "
                     "Attention: Transformer Engine's own CP with model.attention_backend=te (GPU), else the "
                     "all-gather K/V attention of megatron/cp_attention.py on the sdpa or varlen kernel (on CPU: "
                     "sdpa; varlen is checked against CPU stand-ins of torch's kernel, not yet on a GPU). MoE: "
                     "model.moe_routing_replay and model.moe_aux_loss_coeff need cp=1.")
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = opt(
        "p2p", "How Transformer Engine's attention exchanges keys/values under parallel.cp > 1 (Megatron's "
               "cp_comm_type; attention_backend=te only, sdpa/varlen always all-gather): p2p (a ring of K/V blocks "
               "overlapped with compute), all_gather, a2a (all-to-all over heads; heads / tp divisible by cp).")
    ep: int = opt(1, "Expert-parallel size (Mixture-of-Experts models): the experts of each MoE layer are spread "
                     "over ep ranks of a pipeline stage; must divide num_experts and world_size / (pp * etp).")
    etp: int = opt(1, "Expert-tensor-parallel size (MoE models): each expert split over etp ranks like a dense "
                      "MLP under TP. 1 (whole experts, more EP) suits fine-grained experts such as Qwen3-MoE's.")

    # One class for the YAML section and the engine (megatron/parallel.py builds the process groups from it, and
    # code that lays out a model without a run, e.g. the conversion tools, constructs it directly).
    def __post_init__(self) -> None:
        self._check_layout()

    def _check_layout(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"parallel.{name}", value,
                   "an integer >= 1")
        _check(self.vpp is None or (isinstance(self.vpp, int) and self.vpp >= 1), "parallel.vpp", self.vpp,
               "null or an integer >= 1")
        _check(not (self.vpp and self.pp == 1), "parallel.vpp", self.vpp, "null when parallel.pp == 1")
        _check(self.cp_comm_type in CP_COMM_TYPES, "parallel.cp_comm_type", self.cp_comm_type,
               f"one of {CP_COMM_TYPES}")

    def validate(self) -> None:
        self._check_layout()
        _check(not (self.sp and self.tp == 1), "parallel.sp", self.sp, "false when parallel.tp == 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` processes."""
        if world_size % self.model_parallel_size:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*"
                             f"{self.cp} = {self.model_parallel_size}")
        return world_size // self.model_parallel_size


@dataclass
class RewardModelConfig:
    """A learned reward model scored beside the rule reward (docs/reward_models.md). The rule reward (reward.fn)
    is always computed too: it enters the training reward with reward.model.rule_weight and the agreement metrics
    (reward/rule_*, reward/rule_model_tau) either way."""

    path: Optional[str] = opt(None, "The reward model: a Hugging Face folder (offline). null = no reward model "
                                    "(rule rewards only). `megatron-dppo rm train` makes a small one.")
    kind: Literal["classifier", "judge"] = opt(
        "classifier", "classifier: a 1-label sequence classifier (*ForSequenceClassification), its logit at the "
                      "last token is the score; judge: a causal LM asked judge_template about the completion "
                      "(judge_mode).")
    engine: Literal["hf", "vllm", "megatron"] = opt(
        "hf", "hf: transformers in the rollout-side process (any device); vllm: a vLLM engine (pooling for "
              "classifiers, generate for judges); megatron: a classifier under the policy's parallel.tp/pp with "
              "the policy engine's code (trainer processes only: not with rollout.placement=separate).")
    template: Literal["auto", "tokens", "chat", "text"] = opt(
        "auto", "Classifier input: tokens = the policy's prompt and completion ids verbatim (the tokenizers must "
                "match); chat = decode, then the reward model's chat template over [user: prompt, assistant: "
                "completion]; text = prompt text + completion text; auto = tokens when the tokenizers match, else "
                "chat when the reward model has a chat template, else text.")
    weight: float = opt(1.0, "Weight of the model's score in the training reward: r = weight * model + "
                             "rule_weight * rule (+ an episode's environment step rewards, unweighted).")
    rule_weight: float = opt(0.0, "Weight of the rule reward (reward.fn) in the training reward (0 = train on "
                                  "the model alone; the rule reward is still computed for the metrics).")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "Parameter/compute dtype of the reward model.")
    batch_size: int = opt(32, "Inputs per forward pass (engine=hf).")
    timeout_s: Optional[float] = opt(600.0, "Wall-clock limit of scoring one batch on one rank; past it scoring "
                                            "fails (reward.model.on_error). null = none.")
    on_error: Literal["stop", "zero"] = opt(
        "stop", "When the reward model raises, times out or returns a non-finite score: stop = the run stops with "
                "one error naming the model and the batch; zero = the batch's groups score 0 and are counted in "
                "reward/model_failed (a rule reward that fails always costs only its sample a 0).")
    judge_mode: Literal["yes_prob", "verdict"] = opt(
        "yes_prob", "kind=judge: yes_prob = p(yes | yes or no) of the first answer token, one forward pass; "
                    "verdict = a sampled reply (judge_max_new_tokens) whose last number (judge_pattern) is the "
                    "score.")
    judge_template: Optional[str] = opt(None, "kind=judge: the question, with {prompt} and {completion} (and with "
                                              "judge_group {group}, the numbered completions, and {index}); null = "
                                              "a built-in yes/no question.")
    judge_group: bool = opt(False, "kind=judge: the question shows the whole group of completions (a completion's "
                                   "score may depend on its group; allowed, scoring precedes the advantages).")
    judge_tokens: list[str] = opt(["yes", "no"], "kind=judge, judge_mode=yes_prob: the two answer strings, one token "
                                            "each in the judge's tokenizer (quote them in YAML: [\"Yes\", \"No\"]).")
    judge_max_new_tokens: int = opt(16, "kind=judge, judge_mode=verdict: reply length limit.")
    judge_temperature: float = opt(1.0, "kind=judge, judge_mode=verdict: sampling temperature.")
    judge_pattern: str = opt(r"-?\d+(?:\.\d+)?", "kind=judge, judge_mode=verdict: regular expression of the score; "
                                                  "its last match in the reply is the score.")
    unparsed_score: float = opt(0.0, "kind=judge, judge_mode=verdict: the score of a reply without a match "
                                     "(counted in reward/model_unparsed).")
    gpu_memory_utilization: float = opt(0.2, "engine=vllm on GPU: the fraction of GPU memory its engine may take.")
    alarm_tau: float = opt(0.0, "Reward-hacking alarm: a warning, and reward/agreement_alarm = 1, when the mean "
                                "within-group Kendall tau between the rule and the model rewards "
                                "(reward/rule_model_tau) is below this.")

    def validate(self) -> None:
        if self.path is None:
            return
        _check(math.isfinite(self.weight) and math.isfinite(self.rule_weight) and (self.weight or self.rule_weight),
               "reward.model.weight", (self.weight, self.rule_weight),
               "finite weight and rule_weight, not both 0")
        _check(self.batch_size >= 1, "reward.model.batch_size", self.batch_size, ">= 1")
        _check(self.timeout_s is None or 0 < self.timeout_s < math.inf, "reward.model.timeout_s", self.timeout_s,
               "null or a finite number of seconds > 0")
        _check(len(self.judge_tokens) == 2 and all(isinstance(t, str) and t for t in self.judge_tokens),
               "reward.model.judge_tokens", self.judge_tokens, "two non-empty strings [yes, no]")
        _check(self.judge_max_new_tokens >= 1, "reward.model.judge_max_new_tokens", self.judge_max_new_tokens, ">= 1")
        _check(self.judge_temperature > 0, "reward.model.judge_temperature", self.judge_temperature, "> 0")
        _check(not (self.engine == "megatron" and self.kind != "classifier"), "reward.model.engine", self.engine,
               "hf or vllm with reward.model.kind=judge (the Megatron engine serves classifiers)")
        _check(0 < self.gpu_memory_utilization <= 1, "reward.model.gpu_memory_utilization",
               self.gpu_memory_utilization, "in (0, 1]")
        _check(-1 <= self.alarm_tau <= 1, "reward.model.alarm_tau", self.alarm_tau, "in [-1, 1]")


@dataclass
class RewardConfig:
    """Reward of a completion against the gold answer. A reward function that raises, hangs or returns NaN costs
    that sample a zero reward and a logged warning, never the run."""

    fn: Any = opt("auto", "Reward: a built-in name (math = math-verify, gsm8k, arithmetic, arithmetic_worked, "
                          "final_number, format), an import path 'package.module:function' (fn(completion, gold) -> "
                          "float), a mapping {name: weight} summing several, or auto (arithmetic for the arithmetic "
                          "task, final_number for a procedural task, gsm8k for GSM8K files, math otherwise).")
    timeout_s: float = opt(10.0, "Per-sample time limit of untrusted (user) reward functions.")
    isolation: Literal["auto", "inline", "process"] = opt(
        "auto", "Where rewards run: inline (this process), process (worker processes with a hard timeout), auto "
                "(inline for built-ins, process for user functions).")
    num_workers: int = opt(2, "Reward worker processes per rank (process isolation).")
    step_budget_s: Optional[float] = opt(
        120.0, "Wall-clock budget for scoring one RL step's completions on each rank (process isolation): "
               "samples still unscored when it runs out score 0 and count in reward/timeouts, like samples past "
               "reward.timeout_s. Every rank scores its own share of the step in parallel over reward.num_workers "
               "workers. Evaluation is not budgeted (every sample is scored, each within reward.timeout_s). "
               "null = no budget (a step may then take up to samples x timeout_s / (ranks x workers)).")
    model: RewardModelConfig = field(default_factory=RewardModelConfig,
                                     metadata={"help": "A learned reward model (its options)."})

    def validate(self) -> None:
        self.model.validate()
        _check(isinstance(self.fn, (str, dict)) and bool(self.fn), "reward.fn", self.fn,
               "a reward name, an import path 'pkg.module:fn', or a mapping {name: weight}")
        if isinstance(self.fn, dict):
            for name, weight in self.fn.items():
                _check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
                       f"reward.fn.{name}", weight, "a finite number (the weight of this reward in the sum)")
        _check(0 < self.timeout_s < math.inf, "reward.timeout_s", self.timeout_s, "a finite number of seconds > 0")
        _check(self.num_workers >= 1, "reward.num_workers", self.num_workers, ">= 1")
        _check(self.step_budget_s is None or 0 < self.step_budget_s < math.inf, "reward.step_budget_s",
               self.step_budget_s, "null or a finite number of seconds > 0")


LR_SCHEDULES = ("constant", "cosine")


@dataclass
class OptimConfig:
    """Adam optimizer (optionally Megatron's DistributedOptimizer, which shards its state over DP ranks).

    Weight decay is decoupled (AdamW) and not applied to biases and norm weights (Megatron's default parameter
    groups); the schedule's formula is ``algo.lr_schedule.lr_at_step``.
    """

    lr: float = opt(1e-6, "Peak learning rate of the RL phase.")
    min_lr: float = opt(0.0, "Final learning rate of the cosine decay (if scheduler=cosine).")
    scheduler: Literal["constant", "cosine"] = opt("constant", "Learning-rate schedule after warmup.")
    warmup_steps: int = opt(0, "Linear warmup steps.")
    weight_decay: float = opt(0.0, "Decoupled weight decay.")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip; 0 = off.")
    distributed_optimizer: bool = opt(False, "Shard Adam state and fp32 master weights over the data-parallel "
                                             "ranks (Megatron DistributedOptimizer); for large models.")

    # One class for the YAML section and the engine (megatron/engine.py builds its optimizer from it; tests and
    # benchmarks construct it directly): the checks an optimizer needs run on construction; validate adds the
    # run's rules (a positive learning rate, a positive epsilon).
    def __post_init__(self) -> None:
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "grad_clip"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                   and value >= 0, f"optim.{name}", value, "a finite number >= 0")
        _check(self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"<= optim.lr={self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _check(0 <= value < 1, f"optim.{name}", value, "in [0, 1)")
        _check(self.scheduler in LR_SCHEDULES, "optim.scheduler", self.scheduler, f"one of {LR_SCHEDULES}")
        _check(isinstance(self.warmup_steps, int) and not isinstance(self.warmup_steps, bool)
               and self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _check(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "in [0, optim.lr]")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        _check(0 <= self.adam_beta1 < 1, "optim.adam_beta1", self.adam_beta1, "in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "optim.adam_beta2", self.adam_beta2, "in [0, 1)")
        _check(self.adam_eps > 0, "optim.adam_eps", self.adam_eps, "> 0")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, ">= 0")
        self._check_optimizer()


@dataclass
class PackingConfig:
    """Dense Prompt Packing (docs/algorithms.md)."""

    capacity: int = opt(1024, "Token capacity C of one THD micro-batch (>= the longest prompt+completion). "
                              "1024: the lowest train time per token measured on CPU (benchmarks/capacity.py, "
                              "docs/benchmarks.md: 281 us/token vs 322 at 512 and 357 at 4096; larger micro-"
                              "batches fall out of cache); long-completion GPU runs set it higher (examples/).")
    window: int = opt(64, "Window-greedy packing window W (sequences considered together).")

    def validate(self) -> None:
        _check(self.capacity >= 1, "packing.capacity", self.capacity, ">= 1")
        _check(self.window >= 1, "packing.window", self.window, ">= 1")


@dataclass
class TrainConfig:
    """The RL schedule (and the optional supervised warm start)."""

    steps: int = opt(100, "Number of RL steps (one rollout batch each; train.mini_batches * train.epochs optimizer "
                          "updates each).")
    prompts_per_step: int = opt(32, "Global batch B: prompts drawn per step (before prompt pruning).")
    group_size: int = opt(8, "G: completions sampled per prompt.")
    seed: int = opt(1234, "Seed of every random decision (data order, sampling, pruning draws), per step.")
    cpu_threads: Optional[int] = opt(None, "CPU runs: torch threads per process; null = the machine's cores / "
                                           "processes on this node (OMP_NUM_THREADS, when set, wins). 1 is fastest "
                                           "for tiny models and on shared machines.")
    output_dir: str = opt("runs/default", "Directory for metrics, plots, the resolved config and checkpoints.")
    recompute_old_logprobs: bool = opt(False, "Always run the forward-only old-policy log-prob pass before the "
                                              "update. false (default): run it only when the ratio can differ "
                                              "from 1 (stages.old_logprobs_needed: several updates per rollout, "
                                              "loss.rollout_correction); with one update per rollout "
                                              "old = detached current log-probs, the identical update with one "
                                              "forward pass less (as TRL does). The rollout/train mismatch "
                                              "metric then uses the train forward's log-probs.")
    mini_batches: int = opt(1, "PPO mini-batches per rollout batch: the drawn prompts are split by prompt (all G "
                               "completions together), from (train.seed, step), BEFORE pruning, into this many "
                               "parts of near-equal prompt count; each is packed separately and gets one update "
                               "with its own full (un-pruned) denominator D_m, so its pruned gradient stays "
                               "unbiased. Old log-probs are computed once per rollout, before the first update; "
                               "the PPO ratio is live afterwards. <= train.prompts_per_step (verl "
                               "ppo_mini_batch_size = B / mini_batches; TRL steps_per_generation).")
    epochs: int = opt(1, "Passes over the rollout batch's mini-batches (verl ppo_epochs, TRL num_iterations); "
                         "updates per RL step = train.mini_batches * train.epochs.")
    sft_steps: int = opt(0, "Supervised warm-start steps on gold completions before RL (through the same "
                            "Megatron engine: advantage 1 at ratio 1 == the log-likelihood gradient).")
    sft_batch_size: int = opt(32, "Gold (prompt, completion) pairs per warm-start step.")
    sft_lr: float = opt(1e-3, "Learning rate of the warm start.")
    max_staleness: int = opt(0, "k: the batch trained at RL step t may be generated by weights at most k "
                                "versions older (version v = the weights after v RL updates). 0 = on-policy, "
                                "the synchronous loop. k >= 1 needs rollout.placement=separate: the rollout "
                                "workers run ahead by up to k batches while the trainer trains; use "
                                "loss.rollout_correction=tis|mis for the decoupled objective (docs/async.md). "
                                "Which version generates a batch: train.staleness_mode.")
    staleness_mode: Literal["newest", "fixed"] = opt(
        "newest", "train.max_staleness = k >= 1: which weight version generates the batch of RL step t. newest: "
        "the newest version that has reached the workers, at least t - k; it depends on timing, so two runs "
        "differ, and a resume generates the batches in flight at the checkpoint again from the restored weights. "
        "fixed: exactly version max(0, t - k) (verl's one-step-off-policy at k = 1): a run is reproducible bit for "
        "bit and resumes exactly, because the checkpoint keeps the batches in flight (the trainer waits for them "
        "when it saves); each worker holds up to k + 1 versions of the weights in host memory.")

    cpu_budget_s: Optional[float] = opt(None, "Stop the RL phase once its steps have used this many CPU seconds "
                                               "(time/step_cpu, summed over ranks and steps: each whole step, "
                                               "generation to weight push, with the CPU of child processes such as "
                                               "process-isolated reward workers and tool sandboxes; evaluation, "
                                               "checkpoints and start-up excluded), or at train.steps, whichever "
                                               "comes first; the last step is then evaluated and checkpointed as the "
                                               "last of train.steps would be. For comparing methods at equal compute "
                                               "(benchmarks/time_to_accuracy.py). The seconds spent are "
                                               "checkpointed and a resumed run goes on counting from them, but CPU "
                                               "seconds are measured, not replayed: where a run stops varies as much "
                                               "as its steps' CPU seconds do, resumed or not (two straight quickstart "
                                               "runs on a shared 2-core machine: 20% apart over the same 12 steps), "
                                               "and each restart pays its process warm-up again (two resumes: "
                                               "0.03-0.06 CPU s, under a tenth of a quickstart step). "
                                               "rollout.placement=colocated only (the "
                                               "workers' CPU is not in time/step_cpu). null = no budget.")

    def validate(self) -> None:
        _check(self.steps >= 0, "train.steps", self.steps, ">= 0")
        _check(self.cpu_budget_s is None or 0 < self.cpu_budget_s < math.inf, "train.cpu_budget_s",
               self.cpu_budget_s, "null or a finite number of CPU seconds > 0")
        _check(self.prompts_per_step >= 1, "train.prompts_per_step", self.prompts_per_step, ">= 1")
        _check(self.group_size >= 2, "train.group_size", self.group_size, ">= 2 (advantages need a group)")
        _check(self.sft_steps >= 0, "train.sft_steps", self.sft_steps, ">= 0")
        _check(1 <= self.mini_batches <= self.prompts_per_step, "train.mini_batches", self.mini_batches,
               f"an integer in [1, train.prompts_per_step={self.prompts_per_step}] (each needs a prompt)")
        _check(self.epochs >= 1, "train.epochs", self.epochs, ">= 1")
        _check(self.sft_batch_size >= 1, "train.sft_batch_size", self.sft_batch_size, ">= 1")
        _check(self.sft_lr > 0, "train.sft_lr", self.sft_lr, "> 0")
        _check(self.max_staleness >= 0, "train.max_staleness", self.max_staleness, ">= 0")
        _check(self.staleness_mode in ("newest", "fixed"), "train.staleness_mode", self.staleness_mode,
               "'newest' or 'fixed'")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "train.cpu_threads", self.cpu_threads,
               "null or >= 1")


@dataclass
class EvalConfig:
    """Held-out evaluation: pass@1 and pass@k."""

    files: list = opt([], "Held-out JSONL/parquet files (same field options as data). With data.task="
                          "arithmetic or procedural, an empty list evaluates on the task's held-out split.")
    every: int = opt(0, "Evaluate every N RL steps (and after the last); 0 = never.")
    every_cpu_s: Optional[float] = opt(None, "Also evaluate after the RL step whose process CPU seconds (cumulative "
                                             "time/step_cpu, as train.cpu_budget_s counts them) cross a multiple of "
                                             "this, and after the last step: runs of different step costs are then "
                                             "evaluated at the same compute. rollout.placement=colocated only. "
                                             "null = off.")
    max_prompts: int = opt(200, "Evaluate at most this many prompts per file (first N, deterministic).")
    samples: int = opt(4, "Completions per prompt (n); pass@1 = mean correctness, pass@k unbiased estimator.")
    pass_k: int = opt(4, "k of pass@k (<= eval.samples).")
    temperature: float = opt(1.0, "Sampling temperature of evaluation.")
    reward: Any = opt("auto", "Correctness check of evaluation (same forms as reward.fn); auto = per file: gsm8k "
                              "for GSM8K files, arithmetic for the arithmetic task, final_number for a procedural "
                              "task, math (math-verify) otherwise.")
    suite: Optional[Literal["math6", "math8"]] = opt(None, "A named benchmark suite evaluated in addition to "
                                                           "eval.files: math6 (GSM8K, "
                                     "MATH-500, AIME24, AMC23, Minerva Math, OlympiadBench) or math8 (math6 + SVAMP, "
                                     "ASDiv); megatron-dppo eval prints one table with their average. For the papers' "
                                     "protocol raise eval.max_prompts to cover every prompt.")
    data_dir: str = opt("data/math", "Folder of the suite's files: <benchmark>_test.jsonl as `megatron-dppo data "
                                     "prepare math6 --out data/math` writes them (or the Qwen2.5-Math layout: "
                                     "gsm8k_test.jsonl, math500_test.jsonl, qwen25math/*.jsonl).")

    def validate(self) -> None:
        _check(self.every >= 0, "eval.every", self.every, ">= 0")
        _check(self.every_cpu_s is None or 0 < self.every_cpu_s < math.inf, "eval.every_cpu_s", self.every_cpu_s,
               "null or a finite number of CPU seconds > 0")
        _check(self.max_prompts >= 1, "eval.max_prompts", self.max_prompts, ">= 1")
        _check(self.samples >= 1, "eval.samples", self.samples, ">= 1")
        _check(1 <= self.pass_k <= self.samples, "eval.pass_k", self.pass_k, f"in [1, eval.samples={self.samples}]")
        _check(self.temperature > 0, "eval.temperature", self.temperature, "> 0")
        for f in self.files:
            if not Path(f).exists():
                raise ValueError(f"eval.files: file {f!r} does not exist")


@dataclass
class CheckpointConfig:
    """Checkpoints: model, optimizer, RNG, step, data cursor, prompt history (written atomically)."""

    dir: Optional[str] = opt(None, "Checkpoint directory; null = <train.output_dir>/checkpoints.")
    every: int = opt(0, "Save every N RL steps and every N warm-start steps (always at the end and on SIGINT/"
                        "SIGTERM/SIGHUP/SIGUSR1); 0 = only then.")
    resume: Literal["auto", "never", "must"] = opt("auto", "auto = resume from the latest checkpoint in "
                                                           "checkpoint.dir if any; never = start fresh (error if "
                                                           "one exists); must = error if none exists.")
    keep_last: int = opt(2, "Keep the newest N checkpoints; older ones are deleted after a successful save.")
    verify: Literal["hash", "size"] = opt("hash", "Check a checkpoint against its manifest before resuming from it: "
                                                  "hash = sizes and SHA-256 of every file (reads it once), size = "
                                                  "sizes only. A damaged checkpoint is skipped (with a warning) "
                                                  "for the newest one that verifies.")

    def validate(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, ">= 0")
        _check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


@dataclass
class LoggingConfig:
    """Where metrics go."""

    tensorboard: bool = opt(True, "Write TensorBoard scalars to <output_dir>/tensorboard.")
    jsonl: bool = opt(True, "Append one JSON line of metrics per step to <output_dir>/metrics.jsonl.")
    wandb: Literal["auto", "on", "off"] = opt("off", "Weights & Biases: on (error if not installed), auto (when "
                                                     "installed and WANDB_API_KEY / WANDB_MODE is set), off.")
    wandb_project: str = opt("megatron-dppo", "W&B project name.")
    audit_log: bool = opt(False, "Write every drawn prompt's id, prompt-level decision, and its completions' "
                                 "rewards, advantages, keep flags and weights to <output_dir>/audit.jsonl.")
    audit_every: int = opt(0, "Every N RL steps, measure the pruned gradient against the full-batch gradient at "
                              "the current weights (audit/cosine, audit/rel_error, audit/ess; costs ~2-3x a "
                              "step's training phase, not counted in time/step); 0 = off.")
    progress_bar: bool = opt(True, "Show a tqdm progress bar with reward and throughput (rank 0).")
    plot: bool = opt(True, "Save <output_dir>/reward_curve.png at the end.")
    print_every: int = opt(1, "Print a one-line step summary every N steps; 0 = never.")

    def validate(self) -> None:
        _check(self.print_every >= 0, "logging.print_every", self.print_every, ">= 0")
        _check(self.audit_every >= 0, "logging.audit_every", self.audit_every, ">= 0")
