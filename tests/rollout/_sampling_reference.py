"""An independent computation of the distribution a rollout engine samples from: one teacher-forced forward of
the HF model, its logits divided by the temperature, then top-k and top-p as HF's and vLLM's warpers apply them
(removed tokens at -inf), log_softmax; shared by the HF and vLLM engine tests. ``max_logprob_error``: the worst
gap between an engine's behaviour log-probs and that forward, over every token of its groups."""
import math

import torch


def teacher_forced(model, prompt, completion, temperature=1.0, top_k=0, top_p=1.0):
    """log p(completion_t | prompt, completion_<t) from one forward pass, warped like HF's sampling warpers."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)].float()
    scores = logits / temperature
    if top_k > 0:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return torch.log_softmax(scores, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def max_logprob_error(model, groups) -> float:
    """The largest |behaviour log-prob - teacher-forced log-prob| (temperature 1, no truncation) over every
    completion of ``groups`` (``CompletionGroup``s)."""
    worst = 0.0
    for group in groups:
        for c in group.completions:
            ref = teacher_forced(model, list(group.prompt_token_ids), list(c.token_ids))
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst
