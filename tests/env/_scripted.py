"""A scripted rollout engine for the episode loop's tests: ``respond(context_ids) -> token ids`` decides each
turn from the exact context it is given (so the tests see what the loop conditions on), with deterministic
log-probs. It implements the RolloutEngine protocol; the loop, the token builder and the environments under test
are the real ones. The real engines are exercised in tests/rollout/test_episodes_hf.py."""
from __future__ import annotations

from megatron_dppo.rollout.base import Completion, CompletionGroup, SamplingParams


class ScriptedEngine:
    def __init__(self, respond, stop_ids=(2,)):
        self.respond = respond
        self.stop_ids = set(stop_ids)
        self.calls: list[tuple[list[list[int]], int, SamplingParams]] = []

    def generate(self, prompt_token_ids, n, sampling):
        self.calls.append(([list(p) for p in prompt_token_ids], n, sampling))
        groups = []
        for ids in prompt_token_ids:
            group = CompletionGroup(list(ids))
            for i in range(n):
                tokens = list(self.respond(list(ids), i))
                stop = next((k + 1 for k, t in enumerate(tokens) if t in self.stop_ids), None)
                if stop is not None and stop <= sampling.max_new_tokens:
                    tokens, finish = tokens[:stop], "stop"
                else:
                    tokens, finish = tokens[: sampling.max_new_tokens], "length"
                logprobs = [-0.01 * (1 + (7 * k + len(ids)) % 13) for k in range(len(tokens))]
                group.completions.append(Completion(tokens, logprobs, finish))
            groups.append(group)
        return groups

    def load_weights(self, weights):
        return 0

    def sleep(self):
        pass

    def wake_up(self, tags=None):
        pass
