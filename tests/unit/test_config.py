"""Config: YAML <- key=value overrides with type coercion; clear errors naming the key and valid values."""
from pathlib import Path

import pytest

from megatron_dppo.config import Config, all_keys, coerce, describe, load_config, parse_override

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARITH = ["data.task=arithmetic", "model.hf_config.model_type=qwen2"]


def _load(*overrides, path=None):
    return load_config(path, [*ARITH, *overrides])


def test_overrides_are_coerced_to_the_declared_type():
    cfg = _load("algo.r_q=0.25", "optim.lr=1e-5", "train.steps=7", "logging.tensorboard=false",
                "algo.history_ema=null", "eval.pass_k=2", "model.hf_config.hidden_size=64")
    assert cfg.algo.r_q == 0.25 and isinstance(cfg.algo.r_q, float)
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)   # YAML reads '1e-5' as a string
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.logging.tensorboard is False
    assert cfg.algo.history_ema is None
    assert cfg.model.hf_config == {"model_type": "qwen2", "hidden_size": 64}


def test_yaml_file_then_command_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data: {task: arithmetic}\nmodel: {hf_config: {model_type: llama}}\n"
                 "algo: {pruner: cppo, cppo_rate: 0.75}\ntrain: {steps: 3}\n")
    cfg = load_config(f, ["train.steps=5"])
    assert cfg.algo.pruner == "cppo" and cfg.algo.cppo_rate == 0.75 and cfg.train.steps == 5


def test_list_override(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("{}\n"), b.write_text("{}\n")
    cfg = _load(f"eval.files=[{a},{b}]")
    assert cfg.eval.files == [str(a), str(b)]
    assert _load(f"eval.files={a}").eval.files == [str(a)]


@pytest.mark.parametrize("override, must_name", [
    ("algo.rq=0.5", ["'algo.rq'", "algo.r_q"]),
    ("lgging.jsonl=true", ["'lgging.jsonl'", "logging.jsonl"]),
    ("train.stepz=3", ["'train.stepz'", "train.steps"]),
])
def test_unknown_key_names_it_and_close_matches(override, must_name):
    with pytest.raises(ValueError) as err:
        _load(override)
    for text in must_name:
        assert text in str(err.value)


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo: {r_qq: 0.1}\n")
    with pytest.raises(ValueError, match=r"unknown config key 'algo.r_qq'.*algo.r_q"):
        load_config(f)


@pytest.mark.parametrize("override, pattern", [
    ("algo.pruner=dpp", r"algo.pruner='dpp'.*'none', 'cppo', 'dppo'.*did you mean 'dppo'"),
    ("loss.preset=grpoo", r"loss.preset='grpoo'.*'grpo', 'dapo', 'gspo', 'dr_grpo'"),
    ("algo.r_q=1.0", r"algo.r_q=1.0.*\[0, 1\)"),
    ("algo.r_o=-0.1", r"algo.r_o=-0.1.*\[0, 1\)"),
    ("train.steps=abc", r"train.steps='abc'.*int"),
    ("train.group_size=1", r"train.group_size=1.*>= 2"),
    ("logging.jsonl=maybe", r"logging.jsonl='maybe'.*bool"),
    ("eval.pass_k=9", r"eval.pass_k=9.*eval.samples"),
    ("parallel.sp=true", r"parallel.sp=True.*tp == 1"),
    ("packing.capacity=16", r"packing.capacity=16.*> rollout.max_new_tokens=256"),
    ("reward.isolation=thread", r"reward.isolation=.thread.*.auto., .inline., .process."),
    ("train.steps", r"not of the form key.sub=value"),
    ("algo.r_q.x=1", r"algo.r_q is a float option"),
])
def test_validation_names_the_key_and_valid_values(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        _load(override)


@pytest.mark.parametrize("overrides, pattern", [
    (["rollout.tp=0"], r"rollout.tp=0 is invalid: expected >= 1"),
    (["rollout.placement=separate", "train.max_staleness=1", "rollout.engine=vllm", "rollout.workers=8",
      "rollout.tp=3"], r"rollout.tp=3 is invalid: expected a divisor of rollout.workers=8 .*\[1, 2, 4, 8\]"),
    (["rollout.engine=vllm", "rollout.tp=2"], r"rollout.tp=2 is invalid: expected 1 with rollout.placement="
                                              r"colocated and rollout.engine=vllm .*parallel.tp"),
    (["rollout.placement=separate", "rollout.workers=2", "rollout.tp=2"],
     r"rollout.tp=2 is invalid: expected 1 with rollout.placement=separate and rollout.engine=hf"),
])
def test_rollout_tp_is_a_divisor_of_the_vllm_rollout_workers(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        _load(*overrides)


def test_rollout_tp_splits_the_vllm_rollout_workers_into_engines():
    cfg = _load("rollout.placement=separate", "train.max_staleness=1", "rollout.engine=vllm", "rollout.workers=8",
                "rollout.tp=2")
    assert (cfg.rollout.workers, cfg.rollout.tp) == (8, 2)
    assert _load().rollout.tp == 1


def test_missing_data_file_is_named():
    with pytest.raises(ValueError, match=r"data.train_files: file '/nonexistent/x.jsonl' does not exist"):
        load_config(None, ["model.hf_config.model_type=qwen2", "data.train_files=[/nonexistent/x.jsonl]"])


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)


def test_every_option_is_documented():
    text = describe()
    for key in all_keys():
        assert f"  {key}:" in text, key
    undocumented = [k for k in all_keys() if _help(k) == ""]
    assert not undocumented, undocumented


def _help(key):
    """The help of ``key``, in its section (a nested section such as reward.model too)."""
    import dataclasses
    import typing

    *sections, name = key.split(".")
    cls = Config
    for section in sections:  # (an optional section, e.g. model.lora: Optional[LoraSection])
        tp = typing.get_type_hints(cls)[section]
        cls = tp if dataclasses.is_dataclass(tp) else next(a for a in typing.get_args(tp) if a is not type(None))
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


LORA = ["model.path=/tmp"]  # (model.lora needs pretrained weights; the folder is not read at load time)


def test_lora_section_is_off_by_default_on_from_yaml_or_one_key_and_off_again(tmp_path):
    from megatron_dppo.config.sections import LoraSection

    assert _load(*LORA).model.lora is None
    assert _load(*LORA, "model.lora.rank=8").model.lora == LoraSection(rank=8)  # one key turns it on
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /tmp, lora: {rank: 4, alpha: 8, target_modules: [qkv, fc2]}}\n")
    cfg = load_config(f, [*ARITH, "model.lora.dropout=0.1"])
    assert cfg.model.lora == LoraSection(rank=4, alpha=8.0, dropout=0.1, target_modules=["qkv", "fc2"])
    assert load_config(f, [*ARITH, "model.lora=null"]).model.lora is None
    assert _load(*LORA, "model.lora={rank: 2}").model.lora.rank == 2
    again = tmp_path / "again.yaml"  # --print-config's YAML loads back to the same config
    again.write_text(cfg.to_yaml())
    assert load_config(again).model.lora == cfg.model.lora
    assert "model.lora.rank" in all_keys() and "[model.lora]" in describe()


@pytest.mark.parametrize("override, pattern", [
    ("model.lora.rank=0", r"model.lora.rank=0 is invalid: expected null or an integer >= 1"),
    ("model.lora.alpha=-1", r"model.lora.alpha=-1.0 is invalid"),
    ("model.lora.dropout=1", r"model.lora.dropout=1.0 is invalid: expected a number in \[0, 1\)"),
    ("model.lora.target_modules=[qkv,q_proj]", r"unknown: \['q_proj'\]"),
    ("model.lora.init=/nonexistent/adapter", r"model.lora.init='/nonexistent/adapter' is invalid"),
    ("model.lora.rnk=3", r"unknown config key 'model.lora.rnk'; did you mean model.lora.rank"),
])
def test_lora_section_errors_name_the_bad_value(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        _load(*LORA, override)


def test_lora_needs_pretrained_weights_and_names_its_targets_as_the_engine_does():
    from megatron_dppo.config.sections import LORA_TARGETS
    from megatron_dppo.megatron.lora import VALID_TARGETS

    with pytest.raises(ValueError, match="model.lora is set but model.path is null"):
        _load("model.lora.rank=4")
    assert LORA_TARGETS == VALID_TARGETS


def test_coerce_rejects_wrong_types():
    with pytest.raises(ValueError):
        coerce("x", True, int)
    with pytest.raises(ValueError):
        coerce("x", 1.5, int)
    assert coerce("x", "3", int) == 3 and coerce("x", "2.0", int) == 2


def test_parse_override_yaml_values():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("--a.b=x=y") == ("a.b", "x=y")


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_parse(name):
    """Every shipped recipe loads (file existence checks are skipped: data may be absent on this machine)."""
    cfg = load_config(EXAMPLES / name, validate=False)
    for section in ("model", "parallel", "rollout", "algo", "loss", "optim", "packing", "train", "checkpoint",
                    "logging"):
        getattr(cfg, section).validate()


@pytest.mark.parametrize("overrides, named", [
    (["data.dataset=gsm8k"], r"data.dataset='gsm8k' \(only data.task=files reads it; data.task=arithmetic"),
    (["data.procedural_task=addition"], r"data.procedural_task='addition' \(only data.task=procedural reads it\)"),
    (["data.task=procedural", "data.train_files=[a.jsonl]"], r"data.train_files=\['a.jsonl'\] \(only data.task=files"),
    (["data.train_files=[a.jsonl]"], r"data.train_files=\['a.jsonl'\]"),
    (["algo.pruner=cppo", "algo.r_q=0.7"], r"algo.r_q=0.7 \(only algo.pruner=dppo reads it\)"),
    (["algo.pruner=dppo", "algo.cppo_rate=0.3"], r"algo.cppo_rate=0.3 \(only algo.pruner=cppo reads it\)"),
    (["rollout.gpu_memory_utilization=0.8"], r"rollout.gpu_memory_utilization=0.8 \(only rollout.engine=vllm"),
    (["rollout.worker_timeout_s=30"], r"rollout.worker_timeout_s=30.0 \(only rollout.placement=separate"),
])
def test_an_option_the_configuration_does_not_use_is_refused_by_name(overrides, named):
    """data.dataset with data.task=arithmetic used to be ignored silently (the run trained on arithmetic); every
    such pair of Config.UNUSED_WHEN is an error naming the option, its value and why."""
    with pytest.raises(ValueError, match="options that this configuration does not use: .*" + named):
        _load(*overrides)


def test_the_unused_option_rules_name_real_options_and_defaults_pass():
    from megatron_dppo.config.root import UNUSED_WHEN

    keys = set(all_keys())
    for options, selectors, _unused, _why in UNUSED_WHEN:
        assert {selectors} <= keys if isinstance(selectors, str) else set(selectors) <= keys, selectors
        assert set(options) <= keys, set(options) - keys
    _load()  # every option at its default: nothing refused, whatever the conditions
    # a feature turned off by its own switch keeps its tuning quietly: one override turns it off
    _load("train.sft_steps=0", "train.sft_lr=0.01", "dynamic_sampling.max_rounds=3", "overlong.penalty=0.5",
          "optim.min_lr=1e-7", "algo.pruner=none", "algo.r_q=0.7", "algo.cppo_rate=0.3")
    files = load_config(None, ["data.task=files", "data.dataset=gsm8k", "data.subset=main", ARITH[1]])
    assert files.data.dataset == "gsm8k"  # used there
    with pytest.raises(ValueError, match="data.arithmetic_max_operand=5 \\(only data.task=arithmetic reads it\\)"):
        load_config(None, ["data.task=files", "data.dataset=gsm8k", "data.arithmetic_max_operand=5", ARITH[1]])


def test_a_choice_changed_on_the_command_line_quiets_the_files_options_for_the_old_choice(tmp_path):
    """``--config examples/qwen3-4b-math.yaml rollout.engine=hf`` is how a user switches engines: the file's vLLM
    tuning is switched off by the override, not refused. An option given on the command line beside it is still
    refused, and so is a file that contradicts itself."""
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  hf_config: {model_type: qwen2}\ndata:\n  task: arithmetic\n"
                    "  arithmetic_max_operand: 5\nrollout:\n  engine: vllm\n  gpu_memory_utilization: 0.8\n")
    cfg = load_config(path, ["data.task=files", "data.dataset=gsm8k", "rollout.engine=hf"])
    assert (cfg.data.task, cfg.rollout.engine) == ("files", "hf")
    with pytest.raises(ValueError, match=r"data.arithmetic_max_operand=7 \(only data.task=arithmetic reads it\)"):
        load_config(path, ["data.task=files", "data.dataset=gsm8k", "data.arithmetic_max_operand=7"])
    path.write_text("model:\n  hf_config: {model_type: qwen2}\ndata:\n  task: files\n  dataset: gsm8k\n"
                    "  arithmetic_max_operand: 5\n")
    with pytest.raises(ValueError, match=r"data.arithmetic_max_operand=5 \(only data.task=arithmetic reads it\)"):
        load_config(path)


# --------------------------------------------------------------------------------------------------------------
# The env section (multi-turn episodes): optional, absent by default
# --------------------------------------------------------------------------------------------------------------
def test_env_section_is_absent_by_default_and_built_from_yaml_or_overrides(tmp_path):
    from megatron_dppo.env import EnvConfig

    assert load_config(None, ARITH).env is None
    path = tmp_path / "env.yaml"
    path.write_text("env:\n  name: calculator\n  max_turns: 3\n  max_tokens: 256\n  kwargs: {max_calls: 2}\n")
    cfg = load_config(path, ARITH + ["env.step_timeout_s=5", "env.kwargs.max_digits=12"])
    assert cfg.env == EnvConfig(name="calculator", max_turns=3, max_tokens=256, step_timeout_s=5.0,
                                kwargs={"max_calls": 2, "max_digits": 12})
    assert cfg.trained_token_limit == 256 and cfg.completion_budget == 256
    assert load_config(path, ARITH + ["env=null"]).env is None
    # a config written by a run (config.yaml) loads back to the same config, with and without the section
    for c in (cfg, load_config(None, ARITH)):
        again = tmp_path / "again.yaml"
        again.write_text(c.to_yaml())
        assert load_config(again).to_dict() == c.to_dict()


@pytest.mark.parametrize("overrides, message", [
    (["env.max_turns=2"], "set env.name first"),
    (["env.name=noop", "env.max_tokens=256", "env.max_turn=2"], "did you mean env.max_turns"),
    (["env.name=noop", "env.max_tokens=256", "env.max_turns=0"], "env.max_turns must be an integer >= 1"),
    (["env.name=noop", "env.max_tokens=256", "env.max_turns.x=1"], "not a mapping option"),
    (["env.name=noop", "env.max_tokens=256", "env.max_assistant_tokens=300"], "exceeds env.max_tokens"),
    (["env.name=noop", "env.max_tokens=2048"], "packing.capacity=1024 is invalid: expected > env.max_tokens=2048"),
    (["env.name=noop", "env.max_tokens=100", "env.max_assistant_tokens=10", "overlong.buffer=20"],
     "overlong.buffer=20 is invalid: expected <= env.max_assistant_tokens=10"),
    (["algo.dppo_keep_cost=tokens"], "algo.dppo_keep_cost"),
])
def test_env_section_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, ARITH + overrides)


def test_env_fields_set_after_loading_are_validated():
    cfg = load_config(None, ARITH + ["env.name=noop", "env.max_tokens=256"])
    cfg.env.token_check = "loose"
    with pytest.raises(ValueError, match="env.token_check"):
        cfg.validate()


def test_posterior_screening_and_planner_options():
    """The posterior's options are refused where another prompt rule reads the history in their place (and the
    history's EMA under the posterior); screening and the planner need the posterior, but algo.pruner=none turns
    them off quietly; a screen must leave completions to continue."""
    with pytest.raises(ValueError, match=r"algo.posterior_gamma=2.0 \(only algo.dppo_keep=posterior and algo.pruner"):
        _load("algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.posterior_gamma=2")
    with pytest.raises(ValueError, match=r"algo.history_ema=0.5 \(algo.dppo_keep=posterior keeps the prompt"):
        _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.history_ema=0.5")
    with pytest.raises(ValueError, match="algo.screen_k=2 is invalid: expected 0 unless algo.pruner=dppo with"):
        _load("algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.screen_k=2")
    with pytest.raises(ValueError, match="algo.cost_budget=0.5 is invalid"):
        _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.screen_k=2", "algo.cost_budget=0.5")
    with pytest.raises(ValueError, match=r"algo.screen_k=8 is invalid: expected in \[1, train.group_size - 1"):
        _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.screen_k=8", "train.group_size=8")
    with pytest.raises(ValueError, match="algo.cost_budget=0.5 is invalid: expected null with rollout.placement"):
        _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.cost_budget=0.5", "rollout.placement=separate")
    off = _load("algo.pruner=none", "algo.dppo_keep=posterior", "algo.screen_k=2", "algo.cost_budget=0.5",
                "algo.posterior_gamma=2")
    assert off.algo.screens == 0 and not off.algo.planned
    on = _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.screen_k=2", "algo.screen_continue_fraction=0.3")
    assert on.algo.screens == 2
    _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.screen_continue_fraction=0.3")  # screening off: quiet


@pytest.mark.parametrize("extra, named", [
    (["reward.model.path=/tmp"], "0 with reward.model.path"),
    (["env.name=noop", "env.max_tokens=256"], "0 with an env section"),
    (["overlong.filter=true"], r"0 with overlong.filter=true \(its denominator"),
])
def test_screening_is_refused_where_the_screens_cannot_be_joined(extra, named):
    """Screening's continuation rule reads binary rule rewards and joins single-turn screens to their continuations:
    a reward model's continuous scores and multi-turn episodes are refused by name, not trained wrongly. Overlong
    filtering's denominator counts the finished completions of the generated groups over pi_q pi_c (it depends on
    the draw, and the weight 1/(pi_q pi_c) is then no longer unbiased): refused as token_mean is."""
    with pytest.raises(ValueError, match="algo.screen_k=2 is invalid: expected " + named):
        _load("algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.screen_k=2", *extra)


def test_the_optim_section_is_the_engines_optimizer_configuration():
    """One class: the loaded section drives the engine's schedule (``lr_at_step``) under its own field names."""
    from megatron_dppo.algo.lr_schedule import lr_at_step
    from megatron_dppo.megatron.engine import OptimConfig  # (the engine's own import: one class)

    cfg = load_config(None, ["optim.scheduler=cosine", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=2",
                             "optim.grad_clip=0.5", "optim.distributed_optimizer=true"], validate=False)
    cfg.optim.validate()
    assert type(cfg.optim) is OptimConfig
    assert lr_at_step(cfg.optim, 0, cfg.optim.lr, cfg.optim.min_lr, total_steps=10) == pytest.approx(5e-4)
    assert lr_at_step(cfg.optim, 10, cfg.optim.lr, cfg.optim.min_lr, total_steps=10) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match=r"optim.scheduler='cosine' needs total_steps"):
        lr_at_step(cfg.optim, 3, 1e-3, 1e-4)
    with pytest.raises(ValueError, match=r"optim.min_lr=0.1 is invalid"):  # built in code: the same checks
        OptimConfig(lr=1e-3, min_lr=0.1)


def test_every_loss_option_reaches_the_loss():
    """The loss section is the loss code's own class: its options are its fields but the one the run sets
    (temperature, from rollout.temperature), and each option set on the command line is what the loss reads."""
    from dataclasses import fields

    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.run.build import build_loss

    assert type(Config().loss) is LossConfig
    names = {k.split(".", 1)[1] for k in all_keys() if k.startswith("loss.")}
    assert names == {f.name for f in fields(LossConfig)} - {"temperature"}
    values = {"preset": "dapo", "policy_loss": "gspo", "eps_low": 0.1, "eps_high": 0.3, "kl_coef": 0.02,
              "kl_estimator": "k2", "aggregation": "token_mean", "advantage_estimator": "rloo", "advantage_eps": 1e-3,
              "clip_ratio_c": 4.0, "kl_clamp": 5.0, "rollout_correction": "mis", "rollout_correction_cap": 3.0,
              "rollout_correction_cap_low": 0.5, "gspo_gradient": "stop_gradient", "gspo_log_ratio_cap": 7.0,
              "kl_bias_correction": True}
    assert set(values) == names
    loss, estimator = build_loss(load_config(None, [f"loss.{k}={v}" for k, v in values.items()] +
                                             ["rollout.temperature=0.5"], validate=False))
    assert {k: getattr(loss, k) for k in values} == values and (estimator, loss.temperature) == ("rloo", 0.5)
    with pytest.raises(ValueError, match="unknown config key 'loss.temperature'"):  # the run sets it, not the file
        load_config(None, ["loss.temperature=0.5"], validate=False)
    assert "temperature" not in Config().to_dict()["loss"]


@pytest.mark.parametrize("extra, named", [
    (["overlong.buffer=2"], "overlong.buffer=2 is invalid: expected 0"),
    (["reward.model.path=/tmp"], "reward.model.path='/tmp' is invalid: expected null"),
    (["rollout.placement=separate"], "rollout.placement='separate' is invalid: expected colocated"),
    (["algo.posterior_rewards=continuous"], "algo.posterior_rewards='continuous' is invalid: expected auto or binary"),
    (["logging.audit_every=5"], "logging.audit_every=5 is invalid: expected 0"),
])
def test_adaptive_group_sizes_are_refused_where_the_allocation_cannot_run(extra, named):
    """The allocation reads a Beta posterior of binary rewards and draws its slots where the step trains."""
    with pytest.raises(ValueError, match=named):
        _load("algo.pruner=adaptive", "loss.advantage_estimator=rloo", *extra)


def test_adaptive_options_are_refused_under_another_pruner_and_the_pruner_refuses_grpo():
    from megatron_dppo.run.build import build_loss, build_pruner

    with pytest.raises(ValueError, match=r"algo.adaptive_budget=0.3 \(only algo.pruner=adaptive reads it\)"):
        _load("algo.pruner=dppo", "algo.adaptive_budget=0.3")
    with pytest.raises(ValueError, match=r"algo.r_q=0.3 \(only algo.pruner=dppo reads it\)"):
        _load("algo.pruner=adaptive", "loss.advantage_estimator=rloo", "algo.r_q=0.3")
    for estimator, named in (("grpo", "grpo's std normalisation"), ("dr_grpo", "needs loss.advantage_estimator=rloo")):
        cfg = _load("algo.pruner=adaptive", f"loss.advantage_estimator={estimator}")
        with pytest.raises(ValueError, match=named):
            build_pruner(cfg, *build_loss(cfg))
    cfg = _load("algo.pruner=adaptive", "loss.advantage_estimator=rloo", "loss.preset=dapo")
    with pytest.raises(ValueError, match="token_mean"):
        build_pruner(cfg, *build_loss(cfg))
