"""Checks of the rollouts across the evidence files: the two files agree, every trainable rollout is trained whole,
siblings share their outcome, and ``n_after`` / ``rollout_length`` are what the rollouts say.

* ``rollout_training_agree``: rows in both files agree on tokens, provenance, loss_mask, sample_log_prob and the
  per-segment fields.
* ``trainable_set_complete``: the trainable set (TRUNCATED always, FAILED unless ``failed_episodes: drop``; with
  ``uniform_groups: drop`` not the groups of two or more rollouts left whose rewards all agree) is in training.pt with
  all its segments; no training row without a rollout row; no row trained twice; an ``update_skipped`` iteration has
  only FAILED rollouts and an empty training.pt.
* ``branch_prefix_shared`` (runs with branch groups): every rollout of a branch group has the group's one
  ``branch_start``, and its rows below it are the first sibling's in tokens, provenance, loss mask and behaviour
  log-probs, in rollout.pt and in training.pt.
* ``siblings_share_reward_status``: rows of one rollout share reward, status and rollout_length; truncated / failed
  rollouts have reward 0; a rollout id is not reused by another iteration.
* ``n_after_rollout_length``: both recomputed from the complete rollouts match every stored row.
"""
from __future__ import annotations

from crl.audit.evidence import Evidence, first
from crl.audit.rows import Row, index_rows, row_diff
from crl.episode import EpisodeStatus


def check_rollout_training_agree(ev: Evidence):
    """The ``rollout_training_agree`` check (this module's docstring)."""
    ev.need_rows()
    bad, compared = [], 0
    for it in sorted(ev.train):
        roll, _ = index_rows(ev.roll.get(it, []), True)
        for row in ev.train[it]:
            other = roll.get(row.key)
            if other is None:
                continue  # reported by trainable_set_complete
            compared += 1
            d = row_diff(other, row, training=False)
            if d:
                bad.append(f"iter {it} rollout {row.rid} segment {row.seg}: {d} differ")
    return not bad and compared > 0, {"rows_compared": compared, "mismatches": len(bad), "examples": first(bad)}, (
        "; ".join(first(bad, 3)) or ("no row to compare" if not compared else f"{compared} rows identical"))


def check_trainable_set(ev: Evidence):
    """The ``trainable_set_complete`` check (this module's docstring)."""
    ev.need_rows()
    problems = []
    stats = {"collected": {}, "trainable": {}}
    n_roll = {s.name: 0 for s in EpisodeStatus}
    n_train = {s.name: 0 for s in EpisodeStatus}
    n_train_segments, completed_rewards, dropped, dropped_uniform = 0, [], 0, 0
    drop = ev.failed_episodes == "drop"
    for it in sorted(set(ev.roll) | set(ev.train)):
        roll, dups_r = index_rows(ev.roll.get(it, []), True)
        train, dups_t = index_rows(ev.train.get(it, []), False)
        problems += [f"iter {it}: rollout.pt rows conflict: {d}" for d in dups_r]
        problems += [f"iter {it}: row trained twice: {d}" for d in dups_t]
        skipped = any(m.get("update_skipped") is True for (i, _), m in ev.meta.items() if i == it)
        by_rollout: dict[int, list[Row]] = {}
        for row in roll.values():
            by_rollout.setdefault(row.rid, []).append(row)
        left_out = uniform_groups(by_rollout, drop) if ev.uniform_groups == "drop" else set()
        for rid, rows in sorted(by_rollout.items()):
            idx = sorted(r.seg for r in rows)
            if idx != list(range(len(idx))):
                problems.append(f"iter {it} rollout {rid}: rollout.pt segment indices {idx} have gaps")
            status = rows[0].status
            name = EpisodeStatus(status).name if status in set(map(int, EpisodeStatus)) else str(status)
            n_roll[name] = n_roll.get(name, 0) + 1
            if status == int(EpisodeStatus.COMPLETED):
                completed_rewards.append(rows[0].reward)
            failed = status == int(EpisodeStatus.FAILED)
            present = [r.seg for r in sorted(rows, key=lambda r: r.seg) if r.key in train]
            absent = [r.seg for r in sorted(rows, key=lambda r: r.seg) if r.key not in train]
            if skipped and not failed and rid not in left_out:
                problems.append(f"iter {it}: marked update_skipped (no trainable episode) but rollout {rid} is {name}")
            if failed and drop:
                dropped += 1
                if present:
                    problems.append(f"iter {it} rollout {rid} (FAILED): segments {present} are in training.pt although "
                                    "failed_episodes=drop")
            elif rid in left_out:
                dropped_uniform += 1
                if present:
                    problems.append(f"iter {it} rollout {rid}: segments {present} are in training.pt although its group's rewards all "
                                    "agree and uniform_groups=drop")
            elif absent and not skipped:
                problems.append(f"iter {it} rollout {rid} ({name}): segments {absent} are not in training.pt")
        if skipped and train:
            problems.append(f"iter {it}: marked update_skipped but training.pt holds {len(train)} rows")
        train_rollouts = {}
        for row in train.values():
            train_rollouts.setdefault(row.rid, row.status)
            n_train_segments += 1
            if row.key not in roll:
                problems.append(f"iter {it} rollout {row.rid} segment {row.seg}: in training.pt but not in rollout.pt")
        for status in train_rollouts.values():
            name = EpisodeStatus(status).name if status in set(map(int, EpisodeStatus)) else str(status)
            n_train[name] = n_train.get(name, 0) + 1
    total = sum(n_roll.values())
    completed = n_roll.get("COMPLETED", 0)
    stats["collected"] = {
        "rollouts": total, "by_status": n_roll,
        "completion_rate": completed / total if total else None,
        "success_rate_over_completed": (sum(r > 0 for r in completed_rewards) / completed) if completed else None,
        "mean_reward_over_completed": (sum(completed_rewards) / completed) if completed else None,
    }
    stats["failed_episodes"] = ev.failed_episodes
    stats["dropped_failed_rollouts"] = dropped
    stats["uniform_groups"] = ev.uniform_groups
    stats["dropped_uniform_rollouts"] = dropped_uniform
    stats["trainable"] = {"rollouts": sum(n_train.values()), "segments": n_train_segments, "by_status": n_train}
    stats["problems"] = first(problems, 20)
    rule = f"{dropped} FAILED dropped (failed_episodes=drop), the rest" if drop else "all"
    if ev.uniform_groups == "drop":
        rule = f"{dropped_uniform} in groups whose rewards agree dropped (uniform_groups=drop), " + rule
    detail = "; ".join(first(problems, 3)) or (
        f"{total} collected rollouts ({n_roll}): {rule} trained; trainable set {stats['trainable']['rollouts']} "
        f"rollouts / {n_train_segments} segments")
    return not problems and total > 0, stats, detail


def uniform_groups(by_rollout: dict[int, list[Row]], failed_dropped: bool) -> set[int]:
    """The rollouts the trainer leaves out with ``uniform_groups: drop``: among the rollouts not dropped as FAILED, those
    in a group (``branch_group``, else ``group_id``) of two or more whose rewards are all equal."""
    members: dict[int, list[int]] = {}
    reward = {}
    for rid, rows in by_rollout.items():
        row = rows[0]
        if failed_dropped and row.status == int(EpisodeStatus.FAILED):
            continue
        group = row.branch_group if row.branch_group is not None else row.group
        if group is None:
            raise RuntimeError(f"rollout {rid} has neither branch_group nor group_id, which uniform_groups=drop needs")
        members.setdefault(group, []).append(rid)
        reward[rid] = row.reward
    return {rid for rids in members.values() if len(rids) >= 2 and len({reward[r] for r in rids}) == 1 for rid in rids}


def check_branch_prefix(ev: Evidence):
    """The ``branch_prefix_shared`` check (this module's docstring)."""
    ev.need_rows()
    problems, groups, compared = [], 0, 0
    for it in sorted(set(ev.roll) | set(ev.train)):
        for name, rows in (("rollout.pt", ev.roll.get(it, [])), ("training.pt", ev.train.get(it, []))):
            by_group: dict[int, list[Row]] = {}
            for row in rows:
                if row.branch_group is not None:
                    by_group.setdefault(row.branch_group, []).append(row)
            for g, members in sorted(by_group.items()):
                groups += name == "rollout.pt"
                starts = {r.branch_start for r in members}
                if len(starts) != 1:
                    problems.append(f"iter {it} {name} branch group {g}: branch_start differs between siblings: {sorted(starts)}")
                    continue
                start = starts.pop()
                first_rid = min(r.rid for r in members)
                ref = {r.seg: r for r in members if r.rid == first_rid}
                for row in members:
                    if row.seg >= start or row.rid == first_rid:
                        continue
                    other = ref.get(row.seg)
                    compared += 1
                    if other is None:
                        problems.append(f"iter {it} {name} rollout {row.rid} segment {row.seg}: below branch_start {start} but the first "
                                        f"sibling (rollout {first_rid}) has no such segment")
                        continue
                    d = [k for k in ("tokens", "prov", "lm", "logp") if not (getattr(row, k).shape == getattr(other, k).shape
                                                                          and (getattr(row, k) == getattr(other, k)).all())]
                    if d:
                        problems.append(f"iter {it} {name} rollout {row.rid} segment {row.seg}: {d} differ from the first sibling "
                                        f"(rollout {first_rid}) below branch_start {start}")
    return not problems, {"branch_groups": groups, "rows_compared": compared, "problems": first(problems)}, (
        "; ".join(first(problems, 3))
        or f"{groups} branch groups: {compared} sibling rows equal to the first sibling's below the branch point")


def check_siblings(ev: Evidence):
    """The ``siblings_share_reward_status`` check (this module's docstring)."""
    ev.need_rows()
    problems, seen_in = [], {}
    n = 0
    for it in sorted(set(ev.roll) | set(ev.train)):
        groups: dict[int, list[Row]] = {}
        for row in ev.roll.get(it, []) + ev.train.get(it, []):
            groups.setdefault(row.rid, []).append(row)
        for rid, rows in groups.items():
            n += 1
            if rid in seen_in:
                problems.append(f"rollout id {rid} appears in iterations {seen_in[rid]} and {it}")
            seen_in[rid] = it
            for k in ("reward", "status", "rollout_length"):
                vals = sorted({repr(getattr(r, k)) for r in rows})
                if len(vals) > 1:
                    problems.append(f"iter {it} rollout {rid}: {k} differs between segments: {vals}")
            st = {r.status for r in rows}
            if st & {int(EpisodeStatus.TRUNCATED), int(EpisodeStatus.FAILED)} and any(r.reward != 0 for r in rows):
                problems.append(f"iter {it} rollout {rid}: truncated/failed rollout with non-zero reward")
            if not st <= set(map(int, EpisodeStatus)):
                problems.append(f"iter {it} rollout {rid}: unknown status {sorted(st)}")
    return not problems and n > 0, {"rollouts": n, "violations": len(problems), "examples": first(problems)}, (
        "; ".join(first(problems, 3)) or f"{n} rollouts: siblings share reward, status and rollout_length")


def check_n_after(ev: Evidence):
    """The ``n_after_rollout_length`` check (this module's docstring)."""
    ev.need_rows()
    problems, checked = [], 0
    for it in sorted(set(ev.roll) | set(ev.train)):
        by: dict[int, dict[int, Row]] = {}
        for row in ev.roll.get(it, []):
            by.setdefault(row.rid, {})[row.seg] = row
        recomputed = {}
        for rid, segs in by.items():
            idx = sorted(segs)
            if idx != list(range(len(idx))):
                problems.append(f"iter {it} rollout {rid}: segment indices {idx} have gaps; cannot recompute")
                continue
            n = [int((segs[k].lm == 1).sum()) for k in idx]
            total = sum(n)
            for k in idx:
                recomputed[(rid, k)] = (sum(n[k + 1:]), total)
        for row in ev.roll.get(it, []) + ev.train.get(it, []):
            if row.key not in recomputed:
                if row.rid not in by:
                    problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: rollout not in rollout.pt")
                continue
            checked += 1
            na, rl = recomputed[row.key]
            if (row.n_after, row.rollout_length) != (na, rl):
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: stored n_after/rollout_length "
                                f"{row.n_after}/{row.rollout_length}, recomputed {na}/{rl}")
    return not problems and checked > 0, {"rows_checked": checked, "mismatches": len(problems),
                                          "examples": first(problems)}, (
        "; ".join(first(problems, 3)) or f"{checked} rows match the recomputation")
