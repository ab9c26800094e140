"""Run set-up and tear-down: process groups, tokenizer, data, the Megatron and rollout engines, rewards, the
pruner, and the restored state, gathered in one :class:`~megatron_dppo.run.state.Run`; a rollout worker's half
(:func:`setup_worker`); and the weight push every phase shares (trainer -> rollout engine or rollout workers)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from megatron_dppo.config import Config
from megatron_dppo.distributed import collectives as D
from megatron_dppo.distributed.placement import connect_trainer
from megatron_dppo.run.build import (
    build_env,
    build_handover,
    build_hf_config,
    build_loss,
    build_pruner,
    build_rollout,
    build_scorer,
    build_tokenizer,
    check_output_dirs,
    check_pretrained_weights,
    eos_ids,
    full_hf_config,
    is_converted_checkpoint,
    load_eval_sets,
    load_train_prompts,
    moe_options,
    probe_chat,
    quiet_logs,
    resolve_model_dir,
    torch_dtype,
    train_sources,
)
from megatron_dppo.run.console import print_banner
from megatron_dppo.run.lifecycle import find_resume_checkpoint, lock_output_dir, restore
from megatron_dppo.run.lora import check_lora_run, lora_config, rollout_weights, start_adapters
from megatron_dppo.run.metrics import MetricsSink
from megatron_dppo.run.reward_model import build_reward_model
from megatron_dppo.run.state import RolloutSide, Run, TrainSide


def setup(cfg: Config, *, resume: bool = True, need_eval: bool = False) -> Run:
    """Process groups, tokenizer, data, Megatron engine, rollout engine, rewards, pruner; restore a checkpoint."""
    from megatron_dppo.megatron.engine import PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import initialize_parallel, validate_parallel

    quiet_logs()
    parallel = cfg.parallel  # (the engine reads the parallel section itself)
    D.pick_free_port_if_single_process()
    link = connect_trainer(cfg) if cfg.rollout.placement == "separate" else None  # (before Megatron's groups)
    info = initialize_parallel(parallel, cfg.model.init_seed)
    D.set_cpu_threads(info.local_world_size, cfg.train.cpu_threads)
    out_dir = Path(cfg.train.output_dir)

    # 1. everything that can be wrong with the inputs fails here, before anything is written or overwritten
    check_output_dirs(cfg)
    scorer = build_scorer(cfg, train_sources(cfg))  # imports a user's reward module: before any write
    tokenizer = build_tokenizer(cfg)
    reward_model = build_reward_model(cfg, tokenizer) if link is None else None  # (separate: on the workers)
    env_factory, chat = build_env(cfg, tokenizer)  # (multi-turn episodes; imports a user's environment module)
    model_dir = resolve_model_dir(cfg)
    hf_config = build_hf_config(cfg, tokenizer, model_dir)
    probe_chat(cfg, chat, eos_ids(tokenizer, hf_config))  # a chat template episodes cannot run on: before step 0
    arch = ModelArch.from_hf_config(hf_config)
    validate_parallel(arch, parallel, D.world_size())
    check_pretrained_weights(cfg, model_dir, arch)
    if cfg.rollout.engine == "vllm" and cfg.parallel.pp > 1:
        raise ValueError("rollout.engine=vllm with parallel.pp > 1 is not supported (vLLM is colocated per TP "
                         "group); use parallel.pp=1 or rollout.engine=hf")

    loss_cfg, estimator = build_loss(cfg)
    lora = lora_config(cfg, arch)  # model.lora (None: every weight trains); run/lora.py
    check_lora_run(cfg, arch, parallel, lora, model_dir, loss_cfg.kl_coef)
    train_prompts, sft_pairs = load_train_prompts(cfg, tokenizer, arch)
    if cfg.train.sft_steps and not sft_pairs:
        raise ValueError("train.sft_steps > 0 needs gold completions: only data.task=arithmetic provides them "
                         "(set train.sft_steps=0)")
    eval_sets = load_eval_sets(cfg, tokenizer, arch) if (cfg.eval.every or cfg.eval.every_cpu_s or need_eval) \
        else {}
    eval_scorers = {name: build_scorer(cfg, [name], cfg.eval.reward, step_budget=False) for name in eval_sets}
    lock = lock_output_dir(out_dir)  # before the first write: a second run into this folder stops here
    found = find_resume_checkpoint(cfg) if resume else None

    # 2. the engines, and the two halves of a step that use them
    # the trainer owns the schedule (train/loop.py: rl_learning_rate, set each update): the engine's is constant
    optim = replace(cfg.optim, min_lr=0.0, scheduler="constant", warmup_steps=0)
    engine = PolicyEngine(arch, parallel, optim, loss_cfg,
        dtype=torch_dtype(cfg.model.dtype), attention_backend=cfg.model.attention_backend, lora=lora,
        **moe_options(cfg, arch))
    rollout = build_rollout(cfg, hf_config, model_dir, tokenizer, lora) if link is None else None  # (separate: workers)
    pruner = build_pruner(cfg, loss_cfg, estimator)
    rollout_side = RolloutSide(
        cfg=cfg, tokenizer=tokenizer, engine=rollout, handover=build_handover(cfg, engine, rollout, arch),
        eos_ids=eos_ids(tokenizer, hf_config), scorer=scorer, train_prompts=train_prompts,
        sampler=prompt_sampler(cfg, len(train_prompts)), pruner=pruner,
        eval_sets=eval_sets, eval_scorers=eval_scorers,
        reward_model=reward_model, env_factory=env_factory, chat=chat)
    train_side = TrainSide(cfg=cfg, engine=engine, loss_cfg=loss_cfg, estimator=estimator, pruner=pruner,
                           pad_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0))

    sink = MetricsSink(out_dir, enabled=D.is_main(), jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                       wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, run_config=cfg.to_dict())
    run = Run(cfg=cfg, info=info, hf_config=hf_config, arch=arch, rollout_side=rollout_side, train_side=train_side,
              sink=sink, sft_pairs=sft_pairs, lock=lock, link=link)

    # 3. state: a checkpoint, or pretrained weights, or the fresh initialization (LoRA: the frozen base always comes
    #    from model.path, a checkpoint holds the adapters only; a fresh start may take model.lora.init's adapter)
    if model_dir is not None and cfg.model.path is not None and (found is None or lora is not None):
        load_pretrained(run, model_dir)
    if lora is not None:
        start_adapters(engine, cfg, model_dir, fresh=found is None)
    if found is not None:
        restore(run, found)

    # 4. outputs (checkpoints/hf: config + tokenizer, so `megatron-dppo convert megatron-to-hf` exports a run)
    if D.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        hf_dir = Path(cfg.checkpoint_dir) / "hf"
        hf_dir.mkdir(parents=True, exist_ok=True)
        (hf_dir / "config.json").write_text(json.dumps(full_hf_config(hf_config), indent=1))
        tokenizer.save_pretrained(hf_dir)
    phase, position = run_phase_key(run)  # the global step of TensorBoard: warm-start steps, then RL steps
    sink.open(resume_key=(phase, position) if found is not None else None,
              tb_purge_step=(position if phase == 0 else cfg.train.sft_steps + position) if found is not None else None)
    if link is None or run.sft_step >= cfg.train.sft_steps:  # (separate: the workers wait for the RL weights)
        push_weights(run)  # the rollout engine always starts from the policy's exact weights
    if D.is_main() and cfg.logging.audit_log:
        run.audit = open_audit(out_dir / "audit.jsonl", run.rl_step if found is not None else None)
    if D.is_main():
        print_banner(run, found)
    return run


def setup_worker(cfg: Config, roles) -> RolloutSide:
    """A rollout worker's half of a run (``rollout.placement=separate``): tokenizer, prompts, sampler, pruner,
    history, reward scorers, eval sets (the workers evaluate) and the rollout engine; no Megatron engine.
    ``roles``: this job's ``dist.placement.Roles``."""
    from megatron_dppo.megatron.arch import ModelArch

    quiet_logs()
    D.set_cpu_threads(roles.trainers + roles.workers, cfg.train.cpu_threads)
    scorer = build_scorer(cfg, train_sources(cfg))
    tokenizer = build_tokenizer(cfg)
    reward_model = build_reward_model(cfg, tokenizer)  # scored here, overlapping the trainer's step
    env_factory, chat = build_env(cfg, tokenizer)  # (the workers run the episodes)
    model_dir = resolve_model_dir(cfg)
    hf_config = build_hf_config(cfg, tokenizer, model_dir)
    probe_chat(cfg, chat, eos_ids(tokenizer, hf_config))
    arch = ModelArch.from_hf_config(hf_config)
    loss_cfg, estimator = build_loss(cfg)
    prompts, _ = load_train_prompts(cfg, tokenizer, arch)
    eval_sets = load_eval_sets(cfg, tokenizer, arch) if cfg.eval.every else {}
    eval_scorers = {name: build_scorer(cfg, [name], cfg.eval.reward, step_budget=False) for name in eval_sets}
    rollout = build_rollout(cfg, hf_config, model_dir, tokenizer, lora_config(cfg, arch))
    return RolloutSide(
        cfg=cfg, tokenizer=tokenizer, engine=rollout, handover=build_handover(cfg, None, rollout, arch),
        eos_ids=eos_ids(tokenizer, hf_config), scorer=scorer, train_prompts=prompts,
        sampler=prompt_sampler(cfg, len(prompts)),
        pruner=build_pruner(cfg, loss_cfg, estimator), eval_sets=eval_sets,
        eval_scorers=eval_scorers, reward_model=reward_model, env_factory=env_factory, chat=chat)


def prompt_sampler(cfg: Config, num_prompts: int):
    """The seeded, resumable prompt sampler (``data.PromptSampler``); with rollout.overprovision > 0 wrapped with
    the pending prompts (``rollout.pending.PendingPrompts``), whose state it carries."""
    from megatron_dppo.data import PromptSampler

    sampler = PromptSampler(num_prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    if cfg.rollout.overprovision:
        from megatron_dppo.rollout.pending import PendingPrompts
        return PendingPrompts(sampler)
    return sampler


def open_audit(path: Path, resume_step: int | None):
    """The audit trail, keeping on resume only the lines of the steps before ``resume_step`` (a copy of the file
    is kept when lines are dropped: ``metrics.rewrite_jsonl``)."""
    from megatron_dppo.run.metrics import rewrite_jsonl

    rewrite_jsonl(path, lambda rec: resume_step is not None and rec.get("step", resume_step) < resume_step)
    return open(path, "a", encoding="utf-8")


def run_phase_key(run: Run) -> tuple[int, int]:
    """Position in the metric stream: (0, sft step) during the warm start, (1, RL step) afterwards."""
    if run.sft_step < run.cfg.train.sft_steps:
        return (0, run.sft_step)
    return (1, run.rl_step)


def teardown(run: Run, clean: bool = True) -> None:
    """Close everything ``setup`` opened; ``clean``: the run ended without an error (separate placement: only
    then are the rollout workers sent the stop message they wait for)."""
    if run.link is not None:
        run.link.close(clean)
    run.sink.close()
    if run.audit is not None:
        run.audit.close()
    for scorer in [run.rollout_side.scorer, *run.rollout_side.eval_scorers.values()]:
        scorer.close()
    if run.rollout_side.reward_model is not None:
        run.rollout_side.reward_model.close()
    from megatron_dppo.megatron.parallel import destroy_parallel
    D.barrier()
    if run.lock is not None:
        run.lock.release()
    destroy_parallel()


def load_pretrained(run: Run, model_dir: Path) -> None:
    """Fill the Megatron policy (and reference) from the pretrained weights: a converted Megatron checkpoint
    (resharded to this layout) or HF safetensors (each rank reads only its own TP shard / PP layers, checked
    against the config)."""
    from megatron_dppo.convert.checkpoint import load_hf_folder, load_model_dist_checkpoint
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.convert.weights import load_hf_weights

    engine = run.train_side.engine
    if model_dir.name == "hf" and is_converted_checkpoint(model_dir.parent):
        load_model_dist_checkpoint(engine.model_chunks, model_dir.parent / "model")
    elif run.cfg.model.hf_config:  # config overrides (e.g. a longer context): the architecture differs on purpose
        load_hf_weights(engine.modules, run.arch, HFCheckpoint(model_dir).get)
    else:
        load_hf_folder(engine.model_chunks, model_dir, run.arch)
    engine.optimizer.reload_model_params()
    if engine.reference_chunks is not None:
        engine.sync_reference_from_policy()


def push_weights(run: Run, version: int | None = None) -> int:
    """Stream the policy's weights (gathered over TP/PP, HF names) into this rank's rollout engine, in the memory
    order of ``rollout.handover.MemoryHandover``: empty the cache, wake the rollout weights, push (the KV cache
    wakes right before the next generation). Separate placement: send them to the rollout workers instead,
    stamped ``version`` (default: ``run.rl_step``, the weights the next RL step trains), with the prompt history
    the workers decide from, with the first version, where to start, and ``extra["eval"]``: the workers evaluate
    this version and send the result back (the trainer waits for it: ``train.loop.evaluation``). Due are the version
    before the first RL step (0) and every new version of ``eval_due``; not the restored version of a resumed run,
    evaluated before its checkpoint was written."""
    if run.link is None:
        return run.rollout_side.handover.push()
    version = run.rl_step if version is None else version
    new = version > run.rl_step  # an update's version; else the restored or warmed-up policy the RL phase starts from
    due = eval_due(run.cfg, version) if new else bool(run.cfg.eval.every) and version == 0
    side = run.rollout_side
    start, sampler = run.link.worker_start(run.rl_step, side.sampler.state_dict())
    extra = {"history": side.pruner.state_dict(), "rl_step": start, "sampler": sampler, "eval": due}
    # (LoRA: the base goes with this process's first version only; the workers keep it, later versions are adapters)
    stream = rollout_weights(run.train_side.engine, run.arch, run.cfg.rollout.weight_bucket_mb << 20,
                             base=run.link.versions_sent == 0)
    return run.link.send_weights(side.handover.metered(stream), version, extra)


def eval_due(cfg: Config, version: int) -> bool:
    """Whether the policy after ``version`` RL updates is evaluated (``eval.every``: every eval.every updates and
    after the last; the one before the first update is the trainer's own rule: an RL phase that starts at 0)."""
    return bool(cfg.eval.every) and version > 0 and (version % cfg.eval.every == 0 or version == cfg.train.steps)
