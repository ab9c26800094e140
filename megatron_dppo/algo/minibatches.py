"""Several updates per rollout: the split of a step's drawn prompts into PPO mini-batches (docs/algorithms.md,
"Several updates per rollout").

The B prompts drawn for a step are split into M mini-batches BY PROMPT (all G completions of a prompt stay
together), from a generator seeded by (seed, step) only, so the split is fixed before, and independent of, every
pruning draw. Each mini-batch m then has its own draw-independent denominator D_m, computed from its un-pruned
units exactly like the full batch's D (``losses.loss_denominator`` over its B_m prompts), and its pruned,
1/pi-weighted loss and gradient are unbiased estimates of the same mini-batch un-pruned, for any M and epoch.

With M = 1 the split is the identity (every prompt, in draw order) and no random number is drawn.
"""
from __future__ import annotations

import torch


def split_prompts(num_prompts: int, mini_batches: int, generator: torch.Generator | None = None) -> list[list[int]]:
    """Indices 0..num_prompts-1 split into ``mini_batches`` disjoint groups of sizes differing by at most one (the
    first ``num_prompts % mini_batches`` groups get the extra prompt), each group in ascending order.

    With ``generator`` the prompts are assigned after a random permutation from it (a fresh assignment per
    step); without, contiguous blocks of the draw order. ``mini_batches == 1`` returns ``[[0, ..., n-1]]``.
    """
    for name, value in (("num_prompts", num_prompts), ("mini_batches", mini_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if mini_batches > num_prompts:
        raise ValueError(f"mini_batches={mini_batches} is more than the {num_prompts} prompts drawn per step: every "
                         "mini-batch needs at least one prompt (lower train.mini_batches or raise "
                         "train.prompts_per_step)")
    if mini_batches == 1:
        return [list(range(num_prompts))]
    order = (torch.randperm(num_prompts, generator=generator).tolist() if generator is not None
             else list(range(num_prompts)))
    base, extra = divmod(num_prompts, mini_batches)
    groups, start = [], 0
    for m in range(mini_batches):
        size = base + (1 if m < extra else 0)
        groups.append(sorted(order[start:start + size]))
        start += size
    return groups
