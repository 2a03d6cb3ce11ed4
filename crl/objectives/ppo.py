"""Token-summed clipped PPO for compaction segments (paper Eq. 12, docs/design.md §5).

.. math::

    L_\\pi = -\\frac{1}{N} \\sum_{(s,t):\\,m_{s,t}=1}
        \\min\\big(\\rho_{s,t} \\hat A_{s,t},\\ \\mathrm{clip}(\\rho_{s,t}, 1-\\epsilon_{low}, 1+\\epsilon_{high}) \\hat A_{s,t}\\big),
    \\qquad \\rho_{s,t} = \\exp(\\log\\pi_\\theta(x_{s,t} \\mid x_{s,<t}) - \\log\\pi_{behav}(x_{s,t} \\mid x_{s,<t}))

with ``N`` the optimized tokens of the *whole optimizer step* (all gradient-accumulation micro-batches and all
data-parallel ranks), ``Â`` the cross-trajectory advantage (Eqs. 13–15, :mod:`crl.objectives.value`) and
``m`` the loss mask (execution actions and summary tokens). The module returns masked **sums**; one documented
division (:meth:`CompactionPPOLoss.reduce`) by the global counts of a :class:`~crl.objectives.distributed.LossNormalizer`
makes the gradient independent of how the step is split into micro-batches and ranks.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives import LossModule
from torchrl.objectives.value import ValueEstimatorBase

from crl.episode import SegmentKind
from crl.objectives.distributed import LossNormalizer, dist_ready, make_normalizer
from crl.objectives.value import CrossTrajectoryGAE

__all__ = ["AGGREGATIONS", "KL_TARGETS", "CompactionPPOLoss", "explained_variance_of"]

AGGREGATIONS = ("token_sum_global", "segment_mean", "microbatch_token_mean")
KL_TARGETS = ("behaviour", "reference")


def explained_variance_of(moments: Tensor, n_tokens: int) -> float:
    """``1 - Var(y - V) / Var(y)`` over ``n_tokens`` tokens from ``moments`` = ``[Σ y, Σ y², Σ r, Σ r²]`` (``r = y - V``,
    summed over a step's micro-batches and ranks: the loss's ``sum_ev_moments``); NaN where ``Var(y) = 0`` or no token.
    The explained variance of the whole step's batch, as TorchRL and SB3 log it over a rollout buffer, not a mean of
    per-micro-batch ratios."""
    if n_tokens <= 0:
        return float("nan")
    sy, syy, sr, srr = (float(x) / n_tokens for x in moments.to(torch.float64))
    var_y, var_r = syy - sy * sy, srr - sr * sr
    return 1 - var_r / var_y if var_y > 0 else float("nan")


class CompactionPPOLoss(LossModule):
    """Token-summed clipped PPO actor loss plus critic loss over padded compaction segments (Eq. 12).

    One forward of the actor and one of the critic over the ``[S, T]`` segment tokens. Per optimized token
    (``loss_mask`` True; padding and context tokens never enter a loss or a metric):

    * policy: ``ℓ^π = -min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â)``, ``ρ = exp(log π_θ - sample_log_prob)``;
    * critic: ``ℓ^V = (V_θ - y)^2`` with ``y`` the value target; with ``clip_value = c`` (PPO value clipping)
      ``ℓ^V = max((V_θ - y)^2, (V_old + clip(V_θ - V_old, -c, c) - y)^2)``, where ``V_old`` is the batch's
      ``"state_value"`` written at advantage time (the critic runs on a scratch TensorDict, so it never
      overwrites ``V_old``);
    * entropy bonus: ``ℓ^H = -H_t`` (needs the actor to write ``"entropy"``);
    * KL penalty: ``ℓ^KL = exp(q - log π_θ) - (q - log π_θ) - 1`` (the non-negative "k3" estimator of
      ``KL(π_θ ‖ q)``), ``q`` = the behaviour log-prob (``kl_to="behaviour"``) or the ``"ref_log_prob"`` key
      (``kl_to="reference"``, a frozen reference policy's log-prob, aligned like ``sample_log_prob``).

    Aggregation (``aggregation``), with ``n_s`` the optimized tokens of segment ``s``:

    * ``"token_sum_global"`` (default, Eq. 12): ``Σ_{s,t} ℓ_{s,t} / N``, ``N`` = optimized tokens of the step;
    * ``"segment_mean"`` (ablation "no token-level loss"): ``Σ_s (1/n_s) Σ_t ℓ_{s,t} / G``, ``G`` = segments with
      ``n_s > 0`` in the step (all micro-batches and ranks): the mean over segments of per-segment token means;
    * ``"microbatch_token_mean"``: each micro-batch divides its sum by its own token count and the step averages
      those means over its ``M`` micro-batches (all ranks): ``(1/M) Σ_b Σ_{t∈b} ℓ_t / N_b``.

    Every ``loss_*`` is ``coeff · sum / denominator · grad_scale`` (units: per optimized token for the token
    aggregations, per segment for ``segment_mean``); summing the ``loss_*`` entries and backpropagating over the
    micro-batches of a step gives the gradient of the whole-batch loss.

    Args:
        actor_network: TensorDictModule reading ``("tokens", "attention_mask")`` and writing ``"log_prob"``
            ``[S, T]`` (``log_prob[s, t] = log π(tokens[s, t] | tokens[s, :t])`` at the sampling temperature,
            aligned like ``sample_log_prob``) and optionally ``"entropy"`` ``[S, T]``.
            ``None`` for a critic-only loss (e.g. critic warm-up or extra critic steps between policy steps).
        critic_network: TensorDictModule reading the same and writing ``"state_value"`` ``[S, T]``
            (``V(tokens[s, :t])``); ``None`` for an actor-only loss (critic trained elsewhere). The actor network
            itself when one network writes both (a shared trunk, :attr:`shared_network`): it then runs once per call,
            and ``loss_objective + loss_critic`` backpropagate through it together, the value loss weighted
            ``critic_coeff`` (TorchRL's ``ClipPPOLoss`` with a shared network).

    Keyword Args:
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` of ``ρ`` (default 0.2 / 0.2).
        critic_coeff: weight of ``loss_critic`` (default 1.0).
        clip_value: PPO value clipping range ``c`` (default None: no clipping).
        entropy_coeff: weight of the entropy bonus (default 0).
        kl_coeff: weight of the KL penalty (default 0, the paper's setting).
        kl_to: ``"behaviour"`` (default) or ``"reference"``.
        aggregation: one of :data:`AGGREGATIONS`.

    Keys (``set_keys``): ``tokens``, ``attention_mask``, ``loss_mask``, ``sample_log_prob``, ``advantage``,
    ``value_target``, ``value`` ("state_value": the critic's output key and the batch's old values),
    ``log_prob`` and ``entropy`` (actor outputs), ``ref_log_prob``, ``segment_kind``, and ``reward``,
    ``n_after``, ``rollout_length`` (forwarded to the value estimator).

    Output of :meth:`forward` (a TensorDict with no batch size, scalars): ``loss_objective``, ``loss_critic``
    (with a critic), ``loss_entropy``, ``loss_kl``; the raw masked sums ``sum_objective``, ``sum_critic``,
    ``sum_entropy``, ``sum_kl`` (aggregation-weighted, detached); ``num_tokens`` / ``num_segments`` of this
    micro-batch; metrics over its optimized tokens: ``clip_fraction``, ``approx_kl`` (``E[(ρ-1) - log ρ]``),
    ``entropy`` (the actor's entropy if it writes one, else the sample estimate ``E[-log π_θ]``),
    ``explained_variance`` (``1 - Var(y - V_θ) / Var(y)``, NaN if ``Var(y) = 0``; ``sum_ev_moments``, float64
    ``[Σ y, Σ y², Σ (y - V_θ), Σ (y - V_θ)²]`` over the optimized tokens, pools it over micro-batches:
    :func:`explained_variance_of`), per segment kind
    ``num_tokens_{execution,summary}``, ``objective_{execution,summary}`` (the kind's signed part of
    ``loss_objective``; the two add up to it), ``share_{objective,critic}_{execution,summary}`` (the kind's
    share of ``Σ|w ℓ|``; ``sum_abs_{objective,critic}[_{execution,summary}]``, float64, the two sums, pool it over
    micro-batches) and, when the actor writes ``"entropy"``, ``sum_entropy_{execution,summary}`` (float64,
    *unweighted* ``Σ H_t`` over the kind's optimized tokens, nats: divided by ``num_tokens_{kind}`` summed over
    micro-batches and ranks it is the mean entropy per token of that kind).

    Examples:
        >>> loss = CompactionPPOLoss(actor, critic)
        >>> loss.make_value_estimator()                      # CrossTrajectoryGAE(gamma=1, alpha=1.5)
        >>> loss.value_estimator(batch)                       # writes advantage / value_target, once per batch
        >>> norm = loss.normalizer(micro_batches)             # global counts, all-reduced over ranks
        >>> for mb in micro_batches:
        ...     out = loss(mb, normalizer=norm)
        ...     (out["loss_objective"] + out["loss_critic"]).backward()
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys (see the class docstring)."""

        tokens: NestedKey = "tokens"
        attention_mask: NestedKey = "attention_mask"
        loss_mask: NestedKey = "loss_mask"
        sample_log_prob: NestedKey = "sample_log_prob"
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        log_prob: NestedKey = "log_prob"
        entropy: NestedKey = "entropy"
        ref_log_prob: NestedKey = "ref_log_prob"
        segment_kind: NestedKey = "segment_kind"
        reward: NestedKey = "reward"
        n_after: NestedKey = "n_after"
        rollout_length: NestedKey = "rollout_length"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    default_value_estimator = CrossTrajectoryGAE

    actor_network: TensorDictModule | None
    critic_network: TensorDictModule | None

    def __init__(
        self,
        actor_network: TensorDictModule | None,
        critic_network: TensorDictModule | None = None,
        *,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        critic_coeff: float = 1.0,
        clip_value: float | None = None,
        entropy_coeff: float = 0.0,
        kl_coeff: float = 0.0,
        kl_to: str = "behaviour",
        aggregation: str = "token_sum_global",
    ):
        super().__init__()
        if actor_network is None and critic_network is None:
            raise ValueError("CompactionPPOLoss: give an actor_network, a critic_network or both")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"CompactionPPOLoss: aggregation={aggregation!r} is not one of {AGGREGATIONS}")
        if kl_to not in KL_TARGETS:
            raise ValueError(f"CompactionPPOLoss: kl_to={kl_to!r} is not one of {KL_TARGETS}")
        if not (0 <= eps_low < 1) or not (eps_high >= 0):
            raise ValueError(f"CompactionPPOLoss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
        if clip_value is not None and not (clip_value > 0):
            raise ValueError(f"CompactionPPOLoss: clip_value={clip_value} must be > 0 or None")
        if clip_value is not None and critic_network is None:
            raise ValueError("CompactionPPOLoss: clip_value needs a critic_network")
        for name, v in (("critic_coeff", critic_coeff), ("entropy_coeff", entropy_coeff), ("kl_coeff", kl_coeff)):
            if not (v >= 0):
                raise ValueError(f"CompactionPPOLoss: {name}={v} must be >= 0")
        self.actor_network = actor_network
        self.critic_network = critic_network
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.critic_coeff = float(critic_coeff)
        self.clip_value = None if clip_value is None else float(clip_value)
        self.entropy_coeff = float(entropy_coeff)
        self.kl_coeff = float(kl_coeff)
        self.kl_to = kl_to
        self.aggregation = aggregation

    @property
    def shared_network(self) -> bool:
        """Whether the actor and the critic are one network (it writes ``log_prob`` and ``state_value``): it runs once per
        call and the losses add up in one backward (:class:`crl.modules.networks.PolicyValueLM`)."""
        return self.actor_network is not None and self.critic_network is self.actor_network

    @property
    def functional(self) -> bool:
        # The networks are called as plain modules (LLM-sized: no functional parameter copies).
        return False

    # ------------------------------------------------------------------------------------------------------
    # keys and the value estimator
    # ------------------------------------------------------------------------------------------------------

    @property
    def in_keys(self):
        k = self.tensor_keys
        keys = [k.tokens, k.attention_mask, k.loss_mask, k.segment_kind]
        if self.actor_network is not None:
            keys += list(self.actor_network.in_keys) + [k.sample_log_prob, k.advantage]
        if self.critic_network is not None:
            keys += list(self.critic_network.in_keys) + [k.value_target]
        if self.clip_value is not None:
            keys.append(k.value)
        if self.kl_coeff > 0 and self.kl_to == "reference":
            keys.append(k.ref_log_prob)
        return list(dict.fromkeys(keys))

    @property
    def out_keys(self):
        keys = []
        if self.actor_network is not None:
            keys += ["loss_objective", "loss_entropy", "loss_kl", "clip_fraction", "approx_kl", "entropy"]
        if self.critic_network is not None:
            keys += ["loss_critic", "explained_variance"]
        return keys + ["num_tokens", "num_segments"]

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        if self._value_estimator is not None:
            k = self.tensor_keys
            mine = dict(advantage=k.advantage, value_target=k.value_target, value=k.value, reward=k.reward, loss_mask=k.loss_mask,
                        n_after=k.n_after, rollout_length=k.rollout_length)
            accepted = {f.name for f in dataclasses.fields(self._value_estimator._AcceptedKeys)}  # a group baseline reads no n_after
            self._value_estimator.set_keys(**{name: key for name, key in mine.items() if name in accepted})

    def make_value_estimator(self, value_type=None, **hyperparams):
        """Build the advantage estimator (default :class:`CrossTrajectoryGAE`, ``gamma=1``, ``alpha=1.5``).

        ``value_type`` may be None, the :class:`CrossTrajectoryGAE` class (built with ``hyperparams``; the
        loss's critic is passed as ``value_network`` unless given) or any
        :class:`~torchrl.objectives.value.ValueEstimatorBase` instance. The loss's keys are forwarded to it.
        """
        if value_type is None:
            value_type = self.default_value_estimator
        if isinstance(value_type, ValueEstimatorBase):
            self._value_estimator = value_type
        elif isinstance(value_type, type) and issubclass(value_type, ValueEstimatorBase):
            self._value_estimator = value_type.for_loss(self, **hyperparams)
        else:
            raise NotImplementedError(
                f"CompactionPPOLoss: value type {value_type!r} is not supported; use CrossTrajectoryGAE"
            )
        self.value_type = type(self._value_estimator)
        self._forward_value_estimator_keys()
        return self

    def normalizer(self, microbatches, *, dp_gradient_average: bool = False, group=None) -> LossNormalizer:
        """:func:`~crl.objectives.distributed.make_normalizer` with this loss's ``loss_mask`` key."""
        return make_normalizer(
            microbatches, loss_mask_key=self.tensor_keys.loss_mask, dp_gradient_average=dp_gradient_average, group=group
        )

    # ------------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------------

    def _get(self, td: TensorDictBase, key: NestedKey, shape, what: str) -> Tensor:
        x = td.get(key, None)
        if x is None:
            raise KeyError(f"CompactionPPOLoss: key {key!r} ({what}) is missing from the batch")
        if x.shape != shape:
            raise ValueError(f"CompactionPPOLoss: {key!r} ({what}) has shape {list(x.shape)}, expected {list(shape)}")
        return x

    @staticmethod
    def _check_finite(name, x: Tensor, mask: Tensor) -> None:
        bad = ~torch.isfinite(x) & mask
        if bad.any():
            s, t = bad.nonzero()[0].tolist()
            raise ValueError(f"CompactionPPOLoss: {name} is NaN or inf at optimized token (row {s}, token {t})")

    def _local_normalizer(self, n_tokens: int, n_segments: int) -> LossNormalizer:
        if dist_ready() and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "CompactionPPOLoss: torch.distributed is initialised with several ranks but no normalizer was "
                "given; compute norm = loss.normalizer(micro_batches) before the micro-batch loop and call "
                "loss(mb, normalizer=norm), so every rank divides by the global token count"
            )
        return LossNormalizer(num_tokens=n_tokens, num_segments=n_segments, num_microbatches=1)

    def denominator(self, normalizer: LossNormalizer, local_tokens: int) -> float:
        """The divisor of every ``sum_*`` under this loss's aggregation (before ``grad_scale``)."""
        if self.aggregation == "token_sum_global":
            d = normalizer.num_tokens
        elif self.aggregation == "segment_mean":
            d = normalizer.num_segments
        else:
            d = local_tokens * normalizer.num_microbatches
        return max(float(d), 1.0)

    def reduce(self, sums: TensorDictBase, normalizer: LossNormalizer) -> TensorDictBase:
        """The documented reduction: ``loss_x = coeff_x · sum_x · grad_scale / denominator`` for each loss.

        ``sums`` holds the differentiable ``sum_*`` entries and ``num_tokens``; returns the ``loss_*`` entries.
        """
        scale = normalizer.grad_scale / self.denominator(normalizer, int(sums["num_tokens"]))
        out = {}
        for name, coeff in (("objective", 1.0), ("critic", self.critic_coeff), ("entropy", -self.entropy_coeff),
                            ("kl", self.kl_coeff)):
            if f"sum_{name}" in sums.keys():
                out[f"loss_{name}"] = sums[f"sum_{name}"] * (coeff * scale)
        return TensorDict(out, batch_size=[])

    def forward(self, tensordict: TensorDictBase, normalizer: LossNormalizer | None = None,
                outputs: TensorDictBase | None = None) -> TensorDictBase:
        """Losses and metrics of one micro-batch.

        Args:
            tensordict: ``[S]`` episode rows with ``[S, T]`` token keys (:mod:`crl.episode`) plus
                ``advantage`` and ``value_target`` from the value estimator.
            normalizer: the step's global counts (:meth:`normalizer`). ``None`` means this batch is the whole
                step on a single process (refused when ``torch.distributed`` has several ranks).
            outputs: the networks' outputs on ``tensordict`` (``log_prob``, ``entropy``, ``state_value``, with their
                graph) when the caller already ran them; the networks are then not called. A step whose values come
                from its own forward (:meth:`crl.training.update.PPOUpdate.fused_step_loss`) runs the network, then the
                estimator on the detached values, then this loss.

        Returns:
            A TensorDict of scalars (see the class docstring).
        """
        k = self.tensor_keys
        td = tensordict
        if td.batch_dims != 1:
            raise ValueError(f"CompactionPPOLoss: expected a batch of segment rows [S], got {list(td.batch_size)}")
        tokens = td.get(k.tokens)
        if tokens is None or tokens.ndim != 2:
            raise ValueError(f"CompactionPPOLoss: {k.tokens!r} must be a [S, T] tensor")
        shape = tokens.shape
        mask = self._get(td, k.loss_mask, shape, "loss mask").bool()
        if mask[:, 0].any():
            raise ValueError(
                "CompactionPPOLoss: token 0 is in the loss mask; position 0 has no log-prob or value "
                "(it is the system prompt), see crl.episode"
            )
        n_seg_tokens = mask.sum(-1)
        n_tokens, n_segments = int(n_seg_tokens.sum()), int((n_seg_tokens > 0).sum())
        if normalizer is None:
            normalizer = self._local_normalizer(n_tokens, n_segments)

        # Zero everything off the mask *before* arithmetic: garbage there (inf, NaN) must not reach sums/grads.
        def on(x: Tensor) -> Tensor:
            return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))

        def weights(dtype) -> Tensor:  # per-token weight of the aggregation, in the networks' dtype
            w = mask.to(dtype)
            return w / n_seg_tokens.clamp_min(1).to(dtype).unsqueeze(-1) if self.aggregation == "segment_mean" else w

        f = w = None
        sums = {"num_tokens": torch.tensor(n_tokens)}
        l_obj = ratio = log_ratio = ent = logp = actor_td = None
        if self.actor_network is not None:
            logp_old = self._get(td, k.sample_log_prob, shape, "behaviour log-prob")
            adv = self._get(td, k.advantage, shape, "advantage; run loss.value_estimator(batch) first")
            self._check_finite("sample_log_prob", logp_old, mask)
            self._check_finite("advantage", adv, mask)

            actor_td = outputs if outputs is not None else self.actor_network(td.select(*self.actor_network.in_keys))
            logp = self._get(actor_td, k.log_prob, shape, "actor output")
            self._check_finite("the actor's log_prob", logp, mask)
            ent = actor_td.get(k.entropy, None)
            f = logp.dtype
            w = weights(f)

            logp, logp_old, adv = on(logp), on(logp_old.to(f)), on(adv.to(f))
            log_ratio = logp - logp_old
            ratio = torch.exp(log_ratio)
            surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv)
            l_obj = -surr * w

            sums["sum_objective"] = l_obj.sum()
            if ent is not None:
                if ent.shape != shape:
                    raise ValueError(
                        f"CompactionPPOLoss: actor's {k.entropy!r} has shape {list(ent.shape)}, expected {list(shape)}"
                    )
                ent = on(ent.to(f))
                sums["sum_entropy"] = (ent * w).sum()
            elif self.entropy_coeff > 0:
                raise KeyError(f"CompactionPPOLoss: entropy_coeff > 0 but the actor does not write {k.entropy!r}")
            else:
                sums["sum_entropy"] = torch.zeros((), dtype=f, device=logp.device)

            if self.kl_coeff > 0:
                if self.kl_to == "behaviour":
                    q = logp_old
                else:
                    q = on(self._get(td, k.ref_log_prob, shape, "reference log-prob").to(f))
                    self._check_finite("ref_log_prob", q, mask)
                d = q - logp
                sums["sum_kl"] = ((torch.exp(d) - d - 1) * w).sum()
            else:
                sums["sum_kl"] = torch.zeros((), dtype=f, device=logp.device)

        l_crit = None
        if self.critic_network is not None:
            if self.shared_network and actor_td is not None:  # one network writes both: its forward already ran
                critic_td = actor_td
            elif outputs is not None:
                critic_td = outputs
            else:
                critic_td = self.critic_network(td.select(*self.critic_network.in_keys))
            v = self._get(critic_td, k.value, shape, "critic output")
            if f is None:
                f = v.dtype
                w = weights(f)
            v = on(v.to(f))
            y = self._get(td, k.value_target, shape, "value target; run loss.value_estimator(batch) first")
            self._check_finite("value_target", y, mask)
            self._check_finite("the critic's state_value", v, mask)
            y = on(y.to(f))
            err = (v - y).square()
            if self.clip_value is not None:
                v_old = self._get(td, k.value, shape, "old values for value clipping")
                self._check_finite("old state_value", v_old, mask)
                v_old = on(v_old.to(f))
                v_clip = v_old + (v - v_old).clamp(-self.clip_value, self.clip_value)
                err = torch.maximum(err, (v_clip - y).square())
            l_crit = err * w
            sums["sum_critic"] = l_crit.sum()

        out = self.reduce(TensorDict(sums, batch_size=[]), normalizer)
        for name, val in sums.items():
            out.set(name, val.detach())
        out.set("num_segments", torch.tensor(n_segments))

        # ---- metrics: over this micro-batch's optimized tokens only ----
        with torch.no_grad():
            nt = max(n_tokens, 1)

            def mean(x: Tensor) -> Tensor:
                return on(x.to(torch.float64)).sum() / nt

            if l_obj is not None:
                clipped = (ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)
                out.set("clip_fraction", mean(clipped.to(f)).to(f))
                out.set("approx_kl", mean(ratio - 1 - log_ratio).to(f))
                out.set("entropy", mean(ent if ent is not None else -logp).to(f))
            if l_crit is not None:
                y64, r64 = y.to(torch.float64), (y - v).to(torch.float64)
                var_y = mean(y64.square()) - mean(y64).square()
                var_r = mean(r64.square()) - mean(r64).square()
                ev = 1 - var_r / var_y if float(var_y) > 0 else torch.tensor(float("nan"), dtype=torch.float64)
                out.set("explained_variance", ev.to(f))
                # the moments a step pools over its micro-batches (explained_variance_of): a micro-batch of one
                # episode's rows has nearly constant targets, and a mean of per-micro-batch ratios explodes
                out.set("sum_ev_moments", torch.stack([on(y64).sum(), on(y64.square()).sum(), on(r64).sum(), on(r64.square()).sum()]))
            kind = td.get(k.segment_kind, None)
            if kind is not None:
                scale = normalizer.grad_scale / self.denominator(normalizer, n_tokens)
                for kname, kval in (("execution", SegmentKind.EXECUTION), ("summary", SegmentKind.SUMMARY)):
                    rows = (kind == int(kval)).unsqueeze(-1) & mask
                    out.set(f"num_tokens_{kname}", rows.sum())
                    if ent is not None:
                        out.set(f"sum_entropy_{kname}", (ent.to(torch.float64) * rows).sum())
                    if l_obj is not None:
                        out.set(f"objective_{kname}", (l_obj * rows).sum() * scale)
                    for lname, l in (("objective", l_obj), ("critic", l_crit)):
                        if l is None:
                            continue
                        total, part = l.abs().sum(), (l.abs() * rows).sum()
                        out.set(f"share_{lname}_{kname}", part / total if float(total) > 0 else torch.zeros((), dtype=f))
                        # the step's share is a ratio of sums over its micro-batches, not a mean of these ratios
                        out.set(f"sum_abs_{lname}_{kname}", part.to(torch.float64))
                        out.set(f"sum_abs_{lname}", total.to(torch.float64))
        return out
