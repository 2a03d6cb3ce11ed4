"""How the learner computes per-token outputs of segment rows: prefix sharing and length-aware chunks.

The episode contract (:mod:`crl.episode`) keeps one row per segment, and the estimator and the loss read them per
segment. The learner does not have to *run* one row per segment: an execution segment that ends in a compaction
is an exact token prefix of the summary-request segment after it (Eq. 8: the request is ``h_t + q_sum``), and a
causal model's output at position ``t`` depends only on ``tokens[:t + 1]``. So (docs/design.md §11):

* :func:`plan_forward` finds every row whose valid tokens are an exact prefix of the next segment of the same
  rollout (tokens are compared, never assumed; chains are followed) and keeps the *forward rows* -- rows no
  other row covers. Every segment row reads its outputs from one forward row at the same positions (a prefix
  starts at 0). Forward rows are sorted by length and cut into *chunks* whose padding is at most
  ``max_padding`` of the positions they process (and at most ``max_chunk_tokens`` positions each); a chunk is
  trimmed to its own longest row.
* :class:`PrefixSharedForward` wraps the network (``CausalLMLogProbs``, ``ValueModel`` or anything called as
  ``net(tokens, attention_mask)``), runs it once per chunk and scatters the outputs back to ``[S, T]`` exactly
  where a per-segment forward puts them (zeros on padding). It is a drop-in for the ``TensorDictModule`` of the
  actor or the critic inside :class:`~crl.objectives.CompactionPPOLoss`; the loss and the estimator do not change.
  Gradients flow back through the gather: a shared position receives the gradient of every segment reading it.
* Branch groups (``branch_group`` / ``branch_start``, :mod:`crl.episode`: one context continued by several summaries):
  a sibling's rows below ``branch_start`` are the first sibling's, token for token (compared), and read its outputs;
  the siblings' rows at one segment index share their first tokens (the summary request, the resume context's start),
  so they run as one *shared-prefix chunk*: the common prefix once, then every row's rest against its keys and values
  (:func:`crl.modules.networks.trunk_hidden`; the network is called with ``shared_prefix=P``). The prefix of a branch
  group is thus computed once for all its rollouts, in both the values' pass and the loss's forward and backward.
* :func:`split_microbatches` makes exactly ``n`` micro-batches balanced by forward tokens and never separates a
  row from the forward row it reads (a prefix pair is never split across micro-batches), nor the rows of one
  shared-prefix chunk.
* Counters (:class:`ForwardPlan`, :func:`learner_metrics`): ``learner_tokens`` (positions through the network,
  padding included), ``unique_tokens`` (sum of the forward rows' valid lengths: distinct (rollout, position)
  pairs the loss and the values need), ``padding_frac``, and ``naive_tokens`` (what one padded forward of all
  rows processes: ``S * T``).

Data parallel: the trainer's ranks hold different rows, hence different chunk counts. DDP broadcasts buffers
(e.g. Llama's rotary ``inv_freq``) and ZeRO-3 gathers parameters in *every* forward call, so ranks must make the
same number of calls: with ``torch.distributed`` initialised the wrapper all-reduces the chunk count (MAX) and
pads with one-token dummy chunks whose outputs join the graph with weight 0, each only its own output's (a value read
off detached features stays off the trunk: under DeepSpeed a shared trunk's value head is stepped by an engine of its
own, and ZeRO reduces a gradient only where every rank computes one).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn

__all__ = [
    "ForwardPlan",
    "plan_forward",
    "PrefixSharedForward",
    "split_microbatches",
    "microbatch_rows",
    "split_rows",
    "learner_metrics",
    "enable_gradient_checkpointing",
]

DEFAULT_MAX_PADDING = 0.04  # per chunk; 1 / (1 - 0.04) = 1.042 keeps learner/unique tokens <= 1.05 from padding
# siblings' rows sharing fewer leading tokens run whole: a second forward call costs more than a few positions
DEFAULT_MIN_SHARED_PREFIX = 16


@dataclass
class ForwardPlan:
    """Which rows the learner runs and where every segment row reads its outputs.

    Attributes:
        lengths: ``[S]`` valid tokens of every segment row.
        source: ``[S]`` the forward row (a row index of the batch) each segment row reads from; itself for
            forward rows, ``-1`` for a row with no valid token (outputs are zeros).
        chunks: forward calls: ``(rows, length)`` -- batch row indices (longest first) and the trimmed length.
        seq_len: ``T`` of the batch.
        shared: per chunk, the number of leading tokens all its rows share and that run once (0: none).
    """

    lengths: Tensor
    source: Tensor
    chunks: list[tuple[Tensor, int]]
    seq_len: int
    shared: list[int] = None

    def __post_init__(self):
        if self.shared is None:
            self.shared = [0] * len(self.chunks)

    @property
    def forward_rows(self) -> Tensor:
        return torch.cat([rows for rows, _ in self.chunks]) if self.chunks else torch.zeros(0, dtype=torch.long)

    @property
    def num_rows(self) -> int:
        return int(self.lengths.numel())

    @property
    def shared_rows(self) -> int:
        """Segment rows read from another row's forward."""
        idx = torch.arange(self.num_rows)
        return int(((self.source >= 0) & (self.source != idx)).sum())

    @property
    def learner_tokens(self) -> int:
        """Positions through the network, padding included; a shared-prefix chunk runs its prefix once."""
        return sum(int(rows.numel()) * (length - P) + P for (rows, length), P in zip(self.chunks, self.shared))

    @property
    def unique_tokens(self) -> int:
        """Distinct positions the loss and the values need: the forward rows' valid tokens, a shared prefix counted once."""
        rows = self.forward_rows
        total = int(self.lengths[rows].sum()) if rows.numel() else 0
        return total - sum((int(r.numel()) - 1) * P for (r, _), P in zip(self.chunks, self.shared))

    @property
    def segment_tokens(self) -> int:
        """Valid tokens of all segment rows (a padding-free per-segment forward)."""
        return int(self.lengths.sum())

    @property
    def naive_tokens(self) -> int:
        """Positions of one padded forward over all rows (today's learner)."""
        return self.num_rows * self.seq_len

    @property
    def padding_frac(self) -> float:
        lt = self.learner_tokens
        return 1.0 - self.unique_tokens / lt if lt else 0.0

    def counts(self) -> dict:
        return {
            "rows": self.num_rows,
            "shared_rows": self.shared_rows,
            "forward_calls": len(self.chunks),
            "learner_tokens": self.learner_tokens,
            "unique_tokens": self.unique_tokens,
            "segment_tokens": self.segment_tokens,
            "naive_tokens": self.naive_tokens,
        }


def _valid_lengths(mask: Tensor) -> Tensor:
    """Row lengths of a right-padded mask; refuses holes or left padding (positions must start at 0)."""
    mask = mask.bool()
    lengths = mask.sum(-1)
    expect = torch.arange(mask.shape[-1]).unsqueeze(0) < lengths.unsqueeze(-1)
    if not torch.equal(mask, expect):
        bad = int((mask != expect).any(-1).nonzero()[0])
        raise ValueError(
            f"plan_forward: row {bad}'s attention mask is not one run of True from position 0 (right padding, "
            "tokens left-aligned, see crl.episode); prefix sharing needs positions that start at 0"
        )
    return lengths


def _covering_rows(tokens: Tensor, lengths: Tensor, rollout: Tensor, segment: Tensor) -> Tensor:
    """``parent[s]`` = the next segment of ``s``'s rollout when ``s``'s valid tokens are an exact prefix of it, else ``s``."""
    S, T = tokens.shape
    parent = torch.arange(S)
    if S < 2:
        return parent
    order = torch.sort(segment, stable=True).indices
    order = order[torch.sort(rollout[order], stable=True).indices]  # by rollout, then segment index
    a, b = order[:-1], order[1:]
    cand = (rollout[a] == rollout[b]) & (segment[b] == segment[a] + 1) & (lengths[a] <= lengths[b]) & (lengths[a] > 0)
    a, b = a[cand], b[cand]
    if a.numel():
        inside = torch.arange(T).unsqueeze(0) < lengths[a].unsqueeze(-1)
        exact = ((tokens[a] == tokens[b]) | ~inside).all(-1)
        parent[a[exact]] = b[exact]
    return parent


def _branch_covering(parent: Tensor, tokens: Tensor, lengths: Tensor, rollout: Tensor, segment: Tensor, group: Tensor,
                     start: Tensor) -> Tensor:
    """``parent`` with every sibling's row below its group's ``branch_start`` pointed at the first sibling's row of the same
    segment, where their valid tokens are equal (compared: a row that differs keeps its own forward)."""
    below = segment < start
    if not below.any():
        return parent
    parent = parent.clone()
    rows = below.nonzero().squeeze(-1)
    # the first sibling (smallest rollout id) of each (group, segment): sort by group, segment, rollout
    order = rows[torch.argsort(rollout[rows], stable=True)]
    order = order[torch.argsort(segment[order], stable=True)]
    order = order[torch.argsort(group[order], stable=True)]
    ref = order[0]
    for row in order.tolist():
        if group[row] != group[ref] or segment[row] != segment[ref]:
            ref = row
            continue
        n = int(lengths[row])
        if row != ref and n == int(lengths[ref]) and torch.equal(tokens[row, :n], tokens[ref, :n]):
            parent[row] = ref
    return parent


def _shared_prefix_clusters(forward_rows: Tensor, tokens: Tensor, lengths: Tensor, segment: Tensor, group: Tensor, min_shared: int):
    """Forward rows of one branch group at one segment index (siblings: their summary rows at the branch point, their
    execution rows after it), with the number of leading tokens they all share (their longest common prefix, below
    the shortest row's length). Clusters of one row, or sharing fewer than ``min_shared`` tokens, are not returned."""
    out = []
    key = group[forward_rows] * (int(segment.max()) + 1 if segment.numel() else 1) + segment[forward_rows]
    for k in key.unique().tolist():
        rows = forward_rows[key == k]
        if rows.numel() < 2:
            continue
        shortest = int(lengths[rows].min())
        same = (tokens[rows, :shortest] == tokens[rows[:1], :shortest]).all(0)
        P = int(same.long().cumprod(0).sum())
        P = min(P, shortest - 1)  # every row keeps a token of its own to run against the prefix
        if P >= min_shared:
            out.append((rows, P))
    return out


def _chunks(rows: Tensor, lengths: Tensor, max_padding: float, max_chunk_tokens: int | None) -> list[tuple[Tensor, int]]:
    """Greedy length buckets over rows sorted longest first: each chunk's padding <= ``max_padding``."""
    if rows.numel() == 0:
        return []
    L = lengths[rows]
    order = torch.sort(L, descending=True, stable=True).indices
    rows, L = rows[order].tolist(), L[order].tolist()
    out, start = [], 0
    while start < len(rows):
        top, total, end = L[start], L[start], start + 1
        while end < len(rows):
            n = end - start + 1
            if max_chunk_tokens is not None and n * top > max_chunk_tokens:
                break
            if 1.0 - (total + L[end]) / (n * top) > max_padding + 1e-12:
                break
            total += L[end]
            end += 1
        out.append((torch.tensor(rows[start:end], dtype=torch.long), int(top)))
        start = end
    return out


def plan_forward(
    td: TensorDictBase,
    *,
    max_padding: float = DEFAULT_MAX_PADDING,
    max_chunk_tokens: int | None = None,
    share_prefixes: bool = True,
    min_shared_prefix: int = DEFAULT_MIN_SHARED_PREFIX,
    tokens_key: NestedKey = "tokens",
    mask_key: NestedKey = "attention_mask",
    rollout_key: NestedKey = "rollout_id",
    segment_key: NestedKey = "segment_index",
    branch_group_key: NestedKey = "branch_group",
    branch_start_key: NestedKey = "branch_start",
) -> ForwardPlan:
    """Plan the learner's forward over the segment rows ``[S, T]`` of ``td`` (see the module docstring).

    Sharing needs ``rollout_key`` and ``segment_key``; without them (or with ``share_prefixes=False``) every
    row is its own forward row and only the length buckets apply. Branch groups need ``branch_group_key`` and
    ``branch_start_key`` too (absent: none); siblings' rows sharing at least ``min_shared_prefix`` leading tokens run
    as a shared-prefix chunk (``None``: never). Runs on CPU copies of the integer keys.
    """
    if not 0 <= max_padding < 1:
        raise ValueError(f"plan_forward: max_padding={max_padding} must be in [0, 1)")
    if max_chunk_tokens is not None and max_chunk_tokens < 1:
        raise ValueError(f"plan_forward: max_chunk_tokens={max_chunk_tokens} must be >= 1 or None")
    tokens = td.get(tokens_key)
    if tokens is None or tokens.ndim != 2:
        raise ValueError(f"plan_forward: {tokens_key!r} must be a [S, T] tensor")
    tokens = tokens.detach().cpu()
    lengths = _valid_lengths(td.get(mask_key).detach().cpu())
    S, T = tokens.shape
    parent = torch.arange(S)
    rollout, segment = td.get(rollout_key, None), td.get(segment_key, None)
    group = td.get(branch_group_key, None) if branch_group_key is not None else None
    start = td.get(branch_start_key, None) if branch_start_key is not None else None
    branched = share_prefixes and rollout is not None and segment is not None and group is not None and start is not None
    if share_prefixes and rollout is not None and segment is not None:
        rollout, segment = rollout.detach().cpu().long(), segment.detach().cpu().long()
        parent = _covering_rows(tokens, lengths, rollout, segment)
        if branched:
            group, start = group.detach().cpu().long(), start.detach().cpu().long()
            parent = _branch_covering(parent, tokens, lengths, rollout, segment, group, start)
    root = parent
    while True:  # follow chains (a covering row may itself be covered); at most one hop per segment
        nxt = parent[root]
        if torch.equal(nxt, root):
            break
        root = nxt
    source = torch.where(lengths > 0, root, torch.full_like(root, -1))
    forward_rows = torch.nonzero((source == torch.arange(S))).squeeze(-1)
    chunks, shared = [], []
    if branched and min_shared_prefix is not None:
        for rows, P in _shared_prefix_clusters(forward_rows, tokens, lengths, segment, group, max(int(min_shared_prefix), 1)):
            rows = rows[torch.sort(lengths[rows], descending=True, stable=True).indices]
            chunks.append((rows, int(lengths[rows[0]])))
            shared.append(P)
        if chunks:
            clustered = torch.cat([rows for rows, _ in chunks])
            forward_rows = forward_rows[~torch.isin(forward_rows, clustered)]
    rest = _chunks(forward_rows, lengths, max_padding, max_chunk_tokens)
    return ForwardPlan(lengths, source, chunks + rest, T, shared + [0] * len(rest))


def learner_metrics(plans: Sequence[ForwardPlan], prefix: str = "perf/") -> dict:
    """Summed counters of several plans (e.g. the micro-batches of one pass) as metrics."""
    c = {}
    for p in plans:
        for k, v in p.counts().items():
            c[k] = c.get(k, 0) + v
    lt, ut = c.get("learner_tokens", 0), c.get("unique_tokens", 0)
    return {
        f"{prefix}learner_tokens": lt,
        f"{prefix}unique_tokens": ut,
        f"{prefix}naive_tokens": c.get("naive_tokens", 0),
        f"{prefix}padding_frac": 1.0 - ut / lt if lt else 0.0,
        f"{prefix}learner_unique_ratio": lt / ut if ut else float("nan"),
        f"{prefix}shared_rows": c.get("shared_rows", 0),
        f"{prefix}forward_calls": c.get("forward_calls", 0),
    }


def _world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


class PrefixSharedForward(TensorDictModuleBase):
    """Run ``net(tokens, attention_mask)`` once per planned chunk; write ``out_keys`` as a per-segment forward would.

    Args:
        net: a module called as ``net(tokens [B, L], attention_mask [B, L])`` returning one ``[B, L, ...]`` tensor
            or a tuple of them, one per ``out_keys`` entry, zero on padding (``CausalLMLogProbs``, ``ValueModel``,
            a DDP / DeepSpeed wrapper of them).
        out_keys: e.g. ``["log_prob", "entropy"]`` or ``["state_value"]``.

    Keyword Args:
        max_padding, max_chunk_tokens, share_prefixes: see :func:`plan_forward`. ``max_chunk_tokens`` bounds one
            forward call; the activations kept for backward still add up over the chunks of a micro-batch.
        needed_key: a ``[S, T]`` bool key (``"loss_mask"``) marking the positions whose outputs anyone reads: the
            network is then called with ``needed=`` (each forward row's union over the segment rows reading it) and
            may compute its per-token outputs there alone (:meth:`crl.modules.networks.CausalLMLogProbs.outputs_at`);
            outputs elsewhere are then 0. None (or the key absent from the input): every position's.
        sync_ranks: pad to the same number of forward calls on every rank (default: when ``torch.distributed``
            has several ranks). Needed by DDP (buffer broadcast per forward) and ZeRO-3 (gathers per forward).
        branch_group_key, branch_start_key: the branch keys (:mod:`crl.episode`) of batches with branch groups
            (``train.branches`` > 1); None (default): no branch group. A shared-prefix chunk calls the network with
            ``shared_prefix=P`` where its ``forward`` takes that argument (the networks of :mod:`crl.modules.networks`),
            and runs its rows whole elsewhere.
        min_shared_prefix: see :func:`plan_forward`.

    ``in_keys`` are tokens, attention mask, rollout id and segment index (and the branch keys when given), so
    ``CompactionPPOLoss`` (which calls its networks on ``td.select(*in_keys)``) hands over what the plan needs.
    ``counters`` accumulates :meth:`ForwardPlan.counts` over calls; :meth:`pop_counters` returns and resets them.
    """

    def __init__(
        self,
        net: nn.Module,
        out_keys: Sequence[NestedKey],
        *,
        tokens_key: NestedKey = "tokens",
        mask_key: NestedKey = "attention_mask",
        rollout_key: NestedKey = "rollout_id",
        segment_key: NestedKey = "segment_index",
        max_padding: float = DEFAULT_MAX_PADDING,
        max_chunk_tokens: int | None = None,
        share_prefixes: bool = True,
        sync_ranks: bool | None = None,
        needed_key: NestedKey | None = None,
        branch_group_key: NestedKey | None = None,
        branch_start_key: NestedKey | None = None,
        min_shared_prefix: int | None = DEFAULT_MIN_SHARED_PREFIX,
    ):
        super().__init__()
        self.net = net
        branch_keys = [k for k in (branch_group_key, branch_start_key) if k is not None]
        self.in_keys = [tokens_key, mask_key, rollout_key, segment_key] + branch_keys + ([needed_key] if needed_key is not None else [])
        self.needed_key = needed_key
        self.out_keys = list(out_keys)
        self.keys = dict(tokens_key=tokens_key, mask_key=mask_key, rollout_key=rollout_key, segment_key=segment_key,
                         branch_group_key=branch_group_key, branch_start_key=branch_start_key)
        self.plan_kwargs = dict(max_padding=max_padding, max_chunk_tokens=max_chunk_tokens, share_prefixes=share_prefixes,
                                min_shared_prefix=min_shared_prefix)
        module = getattr(net, "module", net)  # a DDP wrapper's module
        self.takes_shared_prefix = "shared_prefix" in inspect.signature(module.forward).parameters
        self.sync_ranks = sync_ranks
        self.counters: dict = {}
        self.last_plan: ForwardPlan | None = None

    def plan(self, td: TensorDictBase) -> ForwardPlan:
        return plan_forward(td, **self.plan_kwargs, **self.keys)

    def pop_counters(self) -> dict:
        out, self.counters = self.counters, {}
        return out

    def _num_calls(self, n: int, device) -> int:
        sync = self.sync_ranks if self.sync_ranks is not None else _world() > 1
        if not sync or _world() == 1:
            return n
        x = torch.tensor([n], dtype=torch.long, device=device)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        return int(x)

    def forward(self, tensordict: TensorDictBase, plan: ForwardPlan | None = None) -> TensorDictBase:
        tokens = tensordict.get(self.keys["tokens_key"])
        mask = tensordict.get(self.keys["mask_key"])
        plan = plan if plan is not None else self.plan(tensordict)
        self.last_plan = plan
        for k, v in plan.counts().items():
            self.counters[k] = self.counters.get(k, 0) + v
        S, T = tokens.shape
        dev = tokens.device
        # agree on the number of forward calls *before* the first one: DDP / ZeRO-3 forwards are collectives too
        extra = self._num_calls(len(plan.chunks), dev) - len(plan.chunks)
        needed = None
        need = tensordict.get(self.needed_key, None) if self.needed_key is not None else None
        if need is not None:  # a forward row serves every segment row that reads it: the union of their needs
            need, src = need.bool(), plan.source.to(dev)
            readers = src >= 0
            needed = torch.zeros(need.shape, dtype=torch.int32, device=dev).index_put_((src[readers],), need[readers].int(),
                                                                                      accumulate=True) > 0
        bufs: list[list[Tensor]] = [[] for _ in self.out_keys]
        for (rows, length), P in zip(plan.chunks, plan.shared):
            r = rows.to(dev)
            kw = {"shared_prefix": P} if P and self.takes_shared_prefix else {}
            res = self.net(tokens[r, :length], mask[r, :length], **kw) if needed is None else \
                self.net(tokens[r, :length], mask[r, :length], needed=needed[r, :length], **kw)
            res = (res,) if isinstance(res, Tensor) else tuple(res)
            if len(res) != len(self.out_keys):
                raise ValueError(f"PrefixSharedForward: the network returned {len(res)} outputs for out_keys {self.out_keys}")
            for buf, x in zip(bufs, res):
                if T > length:
                    x = torch.cat([x, x.new_zeros((x.shape[0], T - length) + tuple(x.shape[2:]))], dim=1)
                buf.append(x)
        dummies = [None] * len(self.out_keys)  # each output's own: a value read off detached features stays off the trunk
        # two tokens: position 0's outputs are constants (nothing precedes it), position 1's come from the network, so
        # a dummy forward also has a backward (ZeRO-3 gathers per module in backward too); a rank with no row uses pads
        two = tokens[:1, :2] if S and T >= 2 else tokens.new_zeros((1, 2))
        for _ in range(extra):  # keep ranks in lock-step; the outputs join the graph with weight 0
            # the real forwards' path (with ``needed``: the head on needed positions only), so every rank runs the
            # same modules in the same order: ZeRO-3's gathers are collectives matched call by call
            res = self.net(two, torch.ones_like(two)) if needed is None else \
                self.net(two, torch.ones_like(two), needed=torch.zeros_like(two, dtype=torch.bool))
            res = (res,) if isinstance(res, Tensor) else tuple(res)
            dummies = [x.sum() * 0.0 if d is None else d + x.sum() * 0.0 for d, x in zip(dummies, res)]
        # buffer row of every forward row, then the buffer row every segment row reads
        where = torch.full((S,), -1, dtype=torch.long)
        fwd = plan.forward_rows
        where[fwd] = torch.arange(fwd.numel())
        src = plan.source.clamp(min=0)
        idx = where[src].clamp(min=0).to(dev)
        valid = (torch.arange(T).unsqueeze(0) < plan.lengths.unsqueeze(-1)).to(dev)
        for key, buf, dummy in zip(self.out_keys, bufs, dummies):
            if buf:
                full = torch.cat(buf)[idx]
                v = valid.reshape(valid.shape + (1,) * (full.ndim - 2))
                out = torch.where(v, full, torch.zeros((), dtype=full.dtype, device=dev))
            elif not S:  # no row: an empty output (the per-token outputs are [S, T])
                out = torch.zeros((0, T), device=dev)
            else:  # no valid token anywhere: what a padded forward writes
                res = self.net(tokens, mask) if needed is None else self.net(tokens, mask, needed=needed)
                res = (res,) if isinstance(res, Tensor) else tuple(res)
                out = res[self.out_keys.index(key)]
            if dummy is not None:
                out = out + dummy
            tensordict.set(key, out)
        return tensordict


def split_microbatches(td: TensorDictBase, n: int, *, plan: ForwardPlan | None = None, **plan_kwargs) -> list[TensorDictBase]:
    """Exactly ``n`` micro-batches, balanced by forward tokens, never separating a row from the row it reads.

    Groups (a forward row and every row reading it) go largest first to the least-loaded micro-batch; rows keep
    their batch order inside a micro-batch. An empty micro-batch is one copied row with a zero loss mask (a real
    forward/backward contributing nothing), as DeepSpeed needs the same count on every rank.
    """
    return [td[torch.tensor(rows, dtype=torch.long)] if rows else placeholder_row(td)
            for rows in microbatch_rows(td, n, plan=plan, **plan_kwargs)]


def microbatch_rows(td: TensorDictBase, n: int, *, plan: ForwardPlan | None = None, **plan_kwargs) -> list[list[int]]:
    """The rows of ``td`` in each of :func:`split_microbatches`' ``n`` micro-batches (sorted; empty for a placeholder)."""
    if n < 1:
        raise ValueError(f"split_microbatches: n={n} must be >= 1")
    S = td.batch_size[0]
    plan = plan if plan is not None else plan_forward(td, **plan_kwargs)
    src = plan.source.clone()
    lone = src < 0
    src[lone] = torch.arange(S)[lone]
    unit = torch.arange(S)  # a shared-prefix chunk's rows are one unit: its prefix runs once for all of them
    cost_of = plan.lengths.clamp(min=1).clone()
    for (rows, _), P in zip(plan.chunks, plan.shared):
        if P:
            unit[rows] = int(rows[0])
            cost_of[int(rows[0])] = int(plan.lengths[rows].sum()) - (rows.numel() - 1) * P
    src = unit[src]
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(src.tolist()):
        groups.setdefault(g, []).append(row)
    cost = {g: max(int(cost_of[g]), 1) for g in groups}
    load, bins = [0] * n, [[] for _ in range(n)]
    for g in sorted(groups, key=lambda g: (-cost[g], g)):
        i = min(range(n), key=lambda i: (load[i], i))
        bins[i] += groups[g]
        load[i] += cost[g]
    return [sorted(rows) for rows in bins]


def split_rows(td: TensorDictBase, n: int) -> list[TensorDictBase]:
    """The naive learner's micro-batching (``learner.prefix_sharing=false``): exactly ``n`` groups of consecutive
    rows, each padded to the batch's ``T``; an empty one is a zero-loss-mask row (DeepSpeed needs ``n`` everywhere)."""
    return [td[idx] if len(idx) else placeholder_row(td) for idx in torch.arange(td.batch_size[0]).tensor_split(n)]


def placeholder_row(td: TensorDictBase) -> TensorDictBase:
    """One row that takes part in a forward/backward and contributes nothing: ``td``'s first row with a zero loss
    mask, or, when ``td`` has no row (a rank whose episodes all failed), a two-token row of zeros (pad tokens,
    attention on positions 0 and 1, everything else 0: position 1's output comes from the network, so the loss has a
    graph to backpropagate, of value 0). DeepSpeed, DDP and ZeRO-3 need the same number of micro-batches and
    forward/backward calls on every rank."""
    if td.batch_size[0]:
        row = td[:1].clone()
        row["loss_mask"].zero_()
        return row
    row = td.apply(lambda x: x.new_zeros((1, *x.shape[1:])), batch_size=[1])
    row["attention_mask"][:, :2] = 1
    return row


def enable_gradient_checkpointing(module: nn.Module) -> int:
    """Turn on activation checkpointing in every ``transformers`` model inside ``module`` (actor LM or critic
    backbone; non-reentrant). Active in ``train()`` mode only. Returns how many models were switched."""
    n = 0
    for m in module.modules():
        if hasattr(m, "gradient_checkpointing_enable") and getattr(m, "supports_gradient_checkpointing", False):
            if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x name
                if not m.is_activation_checkpointing:
                    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            elif not m.is_gradient_checkpointing:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            n += 1
    return n
