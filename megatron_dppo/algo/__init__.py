"""The pure algorithm core (plain torch, no Megatron import).

advantages: group-relative advantage estimators (grpo, dr_grpo, rloo) with a registry.
pruning:    DPPO (unbiased, reweighted) and CPPO (baseline) pruners, prompt history, zero-variance filter.
losses:     PPO-clip / GSPO policy losses, KL estimators, aggregations with a fixed full-batch denominator,
            dual clip, rollout-correction (tis / mis) weights.
gradient_energy: the expected squared gradient norm of a group, m_G(k), per advantage estimator.
prompt_posterior: the discounted Beta posterior per prompt (the prompt level's state) and its keep probabilities.
screening:  screen k completions, continue with pi_c > 0, weight 1/(pi_q pi_c): two-phase, exactly unbiased.
step_cost:  the modelled step cost (generation + training) and the (r_q, r_o) it implies at a budget.
minibatches: the split of a step's prompts into PPO mini-batches (several updates per rollout).
decoupled:  the decoupled PPO objective (AReaL) for batches sampled by an older policy: behaviour log-probs from
            the rollout engine, proximal log-probs from the trainer, the behaviour ratio corrected by tis / mis.
"""
