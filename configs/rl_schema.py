"""The RL sections: the algorithm (``rl``: advantages, policy loss, KL, rollout correction,
packing, placement, SFT warm start), the rollout runner (``rollout``) and the rewards
(``reward``). Cross-section rules (with ``sampler``, ``model``) live in
``configs/cross_section.py``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
    greater_than,
)


@dataclasses.dataclass(frozen=True)
class RLConfig(Section):
    _section = "rl"
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = field(
        "grpo", "Advantage estimator: grpo (group mean / population std; a group of equal "
                "rewards gets 0), drgrpo (group mean only), rloo "
                "(leave-one-out baseline), reinforce_pp (REINFORCE++: whitened over the batch's "
                "loss tokens).")
    policy_loss: Literal["ppo", "decoupled_ppo", "gspo"] = field(
        "decoupled_ppo", "Policy loss: ppo (ratio vs behaviour), decoupled_ppo (AReaL: ratio vs "
                         "the proximal policy times a capped behaviour weight), gspo "
                         "(sequence-level ratio).")
    eps_low: float = field(0.2, "Lower clip: the ratio is clipped at 1 - eps_low; in [0, 1).",
                           at_least(0.0))
    eps_high: float = field(0.28, "Upper clip: the ratio is clipped at 1 + eps_high (DAPO "
                                  "clip-higher when > eps_low).", at_least(0.0))
    aggregation: Literal["token_mean", "sequence_mean"] = field(
        "token_mean", "Loss aggregation: mean over all loss tokens, or mean of per-sequence "
                      "token means.")
    kl_coef: float = field(0.0, "Weight of the KL to the reference model; 0 disables.",
                           at_least(0.0))
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        "k3", "KL estimator (Schulman): k1 = log-ratio, k2 = half squared log-ratio, k3 = "
              "ratio - 1 - log-ratio.")
    kl_where: Literal["loss", "reward"] = field(
        "loss", "Apply the KL penalty in the loss, or subtract it from the sequence reward.")
    entropy_coef: float = field(0.0, "Weight of the entropy bonus; 0 disables.", at_least(0.0))
    dual_clip_c: float = field(0.0, "Dual-clip bound c for negative advantages; 0 disables, "
                                    "otherwise must be > 1.", at_least(0.0))
    behav_weight_cap: float = field(5.0, "decoupled_ppo: cap on pi_prox / pi_behav; tokens above "
                                         "it are not trained on (see rl.behav_cap_mode); 0 "
                                         "disables, otherwise must be >= 1.", at_least(0.0))
    rollout_correction: Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq",
                                "icepop"] = field(
        "none", "Rollout correction: weight rho = pi_old / pi_behav (trainer's pre-update vs the "
                "sampler's logprobs, stop-gradient) on every policy loss. tis_token / tis_seq: "
                "truncated IS min(rho, rl.correction_cap) per token / per sequence (verl "
                "rollout_is = token / sequence); mis_token / mis_seq: rho inside "
                "[rl.correction_low, rl.correction_high], tokens / sequences outside rejected "
                "(out of the loss and its normaliser; verl rollout_rs); icepop: rho inside the "
                "band, 0 outside, still counted in the normaliser. With decoupled_ppo it "
                "replaces the built-in behaviour weight (and rl.behav_weight_cap); with ppo "
                "and gspo (ratio already against the behaviour policy) mis_* and icepop only "
                "filter on the band and tis_* is refused.")
    correction_cap: float = field(2.0, "tis_*: truncation C of the rollout-correction weight "
                                       "(verl rollout_is_threshold); must be >= 1.", at_least(1.0))
    correction_low: float = field(0.5, "mis_* / icepop: lower end of the kept band of rho (IcePop "
                                       "alpha, verl rollout_rs_threshold_lower); in [0, 1], 0: "
                                       "no lower bound.", at_least(0.0))
    correction_high: float = field(5.0, "mis_* / icepop: upper end of the kept band of rho "
                                        "(IcePop beta, verl rollout_rs_threshold); must be >= 1 "
                                        "and > rl.correction_low.", at_least(1.0))
    adv_eps: float = field(1e-6, "Epsilon added to standard deviations in advantages.",
                           at_least(0.0))
    overlong_buffer: int = field(0, "DAPO soft overlong punishment: linear penalty over the last "
                                    "overlong_buffer tokens before overlong_max_len; 0 disables.",
                                 at_least(0))
    overlong_max_len: int = field(0, "Completion length at which the overlong penalty reaches "
                                     "-overlong_penalty; must exceed overlong_buffer when on.",
                                  at_least(0))
    overlong_penalty: float = field(1.0, "Largest overlong penalty (subtracted from the reward).",
                                    at_least(0.0))
    ppo_minibatches: int = field(
        1, "Optimizer updates per rollout batch and epoch: the batch's rows are split into this "
           "many strided minibatches, each one update (trainer.microbatches accumulate inside "
           "each). Every minibatch loss is divided by the whole batch's token (or sequence) "
           "count; decoupled PPO's proximal policy is the pre-batch one. Must divide the rows "
           "(cross-section rule). 1: one update per batch, as without minibatches.", at_least(1))
    ppo_epochs: int = field(1, "Passes over the minibatches of each rollout batch (same split "
                               "every pass).", at_least(1))
    pack_sequences: bool = field(
        True, "Pack each step's sequences into as few rows of trainer.seq_len as they fit "
              "(first-fit decreasing; the row count rounded up to a quarter of the batch, one "
              "compiled step per quarter). The loss is the same; the step then costs the tokens "
              "it trains on, not the padded batch.")
    placement: Literal["colocated", "split"] = field(
        "colocated", "Where the sampler runs: colocated (on the trainer's devices) or split (on "
                     "its own rl.sampler_devices devices, disjoint from the trainer's; one "
                     "process).")
    sampler_devices: int = field(0, "split: devices given to the sampler (the last n of "
                                    "jax.devices()); mesh.* must multiply to the remaining ones. "
                                    "Must be 0 when colocated.", at_least(0))
    release_sampler_cache: bool = field(
        True, "colocated: free the sampler's KV cache while the train step runs and allocate it "
              "again after the weight handoff (live sequences re-prefill under the new weights "
              "anyway), so the step has the cache's memory; the sampler then idles during the "
              "step. false: the cache stays allocated and, with rollout.max_staleness > 0, the "
              "sampler keeps decoding during the step. No effect with split.")
    release_sampler_weights: bool = field(
        False, "colocated, with rl.release_sampler_cache: free the sampler's weights for the "
               "train step as well; the handoff after every step refills them with the new "
               "version, so nothing is copied twice. With LoRA the sampler's frozen base stays "
               "(adapter-only handoffs merge into it); only the merged params go. Must be false "
               "with split (the sampler has its own devices).")
    sampler_expert: int = field(
        0, "The sampler mesh's expert axis: 0 keeps the trainer's (mesh.expert); n > 0 shards "
           "the sampler's expert weights n ways over its devices, its data axis filling the "
           "rest (colocated: the trainer's devices, so an MoE sampler holds 1/n of the expert "
           "weights a chip instead of 1/mesh.expert; its slots still split over every device). "
           "Must divide model.num_experts and, with several processes, each process's "
           "devices (each samples on its own); 0 with a dense model.", at_least(0))
    behav_cap_mode: Literal["zero", "drop"] = field(
        "zero", "decoupled_ppo: tokens above rl.behav_weight_cap get weight 0 but still count "
                "in the loss normaliser (zero, AReaL), or leave the loss mask with their KL and "
                "entropy terms (drop).")
    routing_replay: Literal["off", "rollout"] = field(
        "off", "MoE routing replay. rollout: the sampler records the experts each generated "
               "token was routed to, and every forward of the RL step (loss, proximal, KL "
               "reference) routes those tokens to the same experts (combine weights still "
               "from the trainer's router, so it learns; "
               "docs/moe.md). Needs an MoE model (model.num_experts > 0). off: nothing is "
               "recorded.")
    warm_start_steps: int = field(-1, "SFT warm-start steps before RL when model.hf_path is empty; "
                                      "-1: as many as trainer.steps, 0: no warm start. Must stay "
                                      "-1 or 0 with model.hf_path.", at_least(-1))
    warm_start_batch_size: int = field(8, "Sequences per step of the SFT warm start; the RL "
                                          "batch itself is rollout.prompts_per_step x "
                                          "rollout.group_size.", at_least(1))
    warm_start_lr: float = field(1e-3, "Peak learning rate of the SFT warm start (always AdamW); "
                                       "RL itself runs at trainer.learning_rate.",
                                 greater_than(0.0))

    def validate(self) -> None:
        if self.placement == "split" and self.sampler_devices < 1:
            raise ConfigError(f"rl.sampler_devices = {self.sampler_devices}: must be >= 1 when "
                              f"rl.placement = 'split'")
        if self.placement == "colocated" and self.sampler_devices != 0:
            raise ConfigError(f"rl.sampler_devices = {self.sampler_devices}: must be 0 when "
                              f"rl.placement = 'colocated' (the sampler shares the trainer's "
                              f"devices)")
        if self.release_sampler_weights and self.placement != "colocated":
            raise ConfigError(f"rl.release_sampler_weights = true: only with rl.placement = "
                              f"'colocated' (got {self.placement!r}: the sampler's weights sit "
                              f"on its own devices, freeing them gives the trainer nothing)")
        if self.release_sampler_weights and not self.release_sampler_cache:
            raise ConfigError("rl.release_sampler_weights = true: needs rl.release_sampler_cache "
                              "= true (a sampler that keeps its cache keeps decoding during the "
                              "train step, and it cannot decode without weights)")
        if self.eps_low >= 1.0:
            raise ConfigError(f"rl.eps_low = {self.eps_low}: must be < 1 (the ratio is clipped "
                              f"at 1 - eps_low > 0)")
        if 0.0 < self.dual_clip_c <= 1.0:
            raise ConfigError(f"rl.dual_clip_c = {self.dual_clip_c}: must be 0 (off) or > 1")
        if 0.0 < self.behav_weight_cap < 1.0:
            raise ConfigError(f"rl.behav_weight_cap = {self.behav_weight_cap}: must be 0 (off) "
                              f"or >= 1 (a cap below 1 masks on-policy tokens)")
        if self.rollout_correction.startswith("tis") and self.policy_loss in ("ppo", "gspo"):
            raise ConfigError(f"rl.rollout_correction = {self.rollout_correction!r} with "
                              f"rl.policy_loss = {self.policy_loss!r}: that loss's ratio is "
                              f"already against the behaviour policy, so a truncated IS weight "
                              f"would apply rho twice; use decoupled_ppo, or mis_token, mis_seq "
                              f"or icepop (there a filter on the band)")
        if self.correction_low > 1.0:
            raise ConfigError(f"rl.correction_low = {self.correction_low}: must be <= 1 (a band "
                              f"above 1 rejects on-policy tokens, rho = 1)")
        if self.correction_low >= self.correction_high:
            raise ConfigError(f"rl.correction_low = {self.correction_low}: must be < "
                              f"rl.correction_high = {self.correction_high}")
        if self.overlong_buffer and self.overlong_max_len <= self.overlong_buffer:
            raise ConfigError(f"rl.overlong_max_len = {self.overlong_max_len}: must be > "
                              f"rl.overlong_buffer = {self.overlong_buffer} when the overlong "
                              f"penalty is on")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    _section = "rollout"
    group_size: int = field(4, "Samples per prompt (a GRPO group).", at_least(1))
    prompts_per_step: int = field(8, "Prompts (groups) per optimizer step.", at_least(1))
    max_staleness: int = field(1, "Oldest allowed weight-version lag; 0 is synchronous RL.",
                               at_least(0))
    filter_equal_groups: bool = field(True, "Drop groups whose rewards are all equal (counted).")
    max_turns: int = field(1, "Model turns per episode; > 1 runs the multi-turn environment "
                              "agent.env (refused without one).", at_least(1))
    max_failed_groups: int = field(64, "Groups in a row (as they finish) that raise, none "
                                       "succeeding in between, before the run stops with the last "
                                       "error; fast failures outpace slow successes, so keep it "
                                       "well above (max_staleness + 1) x prompts_per_step. A "
                                       "broken reward pool stops the run at once.", at_least(1))
    max_filtered_in_a_row: int = field(
        256, "Groups in a row, as they finish, whose samples all got the same reward before the "
             "run stops with one line naming the reward's answer format (the newest checkpoint "
             "kept); with filter_equal_groups off, the run stops when the first this many scored "
             "groups all got one and the same reward. 0: never stop.", at_least(0))
    status_every_s: float = field(30.0, "While the trainer waits for a batch, log the filtered, "
                                        "kept and in-flight groups this often, in seconds.",
                                  greater_than(0.0))


@dataclasses.dataclass(frozen=True)
class RewardConfig(Section):
    _section = "reward"
    names: tuple[str, ...] = field(("math",), "Registered reward functions to combine.")
    weights: tuple[float, ...] = field((1.0,), "Weight of each reward in names.")
    timeout_s: float = field(5.0, "Per-call timeout; a timeout gives reward 0 and is counted.",
                             at_least(0.001))
    num_workers: int = field(2, "Reward process-pool size.", at_least(1))
    format_template: str = field("<think>...</think><answer>...</answer>",
                                 "Template of the 'format' reward; '...' is any non-blank text.")
    deadline_s: float = field(60.0, "A scoring call's pairs still queued this long after it was "
                                    "submitted score 0, counted in reward/deadline_zeros (bounds "
                                    "what bad completions add to a step); 0: no deadline.",
                              at_least(0.0))
    worker_memory_mb: int = field(4096, "Address-space limit (RLIMIT_AS) of each reward worker, "
                                        "MiB; a reward needing more scores a counted 0. 0: no "
                                        "limit.",
                                  ("must be 0 (no limit) or >= 256 (a worker needs ~100 MiB to "
                                   "start)", lambda v: v == 0 or v >= 256))

    def validate(self) -> None:
        if len(self.names) != len(self.weights):
            raise ConfigError(f"reward.weights = {self.weights}: needs one weight per name in "
                              f"reward.names = {self.names}")
