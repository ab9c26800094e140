"""Multi-turn episodes on any rollout engine: G episodes per prompt, one batched ``generate`` per turn.

    episodes = generate_episodes(engine, tasks, prompt_ids, n, sampling, env_cfg, make_env, chat)

Turn 1 is ``engine.generate(prompt_ids, n, sampling)``: the very call (same prompts, seed and bound) a single-turn
rollout makes, so an environment that ends every episode after one turn (``noop``) gives the single-turn
completions bit for bit. Every later turn is ONE ``engine.generate(contexts, 1, ...)`` over the episodes still
running (grouped by their remaining token budget), where each context is the episode's own stream: prompt ids,
sampled ids verbatim, observation ids from the chat template (``env/tokens.py``). Both engines take token ids, so
nothing is ever decoded and re-encoded; vLLM's prefix cache reuses every earlier turn.

Between turns the environments of the episodes step in parallel threads, each bounded by ``env.step_timeout_s``
(an exception, a timeout or a malformed step ends that episode with ``env_error``; a thread stuck in user code is
abandoned, the run goes on). Bounds per episode: ``env.max_turns`` assistant turns, ``env.max_tokens`` tokens
after the prompt (sampled and observation), ``env.max_assistant_tokens`` sampled tokens, and the engine's
``sampling.max_new_tokens`` per turn. Finish reasons: ``env/protocol.py``.

Seeds (``dist.collectives.derive_seed``, to 31 bits): turn 1 uses ``sampling.seed``; turn t > 1, budget group g
uses a seed derived from (sampling.seed, t, g); environment e (prompt p, sample i) is reset with a seed derived
from (``env_seed``, p, i). With a fixed seed the episodes are reproducible, so a resumed run replays them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_dppo.distributed import collectives as D
from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.protocol import Environment, MalformedStep, Task, Turn, check_messages, check_step
from megatron_dppo.env.tokens import (
    ChatTokens,
    TokenDriftError,
    Trajectory,
    audit_render,
    check_episode,
    conversation_messages,
)
from megatron_dppo.rollout.base import RolloutEngine, SamplingParams

logger = logging.getLogger("megatron_dppo.rollout")
_warned_render = False


@dataclass
class Episode:
    """One finished episode (see ``env/tokens.py`` for the token fields).

    prompt_ids:      the prompt the episode started from (the task's, or re-rendered with ``reset`` messages):
                     the context every turn was sampled from and every sequence built of the episode starts with
    reset_messages:  the messages ``reset`` added after the task's (usually none)
    token_ids / loss_mask / logprobs: the stream after the prompt and its per-token data (behaviour log-probs)
    finish_reason:   ``env.protocol.FINISH_REASONS``
    reward:          sum of the environment's step rewards
    turns:           assistant turns sampled; tool_calls / tool_errors / tool_timeouts: summed over steps
    texts:           each assistant turn decoded without special tokens (the answer is ``texts[-1]``)
    messages:        the conversation after the prompt (assistant contents decoded, observation messages)
    seconds:         wall-clock time from reset to finish
    error:           the reason of an ``env_error`` finish, else None
    """

    prompt_ids: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    texts: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    reset_messages: list[dict] = field(default_factory=list)

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)

    @property
    def final_ids(self) -> list[int]:
        """The last assistant turn's sampled ids (its stop token included): the last run of loss-mask 1 in the
        stream (turns are separated by observations, which are never empty: they end with the generation prompt)."""
        end = len(self.loss_mask)
        while end and not self.loss_mask[end - 1]:
            end -= 1
        start = end
        while start and self.loss_mask[start - 1]:
            start -= 1
        return list(self.token_ids[start:end])

    @property
    def final_text(self) -> str:
        return self.texts[-1] if self.texts else ""


# --------------------------------------------------------------------------------------------------------------
# Environment calls with a deadline
# --------------------------------------------------------------------------------------------------------------
_TIMED_OUT = object()


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float, max_parallel: int = 32) -> list[Any]:
    """Run the zero-argument callables in daemon threads, at most ``max_parallel`` at once; per call its return
    value, the exception it raised, or ``_TIMED_OUT`` when it had not returned ``timeout_s`` after ITS start. A
    timed-out call's thread is abandoned (Python cannot kill a thread) and its slot freed, so a hung environment
    costs one thread, never the batch."""
    n = len(calls)
    results: list[Any] = [_TIMED_OUT] * n
    cond = threading.Condition()
    finished: set[int] = set()
    expired: set[int] = set()

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except BaseException as err:  # noqa: BLE001 - anything a user environment raises ends only its episode
            value = err
        with cond:
            if i not in expired:
                results[i] = value
            finished.add(i)
            cond.notify()

    running: dict[int, float] = {}  # call -> deadline
    started = 0
    with cond:
        while started < n or running:
            while started < n and len(running) < max(1, max_parallel):
                running[started] = time.monotonic() + timeout_s
                threading.Thread(target=run, args=(started, calls[started]), daemon=True,
                                 name=f"env-call-{started}").start()
                started += 1
            now = time.monotonic()
            for i, deadline in list(running.items()):
                if i in finished:
                    del running[i]
                elif deadline <= now:
                    expired.add(i)
                    del running[i]
            if running and not (started < n and len(running) < max_parallel):
                cond.wait(timeout=max(0.0, min(running.values()) - now))
    return results


# --------------------------------------------------------------------------------------------------------------
# One running episode
# --------------------------------------------------------------------------------------------------------------
class _Running:
    def __init__(self, env: Environment, task: Task, prompt_messages: list[dict], trajectory: Trajectory):
        self.env, self.task, self.prompt_messages, self.traj = env, task, prompt_messages, trajectory
        self.start = time.monotonic()
        self.sampled: list[tuple[list[int], list[float]]] = []
        self.contexts: list[list[int]] = []
        self.observations: list[list[dict]] = []
        self.texts: list[str] = []
        self.reward = 0.0
        self.counts = [0, 0, 0]  # tool calls, errors, timeouts
        self.finish: str | None = None
        self.error: str | None = None
        self.last_stop = False

    def end(self, reason: str, error: str | None = None) -> None:
        self.finish, self.error = reason, error
        self.seconds = time.monotonic() - self.start


def generate_episodes(engine: RolloutEngine, tasks: Sequence[Task], prompt_ids: Sequence[Sequence[int]], n: int,
                      sampling: SamplingParams, env_cfg: EnvConfig, make_env: Callable[[], Environment],
                      chat: ChatTokens, env_seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[list[Episode]]:
    """``n`` episodes per task, in task order (module docstring).

    ``prompt_ids[p]`` is task p's rendered prompt (used verbatim unless ``reset`` adds messages, then the prompt is
    re-rendered from ``task.messages`` + those messages); ``stop_token_ids``: the ids that end a turn besides
    ``sampling.stop_token_ids`` (the engine's EOS; they tell a stopped turn from a cut one)."""
    if len(tasks) != len(prompt_ids):
        raise ValueError(f"{len(tasks)} tasks but {len(prompt_ids)} prompts")
    stops = {int(t) for t in stop_token_ids} | set(sampling.stop_token_ids)
    running = _start(tasks, prompt_ids, n, env_cfg, make_env, chat, env_seed)

    # Turn 1: the single-turn call for the prompts whose n episodes all kept the task's prompt
    plain = [p for p in range(len(tasks))
             if all(e.finish is None and e.traj.prompt_ids == list(prompt_ids[p]) for e in running[p * n:(p + 1) * n])]
    if plain:
        budget = min(sampling.max_new_tokens, env_cfg.max_tokens, env_cfg.assistant_token_limit)
        groups = engine.generate([list(prompt_ids[p]) for p in plain], n, _bounded(sampling, budget, sampling.seed))
        for p, group in zip(plain, groups):
            for i, completion in enumerate(group.completions):
                _record(running[p * n + i], list(group.prompt_token_ids), completion, stops, chat)
    plain_set = set(plain)
    _generate_turn(engine, [e for k, e in enumerate(running) if k // n not in plain_set and e.finish is None],
                   sampling, env_cfg, stops, chat, turn=0)

    for turn in range(1, env_cfg.max_turns + 1):
        _step_environments([e for e in running if e.finish is None], env_cfg, chat,
                           last=turn == env_cfg.max_turns)
        _generate_turn(engine, [e for e in running if e.finish is None], sampling, env_cfg, stops, chat, turn=turn)
    return [[_finish(e, chat, env_cfg) for e in running[p * n:(p + 1) * n]] for p in range(len(tasks))]


def _start(tasks, prompt_ids, n, env_cfg, make_env, chat, env_seed) -> list[_Running]:
    """One environment per episode, reset in parallel (bounded by ``env.step_timeout_s``)."""
    running, calls = [], []
    for k in range(len(tasks) * n):
        p, i = divmod(k, n)
        try:
            env = make_env()
        except Exception as err:  # noqa: BLE001 - a failing factory ends only this episode
            env = _EnvFailure(f"building the environment raised {type(err).__name__}: {err}")
        running.append(_Running(None if isinstance(env, _EnvFailure) else env, tasks[p], list(tasks[p].messages),
                                Trajectory(list(prompt_ids[p]))))
        if isinstance(env, _EnvFailure):
            calls.append(lambda err=env: err)
        else:
            seed = D.derive_seed("env", env_seed, p, i) % (1 << 31)
            calls.append(lambda env=env, task=tasks[p], seed=seed: env.reset(task, seed))
    for e, result in zip(running, call_all(calls, env_cfg.step_timeout_s, env_cfg.max_parallel_steps)):
        try:
            extra = check_messages(_unwrap(result, "Environment.reset"), "Environment.reset")
            if extra:  # the prompt grows by the reset messages: rendered from the task's messages
                if not e.task.messages:
                    raise ValueError(f"Environment.reset returned messages for task {e.task.id!r}, which has no chat "
                                     "messages to render them after (its prompt is not a chat: use the chat template "
                                     "or an environment whose reset returns [])")
                e.prompt_messages = list(e.task.messages) + extra
                e.traj.prompt_ids = chat.prompt_ids(e.prompt_messages)
        except (MalformedStep, _EnvFailure) as err:
            e.end("env_error", str(err))
    return running


class _EnvFailure(RuntimeError):
    pass


def _unwrap(result: Any, what: str) -> Any:
    if isinstance(result, _EnvFailure):
        raise result
    if result is _TIMED_OUT:
        raise _EnvFailure(f"{what} timed out")
    if isinstance(result, BaseException):
        raise _EnvFailure(f"{what} raised {type(result).__name__}: {result}")
    return result


def _bounded(sampling: SamplingParams, max_new_tokens: int, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=sampling.stop_token_ids)


def _remaining(e: _Running, sampling: SamplingParams, env_cfg: EnvConfig) -> int:
    return min(sampling.max_new_tokens, env_cfg.max_tokens - len(e.traj.token_ids),
               env_cfg.assistant_token_limit - e.traj.num_trained)


def _generate_turn(engine, episodes: list[_Running], sampling: SamplingParams, env_cfg: EnvConfig, stops: set,
                   chat: ChatTokens, turn: int) -> None:
    """One ``generate`` per distinct remaining budget over ``episodes`` (n=1 each, its own context)."""
    by_budget: dict[int, list[_Running]] = {}
    for e in episodes:
        budget = _remaining(e, sampling, env_cfg)
        if budget < 1:
            e.end("length")
            continue
        by_budget.setdefault(budget, []).append(e)
    for g, budget in enumerate(sorted(by_budget)):
        members = by_budget[budget]
        seed = None if sampling.seed is None else D.derive_seed("turn", sampling.seed, turn, g) % (1 << 31)
        contexts = [e.traj.context() for e in members]
        groups = engine.generate(contexts, 1, _bounded(sampling, budget, seed))
        for e, context, group in zip(members, contexts, groups):
            _record(e, context, group.completions[0], stops, chat)


def _record(e: _Running, context: list[int], completion, stops: set, chat: ChatTokens) -> None:
    """Append a sampled turn; a turn that did not end at a stop token ends the episode with ``length``."""
    ids, logprobs = list(completion.token_ids), list(completion.logprobs)
    e.contexts.append(list(context))
    e.sampled.append((ids, logprobs))
    e.texts.append(chat.tokenizer.decode(ids, skip_special_tokens=True))
    e.traj.append_sampled(ids, logprobs)
    e.last_stop = bool(ids) and ids[-1] in stops and completion.finish_reason == "stop"
    if not e.last_stop:
        e.end("length")


def _step_environments(stepping: list[_Running], env_cfg: EnvConfig, chat: ChatTokens, last: bool) -> None:
    """Step the environment of every running episode (its last turn stopped); append the observations, or end
    the episode (done, an error, no room, or ``last``: the turn budget is spent)."""
    turns = [Turn(index=len(e.sampled) - 1, token_ids=tuple(e.sampled[-1][0]), text=e.texts[-1],
                  finish_reason="stop") for e in stepping]
    results = call_all([lambda e=e, t=t: e.env.step(t) for e, t in zip(stepping, turns)], env_cfg.step_timeout_s,
                       env_cfg.max_parallel_steps)
    for e, result in zip(stepping, results):
        try:
            step = check_step(_unwrap(result, "Environment.step"))
        except (MalformedStep, _EnvFailure) as err:
            e.end("env_error", str(err))
            continue
        e.reward += step.reward
        e.counts[0] += step.tool_calls
        e.counts[1] += step.tool_errors
        e.counts[2] += step.tool_timeouts
        end_id = e.sampled[-1][0][-1]
        if step.done or not chat.ends_turn(end_id):  # done, or a bare EOS the template never renders mid-chat
            e.end("stop")
        elif last:
            e.end("max_turns")
        elif e.traj.num_trained >= env_cfg.assistant_token_limit:  # no sampled token may follow
            e.end("length")
        else:
            obs_ids = chat.observation_ids(step.messages, end_id)
            if len(e.traj.token_ids) + len(obs_ids) >= env_cfg.max_tokens:
                e.end("context")
            else:
                e.observations.append(step.messages)
                e.traj.append_observation(obs_ids)


def _finish(e: _Running, chat: ChatTokens, env_cfg: EnvConfig) -> Episode:
    """Close the environment, run the token checks, build the Episode."""
    if e.env is not None and callable(getattr(e.env, "close", None)):
        call_all([e.env.close], min(env_cfg.step_timeout_s, 5.0))
    check_episode(e.traj, e.sampled, e.contexts)
    ends = [t for t in {ids[-1] for ids, _ in e.sampled if ids} if chat.ends_turn(t)]
    messages = conversation_messages(chat.tokenizer, e.traj, e.observations, ends)
    if env_cfg.token_check != "off" and e.sampled:
        problem = audit_render(chat, e.traj, e.prompt_messages, messages, final_stop=e.last_stop)
        if problem is not None:
            _report_render_problem(problem, env_cfg.token_check)
    return Episode(prompt_ids=e.traj.prompt_ids, token_ids=e.traj.token_ids, loss_mask=e.traj.loss_mask,
                   logprobs=e.traj.logprobs, finish_reason=e.finish,
                   reward=e.reward, turns=len(e.sampled), tool_calls=e.counts[0], tool_errors=e.counts[1],
                   tool_timeouts=e.counts[2], texts=e.texts, messages=messages, seconds=e.seconds, error=e.error,
                   reset_messages=e.prompt_messages[len(e.task.messages):])


def _report_render_problem(problem: str, mode: str) -> None:
    global _warned_render
    if mode == "strict":
        raise TokenDriftError(f"render audit (env.token_check=strict): {problem}")
    if not _warned_render:
        _warned_render = True
        logger.warning("render audit (env.token_check=warn, reported once): %s", problem)


# --------------------------------------------------------------------------------------------------------------
# Metrics of a batch of episodes
# --------------------------------------------------------------------------------------------------------------
def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """env/* and time/episode_* metrics: turns per episode, tool calls/errors/timeouts per episode, the share of
    every finish reason, episode time p50/p99 and their ratio, the share of trained (mask-1) tokens among the
    episodes' tokens after the prompt."""
    from megatron_dppo.env.protocol import FINISH_REASONS

    if not episodes:
        return {}
    n = len(episodes)
    tokens = sum(len(e.token_ids) for e in episodes)
    trained = sum(e.num_trained for e in episodes)
    seconds = [e.seconds for e in episodes]
    m = {"env/turns_mean": sum(e.turns for e in episodes) / n,
         "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
         "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
         "env/tool_timeouts": float(sum(e.tool_timeouts for e in episodes)),
         "env/reward_mean": sum(e.reward for e in episodes) / n,
         "tokens/trained_share": trained / tokens if tokens else 0.0,
         "time/episode_p50": _quantile(seconds, 0.5), "time/episode_p99": _quantile(seconds, 0.99)}
    m["time/episode_p99_over_p50"] = m["time/episode_p99"] / m["time/episode_p50"] if m["time/episode_p50"] else 0.0
    for reason in FINISH_REASONS:
        m[f"env/finish_{reason}"] = sum(e.finish_reason == reason for e in episodes) / n
    return m
