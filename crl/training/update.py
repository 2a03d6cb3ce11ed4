"""One iteration's learning: the estimator, the losses, micro-batches and optimizer steps (docs/design.md §4–§5).

:class:`PPOUpdate` turns a batch of the collector's rows into advantages (:class:`CrossTrajectoryGAE` with the
critic's values, or :class:`GroupRelativeAdvantage` without a critic), then steps the critic and the policy. Every
optimizer step is normalised by the optimized-token count of the whole step over all ranks and micro-batches
(Eq. 12), so the gradient does not depend on how the batch is split or spread. What the steps did is kept in an
:class:`UpdateReport` (grad norms, normalizers, loss metrics, behaviour entropy), which the trainer logs and writes
into the evidence.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from tensordict import TensorDict

from crl.config import Config
from crl.episode import SegmentKind
from crl.learner import microbatch_rows, placeholder_row, plan_forward
from crl.modules.networks import MODEL_IN_KEYS
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE, GroupRelativeAdvantage, explained_variance_of
from crl.objectives.distributed import all_reduce_sum
from crl.training.accelerator import mean_over_ranks

__all__ = ["LossMetrics", "PPOUpdate", "UpdateReport", "step_metrics"]

# the loss outputs of the value loss: under a shared trunk the policy's step computes them, logged as the critic's
CRITIC_METRICS = ("loss_critic", "explained_variance", "share_critic_execution", "share_critic_summary")


@dataclass
class LossMetrics:
    """One loss module's metrics (:class:`~crl.objectives.CompactionPPOLoss`'s outputs), one value per optimizer step
    since the reset, dropped steps included, each over the whole step (:func:`step_metrics`: all its micro-batches;
    the report's mean over ranks then makes it the whole step's over ranks too). ``loss_*``: the step's reduced
    losses (Eq. 12); ``clip_fraction``, ``approx_kl``, ``entropy`` (policy): over the step's optimized tokens;
    ``explained_variance`` (critic): one per pass over the batch (:meth:`PPOUpdate.end_pass`);
    ``objective_<kind>``: the objective's part on segments of that kind; ``share_<loss>_<kind>``: that kind's share
    of the loss's magnitude. The loss's ``sum_*`` / ``num_*`` entries are counts the step itself uses, not kept."""

    loss_objective: list[float] = field(default_factory=list)
    loss_entropy: list[float] = field(default_factory=list)
    loss_kl: list[float] = field(default_factory=list)
    loss_critic: list[float] = field(default_factory=list)
    clip_fraction: list[float] = field(default_factory=list)
    approx_kl: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    explained_variance: list[float] = field(default_factory=list)
    objective_execution: list[float] = field(default_factory=list)
    objective_summary: list[float] = field(default_factory=list)
    share_objective_execution: list[float] = field(default_factory=list)
    share_objective_summary: list[float] = field(default_factory=list)
    share_critic_execution: list[float] = field(default_factory=list)
    share_critic_summary: list[float] = field(default_factory=list)

    def add(self, step: dict[str, float]) -> None:
        """Append one optimizer step's metrics (:func:`step_metrics`). A metric with no field here is refused (a typed
        record: add the field)."""
        for key, val in step.items():
            if not hasattr(self, key):
                raise ValueError(f"the loss module returned a metric {key!r} that crl.training.update.LossMetrics has no field for: "
                                 "add it there")
            getattr(self, key).append(float(val))

    def logged(self, prefix: str) -> dict[str, list[float]]:
        """``{prefix + name: values}`` of every metric with a value (the keys of metrics.jsonl: ``policy/approx_kl``)."""
        return {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}


# How a step's micro-batch outputs combine (step_metrics). Each micro-batch's loss_* is already its masked sum over
# the step's global normaliser (times grad_scale), so the step's loss is their sum, not their mean (a mean logged the
# loss divided by train.micro_batches); the ratios pool their numerators and denominators.
SUMMED_METRICS = ("loss_objective", "loss_entropy", "loss_kl", "loss_critic", "objective_execution", "objective_summary")
TOKEN_MEAN_METRICS = ("clip_fraction", "approx_kl", "entropy")


def total_loss(out: TensorDict, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """The sum of a loss module's ``loss_*`` terms but those in ``skip``: what one backward carries."""
    return sum(v for k, v in out.items() if k.startswith("loss_") and k not in skip)


def step_metrics(outs: list[TensorDict], device="cpu") -> dict[str, float]:
    """One optimizer step's metrics from its micro-batches' loss outputs ``outs`` (this rank's; every rank calls it:
    one all-reduce). With micro-batches ``b`` of every rank, ``n_b`` optimized tokens each:

    * ``loss_*``, ``objective_*``: ``Σ_b`` over this rank's micro-batches, this rank's part of the step's loss (each
      ``loss_b = coeff · Σ_{s,t∈b} ℓ · grad_scale / N``, Eq. 12): the mean over ranks (``grad_scale`` = ranks) is the
      step's loss, the same number however the batch is split;
    * ``clip_fraction``, ``approx_kl``, ``entropy``: ``Σ_b x_b n_b / Σ_b n_b`` over every rank's micro-batches
      (NaN without an optimized token);
    * ``share_<loss>_<kind>``: ``Σ_b Σ|wℓ|_kind / Σ_b Σ|wℓ|`` over every rank's micro-batches (the loss's
      ``sum_abs_*``; NaN where the loss is 0 everywhere).

    ``explained_variance`` is left out (pooled over a pass: :meth:`PPOUpdate.end_pass`). A metric with no rule here
    is refused."""
    keys = [k for k in outs[0].keys() if not k.startswith(("sum_", "num_")) and k != "explained_variance"]
    unknown = [k for k in keys if k not in SUMMED_METRICS + TOKEN_MEAN_METRICS and not k.startswith("share_")]
    if unknown:
        raise ValueError(f"the loss module returned metrics {unknown} that crl.training.update.step_metrics has no rule "
                         "to combine over micro-batches for: add one (summed, token mean or share)")
    got = {k: sum(float(o[k].detach()) for o in outs) for k in keys if k in SUMMED_METRICS}
    pooled = [k for k in keys if k in TOKEN_MEAN_METRICS]
    shares = [k for k in keys if k.startswith("share_")]
    # [Σ x n, Σ n] per token mean, [Σ part, Σ total] per share: one all-reduce gives every rank the step's value
    rows = [[sum(float(o[k]) * int(o["num_tokens"]) for o in outs), sum(int(o["num_tokens"]) for o in outs)] for k in pooled]
    rows += [[sum(float(o["sum_abs_" + k[len("share_"):]]) for o in outs),
              sum(float(o["sum_abs_" + k[len("share_"):].rsplit("_", 1)[0]]) for o in outs)] for k in shares]
    sums = all_reduce_sum(torch.tensor(rows, dtype=torch.float64, device=device).reshape(-1, 2)).tolist()
    got.update({k: num / den if den > 0 else float("nan") for k, (num, den) in zip(pooled + shares, sums)})
    return got


@dataclass
class UpdateReport:
    """What one iteration's update reports: :class:`PPOUpdate` writes it, :class:`crl.trainer.Trainer` logs it
    (:meth:`metrics`) and writes ``grad_norms`` / ``normalizers`` into the evidence.

    ``grad_norms`` / ``normalizers``: per applied optimizer step of the ``"actor"`` / ``"critic"`` (the pre-clipping
    norm; the step's :class:`~crl.objectives.LossNormalizer` as a dict). ``behaviour_entropy``: ``{kind: [Σ H_t, n]}``
    over this rank's optimized tokens of each segment kind under the weights that sampled them (None until
    recorded); ``entropy_pass``: whether recording it took a pass of its own. ``policy_steps`` / ``kl_stop``: policy
    steps applied and whether ``algo.target_kl`` stopped them (None without a policy update). ``learner_s``: seconds
    from the advantages to the weight sync (set by the trainer)."""

    policy: LossMetrics = field(default_factory=LossMetrics)
    critic: LossMetrics = field(default_factory=LossMetrics)
    grad_norms: dict[str, list[float]] = field(default_factory=lambda: {"actor": [], "critic": []})
    normalizers: dict[str, list[dict]] = field(default_factory=lambda: {"actor": [], "critic": []})
    behaviour_entropy: dict[str, list] | None = None
    entropy_pass: bool = False
    policy_steps: int | None = None
    kl_stop: bool | None = None
    kl_final: float | None = None
    sampler_kl: float | None = None
    learner_s: float | None = None
    critic_passes: int = 0
    policy_forwards: float = 0.0
    reference_pass: bool = False
    values_in_policy_step: bool = False

    def metrics(self, device, *, learner_tokens: float) -> dict[str, float]:
        """The logged metrics, the same on every rank (every rank calls it: collectives): each loss metric's mean over
        the iteration's optimizer steps and ranks (``policy/*``, ``critic/*``; each step's value over its whole step;
        ``policy/approx_kl`` the mean of the KLs measured after each policy step), ``policy/steps``, ``policy/kl_stop``,
        ``policy/kl_final`` (the KL of the weights the update ends with), ``policy/sampler_kl`` (the first step's forward,
        at the weights that sampled: the learner against the sampler's log-probs, 0 up to float noise when they agree),
        ``grad_norm/{actor,critic}`` (this rank's mean:
        the policy's own tensors, the critic's own), ``policy/entropy_{execution,summary}`` (nats per optimized token,
        over ranks) and ``perf/learner_tokens_per_s`` (``learner_tokens``: positions of one pass over the batch; passes:
        the values, the entropy pass, each critic step, the policy's forwards, dropped and KL-measuring ones included,
        each a fraction of a pass)."""
        log = mean_over_ranks({**self.policy.logged("policy/"), **self.critic.logged("critic/")}, device)
        if self.policy_steps is not None:
            log["policy/steps"] = float(self.policy_steps)
            log["policy/kl_stop"] = float(self.kl_stop)
            log["policy/kl_final"] = float(self.kl_final)
        if self.sampler_kl is not None:
            log["policy/sampler_kl"] = float(self.sampler_kl)
        for name in ("actor", "critic"):
            if self.grad_norms[name]:
                log[f"grad_norm/{name}"] = float(np.mean(self.grad_norms[name]))
        ent = self.behaviour_entropy or {}
        sums = all_reduce_sum(torch.tensor([x for kind in ("execution", "summary") for x in ent.get(kind, (0.0, 0))],
                                           dtype=torch.float64, device=device))
        for i, kind in enumerate(("execution", "summary")):
            if sums[2 * i + 1] > 0:  # no optimized token of the kind (frozen summaries, a skipped update): no value
                log[f"policy/entropy_{kind}"] = float(sums[2 * i] / sums[2 * i + 1])
        if self.learner_s is not None:  # passes over the batch: values, entropies, critic steps, the policy's forwards
            passes = (int(not self.values_in_policy_step) + int(self.entropy_pass) + int(self.reference_pass) + self.critic_passes
                      + self.policy_forwards)
            log["perf/learner_tokens_per_s"] = passes * learner_tokens / max(self.learner_s, 1e-9)
        return log


class PPOUpdate:
    """The estimator and losses over ``models`` (:class:`crl.training.models.LearnerModels`) and their optimizer
    steps. ``world``: data-parallel ranks (the gradient average the normalizer undoes); ``device``: where the
    collectives' tensors live."""

    def __init__(self, cfg: Config, models, accelerator, world: int, device):
        self.cfg, self.models, self.accelerator, self.world, self.device = cfg, models, accelerator, world, device
        a = cfg.algo
        if models.use_critic:
            self.estimator = CrossTrajectoryGAE(
                gamma=a.gamma, alpha=a.alpha, lmbda=a.lmbda, lambda_length=a.lambda_length, cross_trajectory=a.cross_trajectory,
                value_target=a.value_target, boundary=a.boundary, whiten=a.whiten_advantage, sibling_value_weight=a.sibling_value_weight,
            )
        else:
            self.estimator = GroupRelativeAdvantage(baseline=a.group_baseline, scale=a.group_scale)
        ppo_kwargs = dict(eps_low=a.clip_eps_low, eps_high=a.clip_eps_high, aggregation=a.aggregation)
        # a shared trunk (models.shared_trunk): the policy loss carries the value loss, weighted algo.critic_coef, through
        # the one network's one forward and backward; the critic loss alone serves the critic warm-up's steps
        joint = models.critic if models.shared_trunk else None
        self.policy_loss = CompactionPPOLoss(models.actor, joint, entropy_coeff=a.entropy_coef, kl_coeff=a.kl_coef, kl_to=a.kl_to,
                                             critic_coeff=a.critic_coef, clip_value=a.clip_value if joint is not None else None,
                                             **ppo_kwargs)
        # a shared trunk's critic steps (the warm-up) weigh the value loss as its policy steps do: critic/loss_critic means one thing
        self.critic_loss = (CompactionPPOLoss(None, models.critic, clip_value=a.clip_value,
                                              critic_coeff=a.critic_coef if models.shared_trunk else 1.0, **ppo_kwargs)
                            if models.critic is not None else None)
        self.rates = {"actor": cfg.train.actor_lr, "critic": cfg.train.critic_lr}  # the iteration's (set_learning_rates)
        self.last_step_kl = float("nan")
        self.reset_report()

    def reset_report(self) -> None:
        """A fresh :class:`UpdateReport` (``self.report``): what the optimizer steps since this call did."""
        self.report = UpdateReport()
        self.ev_moments = None  # [Σ y, Σ y², Σ r, Σ r², n] of the value loss's steps in the pass so far (end_pass)

    @property
    def values_from_policy_step(self) -> bool:
        """Whether a policy iteration's values can come from its one policy step's own forward, with no pass of their
        own: a shared trunk (one network writes log-probs and values), one step per iteration (``policy_epochs`` =
        ``policy_minibatches`` = 1: the step's forward runs the weights that sampled the batch, so its detached values
        are the values before the update), and an estimator that reads each row alone (no whitening over the batch,
        no bootstrap from a sibling row). Then each micro-batch runs the network once, the estimator on its detached
        values, and the loss on the same outputs (:meth:`fused_step_loss`): one forward and one backward per
        micro-batch for the whole iteration."""
        c, a = self.cfg, self.cfg.algo
        return (self.models.shared_trunk and c.train.policy_epochs == 1 and c.train.policy_minibatches == 1
                and not a.whiten_advantage and a.boundary == "terminal")

    def advantages(self, batch: TensorDict, *, in_policy_step: bool = False) -> TensorDict:
        """``batch`` with the critic's ``state_value`` (zeros without a critic) and the estimator's ``advantage`` /
        ``value_target``. Every rank calls it, with or without rows (the critic's forwards are collectives under
        ZeRO-3 and DDP).

        ``in_policy_step`` (only where :attr:`values_from_policy_step`): no pass here; the three keys are zeros that the
        iteration's policy step fills in from its own forward (``report.values_in_policy_step``)."""
        self.record_reference(batch)
        if in_policy_step:
            if not self.values_from_policy_step:
                raise ValueError("advantages(in_policy_step=True) needs PPOUpdate.values_from_policy_step (a shared trunk, "
                                 "one policy step, no whitening, the terminal boundary)")
            for key in ("state_value", "advantage", "value_target"):
                batch[key] = torch.zeros(batch["loss_mask"].shape, device=batch.device)
            self.report.values_in_policy_step = True
            return batch
        if self.models.critic is None:  # critic-free (algo.estimator=group): nothing to evaluate
            batch["state_value"] = torch.zeros(batch["loss_mask"].shape, device=batch.device)
            return self.estimator(batch)
        with torch.no_grad():
            if self.cfg.learner.prefix_sharing:  # no graph kept: the whole batch at once, chunked by the plan
                out = self.models.critic(batch.select(*self.models.critic.in_keys).clone())
            else:
                out = torch.cat([self.models.critic(mb.select(*MODEL_IN_KEYS).clone()) for mb in self.split(batch)])
        S = batch.batch_size[0]
        batch["state_value"] = out["state_value"][:S] * batch["loss_mask"]
        if self.models.shared_trunk:  # the same forward gave the sampling weights' entropies: no pass of its own for them
            self.record_entropy(batch, out["entropy"][:S])
        self.models.release_gathered()
        return self.estimator(batch)

    def record_reference(self, batch: TensorDict) -> None:
        """With ``algo.kl_to=reference``: ``batch["ref_log_prob"]`` ``[S, T]``, the reference policy's log-prob of every
        optimized token (the policy as RL started: :meth:`crl.training.models.LearnerModels.reference_policy`), one no-grad
        pass through the learner's own forward; the KL penalty pulls toward it. Every rank calls it (collectives)."""
        if self.cfg.algo.kl_to != "reference":
            return
        S = batch.batch_size[0]
        with self.models.reference_policy():
            out = self.models.actor(batch.select(*self.models.actor.in_keys).clone())
        batch["ref_log_prob"] = out["log_prob"][:S].detach() * batch["loss_mask"]
        self.report.reference_pass = True

    def split(self, td: TensorDict, plan=None) -> list[TensorDict]:
        """Exactly ``train.micro_batches`` micro-batches (the same count on every rank, as DeepSpeed needs).

        ``plan``: ``td``'s :func:`~crl.learner.plan_forward`, when the caller already has it (prefix sharing only).
        """
        return [td[torch.tensor(rows, dtype=torch.long)] if rows else placeholder_row(td) for rows in self.split_rows(td, plan)]

    def split_rows(self, td: TensorDict, plan=None) -> list[list[int]]:
        """The rows of ``td`` in each micro-batch of :meth:`split` (empty: a placeholder row)."""
        L, n = self.cfg.learner, self.cfg.train.micro_batches
        if L.prefix_sharing:  # balanced by forward tokens; a prefix pair never splits
            return microbatch_rows(td, n, plan=plan, max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens)
        return [idx.tolist() for idx in torch.arange(td.batch_size[0]).tensor_split(n)]

    def learner_metrics(self, batch: TensorDict) -> dict:
        """``perf/learner_tokens`` (positions through the actor for one pass over ``batch``, padding included),
        ``perf/unique_tokens`` (distinct (rollout, position) pairs the loss and the values need), ``perf/padding_frac``."""
        L = self.cfg.learner
        plan = plan_forward(batch, max_padding=L.max_padding)
        mbs = self.split(batch, plan)
        unique = plan.unique_tokens
        if L.prefix_sharing:
            processed = sum(plan_forward(mb, max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens).learner_tokens for mb in mbs)
        else:
            processed = sum(mb.batch_size[0] * mb["tokens"].shape[-1] for mb in mbs)
        return {"perf/learner_tokens": processed, "perf/unique_tokens": unique,
                "perf/padding_frac": 1.0 - unique / processed if processed else 0.0}

    def end_pass(self) -> None:
        """Log ``critic/explained_variance`` of the pass over the batch that just ended (the value loss's steps since
        the last call): ``1 - Var(y - V_θ) / Var(y)`` over every optimized token the pass saw, all micro-batches, steps
        and ranks pooled (:func:`~crl.objectives.explained_variance_of`), each token's ``V_θ`` from its own step's
        forward. One value per pass, as SB3 and CleanRL log it over a rollout buffer: a critic step on the whole batch is
        a pass; so is an epoch of ``train.policy_minibatches`` shared-trunk steps (one per minibatch of whole rollouts),
        whose per-step ratios on a few rollouts each are unbounded below where a minibatch's targets are nearly
        constant (−2 … −172 logged on configs/lm_keep's 4 minibatches of 4 episodes, where the batch's own is −0.5 … 0.3).
        Nothing when no value loss ran."""
        if self.ev_moments is not None:
            self.report.critic.explained_variance.append(explained_variance_of(self.ev_moments[:4], int(self.ev_moments[4])))
        self.ev_moments = None

    def update_critic(self, batch: TensorDict) -> None:
        """``train.critic_updates`` critic optimizer steps on the whole batch (split into micro-batches once); nothing
        without a critic (``algo.estimator=group``)."""
        if self.models.critic is None:
            return
        mbs = self.split(batch)
        for _ in range(self.cfg.train.critic_updates):
            self.optimizer_step("critic", mbs)
            self.end_pass()
        self.models.release_gathered()

    def schedule_fraction(self, schedule: str, iteration: int) -> float:
        """``1 - iteration / train.iterations`` for a ``linear`` schedule, 1 for ``constant``: the factor of the learning
        rates (``train.lr_schedule``) and of the entropy bonus (``algo.entropy_schedule``) at ``iteration`` (0-based)."""
        return 1.0 - iteration / self.cfg.train.iterations if schedule == "linear" else 1.0

    def set_learning_rates(self, iteration: int) -> dict:
        """The learning rates of ``iteration`` (0-based), set on both optimizers: ``train.actor_lr`` / ``critic_lr`` times
        ``1 - iteration / train.iterations`` with ``train.lr_schedule=linear`` (CleanRL's ``anneal_lr``), times 1 with
        ``constant``. A function of the iteration alone, so a resumed run continues the same schedule."""
        t = self.cfg.train
        frac = self.schedule_fraction(t.lr_schedule, iteration)
        rates = {"actor": t.actor_lr * frac, "critic": t.critic_lr * frac}
        self.rates = rates
        for name, _, opt in self.models.trained():  # (a DeepSpeed engine's optimizer exposes the same param_groups)
            for group in opt.param_groups:  # a shared trunk's one optimizer: the value head's group is the critic's
                group["lr"] = rates[group.get("role", name)]
        return rates

    def set_entropy_coef(self, iteration: int) -> float:
        """The entropy bonus's weight at ``iteration`` (0-based), set on the policy loss: ``algo.entropy_coef`` times
        ``1 - iteration / train.iterations`` with ``algo.entropy_schedule=linear``, times 1 with ``constant``. A
        function of the iteration alone, so a resumed run continues the same schedule."""
        a = self.cfg.algo
        self.policy_loss.entropy_coeff = a.entropy_coef * self.schedule_fraction(a.entropy_schedule, iteration)
        return self.policy_loss.entropy_coeff

    def update_policy(self, batch: TensorDict, iteration: int) -> None:
        """``policy_epochs`` passes over the batch, each in ``policy_minibatches`` steps of whole units (seeded order): a
        unit is a rollout, or with ``train.branches`` > 1 a branch group (its rows share a prefix the learner runs once).

        The KL of each step is measured after it: by the next step's forward (its rows at the weights the step left)
        and, after the last, by a no-grad forward over the last step's rows (:meth:`measure_kl`): ``KL̂ = Σ_t [(ρ_t - 1) -
        log ρ_t] / n`` over the optimized tokens on every rank (Schulman's k3; ρ_t the new/old probability ratio; nats
        per token). ``policy/approx_kl`` is their mean, ``policy/kl_final`` the KL of the weights the update ends with.
        With ``algo.target_kl``, a step whose KL after it exceeds ``1.5 × target_kl`` is undone (its weights and optimizer
        state before it restored, :meth:`snapshot` / :meth:`restore`) and the iteration's update ends there, so the
        update's KL is bounded; the step after it (whose forward measured the excess) is not applied. Logged:
        ``policy/steps`` (steps kept), ``policy/kl_stop`` (1 when stopped)."""
        t = self.cfg.train
        limit = None if self.cfg.algo.target_kl is None else 1.5 * self.cfg.algo.target_kl
        self.report.policy_forwards = 0.0
        if self.report.values_in_policy_step:  # one step over the whole batch, its values from its own forward
            rows = self.split_rows(batch)
            mbs = [batch[torch.tensor(r, dtype=torch.long)] if r else placeholder_row(batch) for r in rows]
            before = self.snapshot() if limit is not None else None
            self.optimizer_step("actor", mbs, fill=(batch, rows))
            self.report.sampler_kl = self.last_step_kl
            self.end_pass()
            kl = self.measure_kl(mbs, 1.0)
            kept = not (limit is not None and kl > limit)
            if not kept:
                self.restore(before)
            self.finish_policy_update(steps=int(kept), stopped=not kept, kls=[kl], final=kl if kept else 0.0)
            return
        units = batch["branch_group"] if "branch_group" in batch.keys() else batch["rollout_id"]
        ids = units.unique()
        order = torch.Generator().manual_seed(t.seed * 7919 + iteration)  # once per iteration: each epoch a new order
        chunks = [chunk for _ in range(t.policy_epochs)
                  for chunk in ids[torch.randperm(len(ids), generator=order)].tensor_split(t.policy_minibatches)]
        steps, stopped, kls, before, mbs = 0, False, [], None, None
        for i, chunk in enumerate(chunks):
            mbs = self.split(batch[torch.isin(units, chunk)])
            snap = self.snapshot() if limit is not None else None
            applied = self.optimizer_step("actor", mbs, max_kl=limit if steps else None)
            if steps:  # this step's forward ran at the weights the previous step left: its KL is that step's
                kls.append(self.last_step_kl)
            elif i == 0:  # the sampling weights: the learner against the sampler's own log-probs
                self.report.sampler_kl = self.last_step_kl
            if not applied:  # the previous step went past the bound: undone, and the update ends
                self.restore(before)
                steps, stopped = steps - 1, True
                break
            before = snap
            steps += 1
            if (i + 1) % t.policy_minibatches == 0:  # an epoch's last minibatch: the pass over the batch ends
                self.end_pass()
        self.end_pass()  # a pass the KL stop cut short: over the steps it saw, the dropped one included
        final = kls[-2] if stopped and len(kls) > 1 else 0.0  # stopped: the weights are those after the step before the undone one
        if not stopped and steps:
            kl = self.measure_kl(mbs, 1.0 / t.policy_minibatches)
            kls.append(kl)
            final = kl
            if limit is not None and kl > limit:  # the last step went past the bound: undone
                self.restore(before)
                steps, stopped = steps - 1, True
                final = kls[-2] if len(kls) > 1 else 0.0
        self.finish_policy_update(steps=steps, stopped=stopped, kls=kls, final=final)

    def finish_policy_update(self, *, steps: int, stopped: bool, kls: list[float], final: float) -> None:
        """Record the update's outcome: steps kept, whether the KL bound stopped it, the KL after each step and at the end."""
        self.report.policy_steps, self.report.kl_stop = steps, stopped
        self.report.policy.approx_kl.extend(kls)
        self.report.kl_final = final
        self.models.release_gathered()

    def measure_kl(self, mbs: list[TensorDict], fraction: float) -> float:
        """The approximate KL (k3, nats per optimized token, over every rank) of the policy as it is now to the sampling
        policy on the rows of ``mbs`` (``fraction`` of the batch): one no-grad forward through the policy loss (its
        ``approx_kl`` and token count)."""
        norm = self.policy_loss.normalizer(mbs, dp_gradient_average=self.world > 1)
        with torch.no_grad():
            outs = [self.policy_loss(mb, normalizer=norm) for mb in mbs]
        self.report.policy_forwards += fraction
        return step_metrics(outs, self.device)["approx_kl"]

    def trainable_policy(self) -> tuple[list[torch.nn.Parameter], object]:
        """The parameters a policy step moves (every trainable tensor of the policy's model, the value head included
        under a shared trunk: its step moves both) and the optimizer that moves them."""
        return [p for p in self.models.actor_model.parameters() if p.requires_grad], self.models.actor_opt

    def snapshot(self) -> dict:
        """The policy's trainable weights and its optimizer's state, to undo a step (:meth:`restore`): a LoRA adapter and
        its Adam moments are a few tens of MB."""
        params, opt = self.trainable_policy()
        return {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(opt.state_dict())}

    def restore(self, snap: dict | None) -> None:
        """Put back what :meth:`snapshot` took; the step's grad norm and normalizer leave the report (they describe a
        step that no longer exists: the evidence lists kept steps)."""
        if snap is None:
            return
        params, opt = self.trainable_policy()
        with torch.no_grad():
            for p, saved in zip(params, snap["params"]):
                p.copy_(saved)
        opt.load_state_dict(snap["optimizer"])
        self.report.grad_norms["actor"].pop()
        self.report.normalizers["actor"].pop()
        if self.models.shared_trunk:  # the value head's norm, listed by the same step
            self.report.grad_norms["critic"].pop()

    @property
    def entropy_from_policy_loss(self) -> bool:
        """Whether the first policy step of an iteration sees every row with the weights that sampled it, so its
        forward gives the behaviour entropy for free: one minibatch per epoch (``train.policy_minibatches=1``; with
        more, later minibatches see updated weights). The critic's steps do not move the policy before it: a separate
        critic has weights of its own, and a shared trunk's critic takes no step of its own in a policy iteration."""
        return self.cfg.train.policy_minibatches == 1

    def record_behaviour_entropy(self, batch: TensorDict) -> None:
        """One no-grad actor pass over ``batch`` with the weights that sampled it (call it before any update of the
        iteration): ``report.behaviour_entropy[kind] = [Σ H_t, n]`` over this rank's optimized tokens of each segment kind,
        ``H_t`` the entropy (nats) of the sampling distribution (temperature, top-p) at token ``t``.

        Used when no policy step records it (critic warm-up iterations, :attr:`entropy_from_policy_loss` false).
        Every rank calls it with the same number of forward calls as :meth:`advantages`'s critic pass
        (prefix sharing agrees on the chunk count; the naive learner makes ``train.micro_batches`` calls), as DDP
        and ZeRO-3 need, even with no row."""
        S = batch.batch_size[0]
        with torch.no_grad():
            if self.cfg.learner.prefix_sharing:
                ent = self.models.actor(batch.select(*self.models.actor.in_keys).clone())["entropy"]
            else:
                ent = torch.cat([self.models.actor(mb.select(*MODEL_IN_KEYS).clone())["entropy"] for mb in self.split(batch)])
        self.models.release_gathered()
        self.record_entropy(batch, ent[:S])
        self.report.entropy_pass = True  # one more pass over the batch (perf/learner_tokens_per_s)

    def record_entropy(self, batch: TensorDict, entropy) -> None:
        """``report.behaviour_entropy[kind] = [Σ H_t, n]`` over ``batch``'s optimized tokens of each segment kind, from
        ``entropy`` ``[S, T]`` computed with the weights that sampled them."""
        ent, mask = entropy.to(torch.float64), batch["loss_mask"].bool()
        kind = batch["segment_kind"].unsqueeze(-1)
        self.report.behaviour_entropy = {
            name: [float(torch.where(mask & (kind == int(k)), ent, 0.0).sum()), int((mask & (kind == int(k))).sum())]
            for name, k in (("execution", SegmentKind.EXECUTION), ("summary", SegmentKind.SUMMARY))
        }

    def fused_step_loss(self, mb: TensorDict, normalizer, batch: TensorDict, rows: list[int]) -> TensorDict:
        """The policy loss of micro-batch ``mb`` in a step whose values come from its own forward
        (:attr:`values_from_policy_step`): the network once (log-probs, entropies, values, with their graph), the
        estimator on the detached values, then the loss on the same outputs. The values, advantages and value targets
        are written back into ``batch``'s ``rows`` (the iteration's evidence)."""
        nets = self.models.actor(mb.select(*self.models.actor.in_keys).clone())
        mb["state_value"] = nets["state_value"].detach() * mb["loss_mask"]
        mb = self.estimator(mb)
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=batch.device)
            for key in ("state_value", "advantage", "value_target"):
                batch[key][idx] = mb[key].detach()
        return self.policy_loss(mb, normalizer=normalizer, outputs=nets)

    def optimizer_step(self, name: str, mbs: list[TensorDict], max_kl: float | None = None, fill=None) -> bool:
        """One optimizer step of ``name`` ("actor" / "critic") on the micro-batches ``mbs`` (:meth:`split`), in named parts:
        :meth:`backward` (every micro-batch, the step's metrics), the KL check, :meth:`clip_and_step` (each network's own
        clip, the learning-rate warm-up, the step). Returns whether the step was applied: with ``max_kl`` (the actor, no
        DeepSpeed), a step whose forward's token-weighted ``approx_kl`` (every micro-batch and rank: the KL of the weights
        as they are before this step) exceeds it is dropped (gradients zeroed, nothing listed but its loss metrics).

        Every micro-batch's loss is its masked *sum* divided by the step's global token count (all micro-batches,
        all ranks), so the gradient does not depend on how the batch is split. Records the pre-clipping grad
        norms, the normalizer (evidence) and the loss module's metrics in ``self.report``.

        ``fill``: ``(batch, rows)``, the step's values come from its own forward (:meth:`fused_step_loss`; ``rows[i]``:
        the rows of ``batch`` in ``mbs[i]``).
        """
        loss_module, model, opt, _ = self.step_parts(name)
        norm = loss_module.normalizer(mbs, dp_gradient_average=self.world > 1)
        step = self.backward(name, mbs, norm, fill)
        if max_kl is not None and step["approx_kl"] > max_kl:  # every rank's token mean (step_metrics); NaN (no token) applies
            opt.zero_grad(set_to_none=True)
            return False
        self.clip_and_step(name)
        report = self.report
        if name == "critic":
            report.critic_passes += 1
        report.normalizers[name].append(dataclasses.asdict(norm))
        return True

    def step_parts(self, name: str):
        """``(loss module, model, optimizer, metrics)`` of a step of ``name``: a shared trunk's critic step runs the one
        network and its one optimizer (whose value-head group alone it moves: :meth:`clip_and_step`)."""
        shared = self.models.shared_trunk
        return {
            "actor": (self.policy_loss, self.models.actor_model, self.models.actor_opt, self.report.policy),
            "critic": (self.critic_loss, self.models.actor_model if shared else self.models.critic_model,
                       self.models.actor_opt if shared else self.models.critic_opt, self.report.critic),
        }[name]

    def backward(self, name: str, mbs: list[TensorDict], norm, fill=None) -> dict:
        """Forward and backward of every micro-batch (DeepSpeed steps at its accumulation boundary inside); the step's
        metrics (:func:`step_metrics`) into the report, the value loss's under the critic's name. Returns them, the
        policy's ``approx_kl`` included (``self.last_step_kl``: the KL of the weights this forward ran)."""
        report, shared = self.report, self.models.shared_trunk
        loss_module, model, _, metrics = self.step_parts(name)
        outs = []
        for i, mb in enumerate(mbs):
            out = loss_module(mb, normalizer=norm) if fill is None else self.fused_step_loss(mb, norm, fill[0], fill[1][i])
            if self.models.head_model is not None:  # a shared trunk under DeepSpeed: each loss to its own engine
                self.engines_backward(name, out)
            elif self.models.use_ds:
                model.backward(total_loss(out), scale_wrt_gas=False)  # the loss is already normalised by the step's global counts
                model.step()  # DeepSpeed steps (and clips) at the accumulation boundary only
            else:
                self.accelerator.backward(total_loss(out))
            outs.append(out)
        if name == "actor":
            report.policy_forwards += 1.0 if fill is not None else 1.0 / self.cfg.train.policy_minibatches
        critic_metrics = report.critic if name == "critic" or shared else None  # where this step's value loss is logged
        step = step_metrics(outs, self.device)  # a dropped step's metrics too
        logged = dict(step)
        if name == "actor":  # the KL of the weights before this step: the previous step's, recorded by update_policy
            self.last_step_kl = logged.pop("approx_kl", float("nan"))
        if name == "actor" and shared:  # the value loss's metrics are the critic's (critic/loss_critic, critic/explained_variance)
            report.critic.add({k: v for k, v in logged.items() if k in CRITIC_METRICS})
            logged = {k: v for k, v in logged.items() if k not in CRITIC_METRICS}
        metrics.add(logged)
        if critic_metrics is not None and all("sum_ev_moments" in o.keys() for o in outs):
            # the value loss's moments over the step's micro-batches and ranks, pooled until the pass over the batch ends
            pooled = all_reduce_sum(torch.stack([torch.cat([o["sum_ev_moments"].to(torch.float64).cpu(),
                                                            torch.tensor([float(o["num_tokens"])], dtype=torch.float64)])
                                                 for o in outs]).sum(0).to(self.device))
            self.ev_moments = pooled if self.ev_moments is None else self.ev_moments + pooled
        if (name == "actor" and report.behaviour_entropy is None and self.entropy_from_policy_loss
                and all("sum_entropy_summary" in o.keys() for o in outs)):
            # the iteration's first policy step: every row, forwarded with the weights that sampled it
            report.behaviour_entropy = {kind: [sum(float(o[f"sum_entropy_{kind}"]) for o in outs),
                                               sum(int(o[f"num_tokens_{kind}"]) for o in outs)]
                                        for kind in ("execution", "summary")}
        return step

    def engines_backward(self, name: str, out: TensorDict) -> None:
        """A shared trunk under DeepSpeed (:class:`~crl.training.models.LearnerModels`' ``head_model``): the value loss
        (features detached: it reaches the value head alone) into the head's engine, the rest of a policy step's loss
        into the policy's; each engine steps (and clips its own gradient) at its accumulation boundary. A critic step
        (the critic warm-up) runs the head's engine alone: the policy's engine sees no backward and does not move."""
        head, policy = self.models.head_model, self.models.actor_model
        if name == "actor":
            policy.backward(total_loss(out, skip=("loss_critic",)), scale_wrt_gas=False)
            policy.step()
        head.backward(out["loss_critic"], scale_wrt_gas=False)
        head.step()

    def clip_and_step(self, name: str) -> None:
        """Clip each network's own gradient and apply the step; list the pre-clipping norms.

        The policy's tensors are clipped to ``train.max_grad_norm`` and the critic's own (a separate critic, or the value
        head on a shared trunk) to ``train.critic_max_grad_norm``, each on its own: a value head's gradient (tens, where
        the policy's is below 1) never sets the policy step's scale. ``grad_norm/actor`` is the policy's norm,
        ``grad_norm/critic`` the critic's. A shared trunk's critic step (the critic warm-up) moves the value head
        alone: the trunk's gradient is dropped, so the policy does not move before its first policy step. The policy's
        learning rate follows the warm-up (:meth:`warmup_factor`). Under DeepSpeed each engine has stepped and clipped its
        own tensors (its ``gradient_clipping``: the policy's ``train.max_grad_norm``, the critic's or the shared trunk's
        value head's ``train.critic_max_grad_norm``): their norms are listed."""
        report = self.report
        _, model, opt, _ = self.step_parts(name)
        if self.models.use_ds:  # the engines that stepped: each one's pre-clipping norm (policy's or critic's tensors)
            engines = [(name, model)]
            if self.models.head_model is not None:  # a shared trunk: the head's engine steps in policy and critic steps
                engines = [("actor", model)] * (name == "actor") + [("critic", self.models.head_model)]
            for role, engine in engines:
                gn = engine.get_global_grad_norm()
                report.grad_norms[role].append(float(gn) if gn is not None else float("nan"))
            return
        t = self.cfg.train
        if self.models.shared_trunk:
            groups = {g.get("role", "actor"): [p for p in g["params"]] for g in opt.param_groups}
            policy, head = groups.get("actor", []), groups.get("critic", [])
            if name == "critic":
                for p in policy:  # the warm-up trains the value head only: the policy stays as it sampled
                    p.grad = None
                report.grad_norms["critic"].append(self.clip_(head, t.critic_max_grad_norm))
            else:
                report.grad_norms["actor"].append(self.clip_(policy, t.max_grad_norm))
                report.grad_norms["critic"].append(self.clip_(head, t.critic_max_grad_norm))
        else:
            limit = t.max_grad_norm if name == "actor" else t.critic_max_grad_norm
            report.grad_norms[name].append(float(self.accelerator.clip_grad_norm_(model.parameters(), limit)))
        if name == "actor" or not self.models.shared_trunk:
            self.apply_warmup(opt, name)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def clip_(self, params: list, max_norm: float) -> float:
        """Clip the gradients of ``params`` (after DDP's all-reduce: the same on every rank) to ``max_norm`` together;
        the norm before clipping (0 when none has a gradient)."""
        grads = [p for p in params if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))

    def warmup_factor(self, opt) -> float:
        """``min(1, (s + 1) / train.lr_warmup_steps)`` for the policy's optimizer step ``s`` (0-based, counted by Adam's own
        state: a resumed run continues the warm-up where it was); 1 without a warm-up."""
        W = self.cfg.train.lr_warmup_steps
        if W <= 0:
            return 1.0
        for group in opt.param_groups:
            if group.get("role", "actor") != "actor":
                continue
            for p in group["params"]:
                state = opt.state.get(p, {})
                if "step" in state:
                    return min(1.0, (int(state["step"]) + 1) / W)
        return min(1.0, 1 / W)

    def apply_warmup(self, opt, name: str) -> None:
        """Set the policy groups' learning rate to the iteration's (:meth:`set_learning_rates`) times :meth:`warmup_factor`."""
        if name != "actor" or self.cfg.train.lr_warmup_steps <= 0:
            return
        factor = self.warmup_factor(opt)
        for group in opt.param_groups:
            if group.get("role", "actor") == "actor":
                group["lr"] = self.rates["actor"] * factor
