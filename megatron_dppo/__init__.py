"""megatron-dppo: unbiased dynamic pruning (DPPO) for GRPO-family RL of LLMs on Megatron-Core.

Pure math (``algo``, ``packing``) imports only torch. Megatron-specific code lives in ``megatron_dppo.megatron``.
"""

__version__ = "0.1.0"
