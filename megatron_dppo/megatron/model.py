"""Megatron-Core ``GPTModel`` from a Hugging Face config: Llama (incl. SmolLM2), Qwen2, Qwen3, Mistral and
Ministral (a sliding window, ``dense_families``), and the Mixture-of-Experts families Qwen3-MoE and Mixtral (their
sparse blocks: ``moe``). docs/models.md lists what is tested per family and what is refused.

All three families are the same decoder: pre-norm RMSNorm, rotary position embedding (theta from the config),
grouped-query attention, SwiGLU MLP ``W2 (silu(W_gate x) * W_up x)``, final RMSNorm, tied or untied output
embedding. They differ only in two switches:

=========  ====================  =============================================
family     ``qkv_bias``          ``qk_norm`` (RMSNorm over head_dim on q and k)
=========  ====================  =============================================
llama      False                 False
qwen2      True                  False
qwen3      False                 True (and an explicit ``head_dim``)
qwen3_moe  False                 True; MoE blocks (``ModelArch.moe``)
mixtral    False                 False; MoE blocks in every layer
mistral    False                 False; sliding-window attention (``dense_families.py``)
ministral  False                 False; sliding and full layers mixed
phi3       False                 False; fused qkv / gate_up in the checkpoint, partial rotary, a window
=========  ====================  =============================================

``deepseek_v3`` (multi-latent attention: ``MLATransformerConfig``, Megatron's MLA layer spec) and ``glm4_moe`` (the
switches from its config, partial rotary) are read by ``deepseek_moe``; their sigmoid routers, expert bias and
shared experts are MoE fields (``moe_config_kwargs``).

``ModelArch.from_hf_config`` (``arch.py``) reads those numbers (rejecting what the model cannot represent, e.g. an
unknown ``rope_scaling`` type), ``build_transformer_config`` makes the Megatron ``TransformerConfig``, and
``build_gpt_model`` builds the (TP/PP-local) ``GPTModel``:

* ``attention_backend`` (``model.attention_backend``, resolved by ``attention.resolve_attention_backend``):
  ``te``: Megatron's TE layer spec (fused norm+linear, THD fused attention); ``varlen``: Megatron's local spec with
  ``attention.VarlenCoreAttention`` (torch's FlashAttention varlen kernels, CUDA, no TE); ``sdpa``: the local spec
  with ``attention.SDPACoreAttention`` (any device). ``auto``: te, else varlen on CUDA for an fp16/bf16 model with a
  head dim FlashAttention takes, else sdpa. The built backend is ``model.attention_backend``.
* Fusion flags (RoPE, bias-activation, masked softmax) follow the spec actually built: on for the TE spec only.

Precision and placement: ``dtype`` (default ``default_dtype``: bf16 on GPU, fp32 on CPU; bf16 and fp16 run on CPU
too). Every built chunk has each parameter and buffer on the engine's device in the params dtype (``place_model``;
``device_dtype_audit`` lists what is not), whatever the spec. On a CUDA-less machine the CPU backend
(``megatron_dppo.megatron.cpu``) is applied automatically.
"""
from __future__ import annotations

import copy
import math

import torch

from . import compat
from .arch import FAMILIES, QK_NORM_FAMILIES, SUPPORTED_ROPE_TYPES, ModelArch  # noqa: F401 - re-exported
from .cpu import allow_sequence_parallel_torch_norm, ensure_device_backend
from .deepseek_moe import (
    MLA_ARCH_CONFIG_FIELDS,
    ensure_mla_without_te,
    mla_config_kwargs,
    replicate_mla_down_projections,
)
from .dense_families import window_config_kwargs
from .moe import MOE_ARCH_CONFIG_FIELDS, moe_block_spec, moe_config_kwargs, reduce_expert_grads_over_expert_grid
from .parallel import ParallelConfig, validate_parallel


# ----------------------------------------------------------------------------------------------------------
def default_dtype() -> torch.dtype:
    """The dtype when none is given: bf16 on GPU, fp32 on CPU (where bf16 is a choice: ``model.dtype``)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def use_transformer_engine() -> bool:
    """True when ``attention_backend=auto`` builds the TE layer spec (CUDA, TE imports and works)."""
    return resolve_backend("auto") == "te"


def resolve_backend(attention_backend: str | None = None, te: bool | None = None, *,
                    dtype: torch.dtype | None = None, head_dim: int | None = None,
                    v_head_dim: int | None = None) -> str:
    """``te`` | ``varlen`` | ``sdpa`` for a requested ``attention_backend`` (None = auto) and a model of
    ``dtype`` / ``head_dim`` (varlen takes half precision and head dims FlashAttention supports; None = not
    checked); the legacy ``te`` flag (True = "te", False = "sdpa") is accepted when no backend is named."""
    from .attention import resolve_attention_backend

    if attention_backend is None and te is not None:
        attention_backend = "te" if te else "sdpa"
    return resolve_attention_backend(attention_backend or "auto", dtype=dtype, head_dim=head_dim,
                                     v_head_dim=v_head_dim)


def engine_device() -> torch.device:
    """The device this process computes on: its current CUDA device, else the CPU (CPU backend applied)."""
    if ensure_device_backend() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Buffers Megatron keeps in float32 whatever the parameter dtype (the MoE router's expert-bias bookkeeping,
# ``TopKRouter._maintain_float32_expert_bias``): placed on the device, never cast.
FLOAT32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")


def place_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter and buffer of ``model`` onto ``device``, floating ones in ``dtype`` (except
    ``FLOAT32_BUFFERS``); parameter objects and their Megatron attributes are kept. What Megatron-LM's training
    loop does to each chunk (``model_module.cuda()``, then the ``Float16Module`` cast): Megatron builds most
    weights on the device in ``params_dtype``, but the local spec's torch RMSNorm is created on the CPU in fp32
    and the MoE router weight on the CPU (moved only at its first forward, after DDP has read it)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            want = dtype if param.is_floating_point() else param.dtype
            if param.device != device or param.dtype != want:
                param.data = param.data.to(device=device, dtype=want)
        for name, buf in module.named_buffers(recurse=False):
            want = dtype if buf.is_floating_point() and name not in FLOAT32_BUFFERS else buf.dtype
            if buf.device != device or buf.dtype != want:
                module._buffers[name] = buf.to(device=device, dtype=want)
    return model


def device_dtype_audit(modules, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The parameters and buffers of ``modules`` (a module or a list of them) that ``place_model`` would move:
    ``"<name>: <dtype> on <device>"`` for each one not on ``device``, or floating and not in ``dtype`` (buffers in
    ``FLOAT32_BUFFERS`` may be float32). Empty when everything is placed."""
    modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    problems = []
    for i, chunk in enumerate(modules):
        prefix = f"chunk{i}." if len(modules) > 1 else ""
        tensors = [(name, t, dtype) for name, t in chunk.named_parameters()]
        tensors += [(name, t, torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_BUFFERS else dtype)
                    for name, t in chunk.named_buffers()]
        for name, t, want in tensors:
            if t.device != device or (t.is_floating_point() and t.dtype != want):
                problems.append(f"{prefix}{name}: {str(t.dtype).replace('torch.', '')} on {t.device}")
    return problems


# TransformerConfig fields that define the model (an installed Megatron-Core lacking one is unsupported);
# every other field we set is a performance or bookkeeping flag that may be dropped on other releases.
_ARCH_CONFIG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
                       "add_bias_linear", "add_qkv_bias", "qk_layernorm", "tensor_model_parallel_size",
                       "pipeline_model_parallel_size", "sequence_parallel", "params_dtype", "bf16", "fp16",
                       # training semantics Megatron must honour (never dropped by version filtering)
                       "pipeline_dtype", "variable_seq_lengths", "context_parallel_size",
                       "calculate_per_token_loss")


def build_transformer_config(arch: ModelArch, parallel: ParallelConfig, dtype: torch.dtype | None = None,
                             *, attention_backend: str | None = None, moe_aux_loss_coeff: float = 0.0,
                             moe_routing_replay: bool = False, **overrides) -> "TransformerConfig":  # noqa: F821
    """Megatron ``TransformerConfig`` for ``arch`` under ``parallel``. ``overrides`` replace any field
    (e.g. ``recompute_granularity="full"``); performance fields unknown to the installed Megatron-Core are
    dropped, fields that change the model or its training (``_ARCH_CONFIG_FIELDS``) raise instead.
    ``attention_backend`` (resolved: te | varlen | sdpa; None = auto) sets the fusion flags: TE kernels are
    used by the TE spec only. MoE models (``arch.moe``): ``moe_aux_loss_coeff`` (0 = no load-balancing loss)
    and ``moe_routing_replay`` (Megatron's router replay hooks, see ``routing_replay``); experts use grouped
    GEMM with the TE spec and are split over ``parallel.ep`` / ``parallel.etp``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    device = ensure_device_backend()
    dtype = dtype or default_dtype()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype}; supported: torch.float32, torch.bfloat16, torch.float16")
    te = device == "cuda" and resolve_backend(attention_backend, dtype=dtype, head_dim=arch.head_dim,
                                              v_head_dim=_v_head_dim(arch)) == "te"
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        sequence_parallel=parallel.sp,
        context_parallel_size=parallel.cp,
        cp_comm_type=parallel.cp_comm_type if parallel.cp > 1 else None,  # read by TE attention only
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        # packed micro-batches differ in length: pipeline stages exchange shapes first
        variable_seq_lengths=parallel.pp > 1,
        # (dense models too: 0.16 rejects variable_seq_lengths with the default "allgather" MoE dispatcher)
        moe_token_dispatcher_type="alltoall",
        # fusions: TE kernels with the TE spec only; gradient-accumulation fusion needs DDP main_grad buffers and
        # TE/Apex, it is a training-loop choice (override it there)
        gradient_accumulation_fusion=False,
        apply_rope_fusion=te,
        bias_activation_fusion=te,
        masked_softmax_fusion=te,
        persist_layer_norm=False,
        use_cpu_initialization=device == "cpu",
        cross_entropy_loss_fusion=False,
    )
    required = _ARCH_CONFIG_FIELDS
    if arch.moe is not None:
        kwargs.update(moe_config_kwargs(arch.moe, ep=parallel.ep, etp=parallel.etp, aux_loss_coeff=moe_aux_loss_coeff,
                                        routing_replay=moe_routing_replay, grouped_gemm=te))
        required += MOE_ARCH_CONFIG_FIELDS
    elif moe_routing_replay or moe_aux_loss_coeff:
        raise ValueError(f"moe_routing_replay={moe_routing_replay} / moe_aux_loss_coeff={moe_aux_loss_coeff} "
                         f"need a Mixture-of-Experts model; {arch.family!r} is dense")
    config_class = TransformerConfig
    if arch.mla is not None:  # deepseek_v3: multi-latent attention (deepseek_moe.py)
        if parallel.cp > 1:
            raise ValueError(f"cp={parallel.cp} with multi-latent attention (deepseek_v3): context parallelism is "
                             "not supported for MLA here (the CP attention assumes one head dim for q, k and v); "
                             "use cp=1")
        if parallel.tp > 1 and not parallel.sp:
            raise ValueError(f"tp={parallel.tp} without sequence parallelism (parallel.sp) with multi-latent "
                             "attention: the shared rotary key's gradient is summed over TP only by the sequence-"
                             "parallel gather; set parallel.sp=true")
        kwargs.update(mla_config_kwargs(arch.mla, arch))
        kwargs["apply_rope_fusion"] = te and arch.mla.rope_type == "yarn"  # Megatron fuses MLA's YaRN RoPE only
        config_class, required = MLATransformerConfig, required + MLA_ARCH_CONFIG_FIELDS
    if parallel.cp > 1 and (moe_routing_replay or moe_aux_loss_coeff):
        # a CP rank routes only its part of each sequence: the per-sequence routes (replay) and the aux loss's
        # per-routed-token scale (moe.aux_loss_per_routed_token) are not built for that
        raise ValueError(f"moe_routing_replay={moe_routing_replay} / moe_aux_loss_coeff={moe_aux_loss_coeff} with "
                         f"cp={parallel.cp}: context parallelism takes neither (use cp=1, or turn both off)")
    # --- sliding-window attention (mistral / ministral; dense_families.py) ---
    window = window_config_kwargs(arch.sliding_window, arch.window_layers)
    if window and parallel.cp > 1:
        raise ValueError(f"sliding_window={arch.sliding_window} ({arch.family}) with cp={parallel.cp}: the "
                         "context-parallel attention has no sliding window; use cp=1")
    kwargs.update(window)
    required += tuple(window)
    # ---
    kwargs.update(overrides)
    return config_class(**compat.supported_kwargs(config_class, kwargs, required=required))


def _v_head_dim(arch: ModelArch) -> int | None:
    """The value head size when it differs from the query/key one (multi-latent attention), else None."""
    return arch.mla.v_head_dim if arch.mla is not None and arch.mla.v_head_dim != arch.head_dim else None


def build_layer_spec(arch: ModelArch, te: bool | None = None, *, attention_backend: str | None = None,
                     config=None, vp_stage: int | None = None):
    """The transformer-layer ``ModuleSpec`` of a backend (see the module docstring): the TE spec, or the local
    spec with ``VarlenCoreAttention`` / ``SDPACoreAttention``. MoE models get a decoder block spec (per-layer
    specs, MoE or dense, ``moe.moe_block_spec``) built from their ``config``, for this rank's pipeline stage
    (and virtual stage ``vp_stage``)."""
    backend = resolve_backend(attention_backend, te, dtype=getattr(config, "params_dtype", None),
                              head_dim=arch.head_dim, v_head_dim=_v_head_dim(arch))
    if backend != "te":
        allow_sequence_parallel_torch_norm()
    if arch.mla is not None:
        ensure_mla_without_te()
    if arch.moe is not None:
        if config is None:
            raise ValueError("an MoE layer spec needs the TransformerConfig (its moe_layer_freq places the experts)")
        from .attention import core_attention_class

        block = moe_block_spec(config, backend, None if backend == "te" else core_attention_class(backend),
                               vp_stage=vp_stage)
        if arch.mla is not None and backend != "te":
            replicate_mla_down_projections(block)  # (moe_block_spec returned a copy)
        return block
    if backend == "te":
        return compat.gpt_te_layer_spec(qk_layernorm=arch.qk_norm)
    from .attention import core_attention_class

    spec = copy.deepcopy(compat.gpt_local_layer_spec(qk_layernorm=arch.qk_norm))
    spec.submodules.self_attention.submodules.core_attention = core_attention_class(backend)
    return spec


VOCAB_PAD_MULTIPLE = 128  # Megatron-LM's default make_vocab_size_divisible_by


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the Megatron embedding / output layer: ``vocab_size`` when tp divides it, else rounded up to a
    multiple of lcm(128, tp) (the same padded size for every power-of-two tp <= 128, so such checkpoints
    reshard between those TP sizes). The padding rows are zero, their logits are masked out
    (``logprobs.forward_thd``) and conversion drops them."""
    if vocab_size % tp == 0:
        return vocab_size
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def build_gpt_model(arch: ModelArch, parallel: ParallelConfig, dtype: torch.dtype | None = None,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None, *, te: bool | None = None, attention_backend: str | None = None,
                    config=None, **config_overrides):
    """The local ``GPTModel`` chunk of this rank (model-parallel state must be initialized); for a sequence
    classifier (``arch.num_labels``) with ``score_head.ScoreHead`` as its output layer.

    ``pre_process``/``post_process`` default to "this is the first/last pipeline stage" (for ``vp_stage``).
    The output layer is vocab-parallel (``parallel_output=True``): logits come back as the local vocab shard
    ``[b, s, vocab/tp]``; see ``logprobs.vocab_parallel_logprobs``. ``config`` (a ``TransformerConfig``)
    replaces the one built from ``arch``. ``attention_backend``: auto (None) | te | varlen | sdpa; ``te`` is the
    older boolean form (True = te, False = sdpa).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    ensure_device_backend()
    compat.log_gpu_extras_once()
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model-parallel state is not initialized; call parallel.initialize_parallel first")
    world = torch.distributed.get_world_size()
    validate_parallel(arch, parallel, world)
    state = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size(),
             parallel_state.get_expert_tensor_parallel_world_size(),
             parallel_state.get_context_parallel_world_size())
    if state != (parallel.tp, parallel.pp, parallel.ep, parallel.etp, parallel.cp):
        raise ValueError(
            f"ParallelConfig(tp={parallel.tp}, pp={parallel.pp}, ep={parallel.ep}, etp={parallel.etp}, "
            f"cp={parallel.cp}) does not match the initialized state (tp={state[0]}, pp={state[1]}, ep={state[2]}, "
            f"etp={state[3]}, cp={state[4]})")
    if parallel.vpp is not None and vp_stage is None:
        raise ValueError(f"vpp={parallel.vpp}: pass vp_stage (0..{parallel.vpp - 1}) for each model chunk")
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    dtype = config.params_dtype if config is not None else dtype or default_dtype()
    backend = resolve_backend(attention_backend, te, dtype=dtype, head_dim=arch.head_dim,
                              v_head_dim=_v_head_dim(arch))
    config = config or build_transformer_config(arch, parallel, dtype, attention_backend=backend, **config_overrides)
    spec = build_layer_spec(arch, attention_backend=backend, config=config, vp_stage=vp_stage)
    if backend != "te" and getattr(config, "apply_rope_fusion", False):
        raise ValueError(f"attention backend {backend!r} builds the local spec, but the config has "
                         "apply_rope_fusion=True (a TE kernel); set it False")
    kwargs = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_type == "llama3",
        rope_scaling_factor=arch.rope_scaling_factor if arch.rope_scaling_type == "llama3" else 8.0,
        seq_len_interpolation_factor=arch.rope_scaling_factor if arch.rope_scaling_type == "linear" else None,
        vp_stage=vp_stage,
    )
    required = ("vocab_size", "share_embeddings_and_output_weights", "position_embedding_type", "rotary_base",
                "pre_process", "post_process", "parallel_output")
    if arch.rotary_percent != 1.0:
        required += ("rotary_percent",)
    if arch.rope_scaling_type != "default":
        required += ("rope_scaling", "rope_scaling_factor", "seq_len_interpolation_factor")
    if vp_stage is not None:
        required += ("vp_stage",)
    model = GPTModel(**compat.supported_kwargs(GPTModel.__init__, kwargs, required=required))
    if arch.num_labels is not None and post_process:  # a sequence classifier (reward model): the score head
        from .score_head import attach_score_head

        attach_score_head(model, arch, config)
    model.unpadded_vocab_size = arch.vocab_size  # logits of the padding rows are masked (logprobs.forward_thd)
    model.attention_backend = backend  # what was built (te | varlen | sdpa), for banners and reports
    place_model(model, engine_device(), dtype)  # before DDP / the optimizer see the parameters
    if arch.moe is not None:
        reduce_expert_grads_over_expert_grid(model)  # before DDP / the optimizer read the flags
    return model


def build_model_chunks(arch: ModelArch, parallel: ParallelConfig, dtype: torch.dtype | None = None,
                       **kwargs) -> list:
    """All model chunks of this rank: one per virtual pipeline stage (one without vpp)."""
    if parallel.vpp is None:
        return [build_gpt_model(arch, parallel, dtype, **kwargs)]
    return [build_gpt_model(arch, parallel, dtype, vp_stage=i, **kwargs) for i in range(parallel.vpp)]
