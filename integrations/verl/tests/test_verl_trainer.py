"""The trainer hook (``trainer.v1.trainer_mode=compaction_sync``): its advantage step on a real verl ``DataProto`` built as
verl 0.9.1's ``_compute_advantage`` builds it, and its ``_compute_advantage`` itself through a real TransferQueue (on
a local Ray), give crl's numbers; verl's own estimators still run through it; wrong set-ups fail naming the fix."""
from __future__ import annotations

import pytest
import torch
from conftest import make_episodes, to_crl_layout, verl_config

from crl.objectives.functional import cross_trajectory_gae
from crl.objectives.options import EstimatorOptionError
from crl_verl import trainer as hook
from crl_verl.rows import rows_from_episodes
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]


def v1_rows(episodes, seed=0):
    """The rows as verl v1 stores them in TransferQueue (one dict per row, response fields of the row's own length),
    shuffled, with their keys and the permutation."""
    data, keys = rows_from_episodes(episodes)
    g = torch.Generator().manual_seed(seed)
    P = data.batch["prompts"].shape[1]
    lengths = data.batch["attention_mask"][:, P:].sum(-1)
    old = -torch.rand(data.batch["response_mask"].shape, generator=g)
    ref = old - 0.1 * torch.rand(old.shape, generator=g)
    perm = torch.randperm(len(keys), generator=g)
    rows = []
    for b in perm.tolist():
        n = int(lengths[b])
        rows.append({"uid": data.non_tensor_batch["uid"][b], "response_mask": data.batch["response_mask"][b, :n],
                     "rm_scores": data.batch["rm_scores"][b, :n], "rollout_log_probs": data.batch["rollout_log_probs"][b, :n],
                     "old_log_probs": old[b, :n], "ref_log_prob": ref[b, :n], "values": data.batch["values"][b, :n]})
    return rows, [keys[b] for b in perm.tolist()], perm


def as_verl_builds_it(rows):
    """verl 0.9.1 ``PPOTrainer._compute_advantage``'s own DataProto from TransferQueue's nested fields."""
    import numpy as np

    td = list_of_dict_to_tensordict(rows)
    data = DataProto(batch=td.select(*[f for f in FIELDS if f != "uid"]).to_padded_tensor())
    data.non_tensor_batch["uid"] = np.array(list(td["uid"]), dtype=object)
    return data


def crl_numbers(episodes, **opts):
    return cross_trajectory_gae(episodes["state_value"], episodes["loss_mask"], episodes["reward"], episodes["n_after"],
                                episodes["rollout_length"], **opts)


def unshuffle(x, perm):
    out = torch.zeros((len(perm),) + tuple(x.shape[1:]), dtype=x.dtype)
    out[perm] = x
    return out


def rows_to_crl(x, perm, episodes):
    """A shuffled, padded-to-the-batch [B, L'] tensor back to crl's layout."""
    width = int(episodes["tokens"].shape[1])
    x = torch.nn.functional.pad(x, (0, max(0, width - x.shape[1])))
    return to_crl_layout(unshuffle(x, perm), episodes)


def test_advantage_step_on_a_real_dataproto_gives_crls_numbers():
    td = make_episodes(21)
    rows, keys, perm = v1_rows(td)
    cfg = verl_config(alpha=1.5, lambda_length="rollout")
    data = hook.advantage_step(as_verl_builds_it(rows), keys, cfg)
    want_adv, want_ret = crl_numbers(td, alpha=1.5, lambda_length="rollout")
    assert torch.equal(rows_to_crl(data.batch["advantages"], perm, td), want_adv)
    assert torch.equal(rows_to_crl(data.batch["returns"], perm, td), want_ret)
    assert torch.equal(data.batch["token_level_rewards"], data.batch["rm_scores"])


def test_advantage_step_with_kl_in_reward_uses_verls_penalty():
    td = make_episodes(22)
    rows, keys, perm = v1_rows(td)
    cfg = verl_config(gamma=0.99, lmbda=0.95)
    cfg.algorithm.use_kl_in_reward = True
    cfg.algorithm.kl_penalty = "kl"
    beta = 0.2
    data = hook.advantage_step(as_verl_builds_it(rows), keys, cfg, kl_ctrl=core_algos.FixedKLController(beta))
    mask = data.batch["response_mask"]
    kl_rows = -beta * (data.batch["old_log_probs"] - data.batch["ref_log_prob"]) * mask  # kl = log π_old - log π_ref
    torch.testing.assert_close(data.batch["token_level_rewards"] - data.batch["rm_scores"], kl_rows)
    kl_term = rows_to_crl(data.batch["token_level_rewards"].double() - data.batch["rm_scores"].double(), perm, td)
    want_adv, want_ret = crl_numbers(td, gamma=0.99, lmbda=0.95, kl_penalty=kl_term)
    assert torch.equal(rows_to_crl(data.batch["advantages"], perm, td), want_adv)
    assert torch.equal(rows_to_crl(data.batch["returns"], perm, td), want_ret)


def test_the_trainer_is_verls_sync_trainer_under_its_name():
    cls = get_trainer_cls("compaction_sync")
    assert cls is hook.CompactionPPOTrainer
    trainer = cls(verl_config(alpha=1.5))
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer) is ReplayBuffer and trainer.use_critic


def test_wrong_setups_fail_naming_the_fix():
    with pytest.raises(hook.UnsupportedVerlError, match=r"pip install verl==0\.9\.1"):
        hook.check_verl_version("0.9.2")
    cfg = verl_config()
    cfg.critic.enable = None
    with pytest.raises(ValueError, match="critic.enable=True"), pytest.warns(UserWarning, match="Disabled critic"):
        hook.CompactionPPOTrainer(cfg)
    with pytest.raises(EstimatorOptionError, match="algorithm.compaction_gae.value_target"):
        hook.CompactionPPOTrainer(verl_config(value_target="global"))
    cfg = verl_config()
    cfg.algorithm.use_pf_ppo = True
    with pytest.raises(ValueError, match="algorithm.use_pf_ppo=False"):
        hook.CompactionPPOTrainer(cfg)
    cfg = verl_config()
    cfg.trainer.v1.trainer_mode = "colocate_async"
    with pytest.raises(ValueError, match="synchronous"):
        hook.CompactionPPOTrainer(cfg)


# ------------------------------------------------------------------------------------------------------------------
# the hook itself, through TransferQueue
# ------------------------------------------------------------------------------------------------------------------


def put_rows(tq, rows, keys, partition="train"):
    from transfer_queue import KVBatchMeta

    tags = [{"status": "success"} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(rows), tags=tags)
    return KVBatchMeta(keys=keys, tags=tags, partition_id=partition)


def test_compute_advantage_through_transfer_queue(transfer_queue):
    tq = transfer_queue
    td = make_episodes(23)
    rows, keys, perm = v1_rows(td, seed=1)
    trainer = hook.CompactionPPOTrainer(verl_config(gamma=0.98, alpha=1.5, lambda_length="segment", value_target="corrected"))
    metrics = {}
    batch = trainer._compute_advantage(put_rows(tq, rows, keys), metrics)
    out = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "returns"]).to_padded_tensor()
    want_adv, want_ret = crl_numbers(td, gamma=0.98, alpha=1.5, lambda_length="segment", value_target="corrected")
    assert torch.equal(rows_to_crl(out["advantages"], perm, td), want_adv)
    assert torch.equal(rows_to_crl(out["returns"], perm, td), want_ret)
    tq.kv_clear(keys=keys, partition_id="train")


def test_other_estimators_run_verls_own_step(transfer_queue):
    """With algorithm.adv_estimator=gae the hook is verl's method: verl's own GAE numbers come back."""
    tq = transfer_queue
    td = make_episodes(24, values="finite", trailing_obs=False)
    rows, keys, perm = v1_rows(td, seed=2)
    keys = ["g" + k for k in keys]
    cfg = verl_config()
    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.lam = 0.9
    trainer = hook.CompactionPPOTrainer(cfg)
    batch = trainer._compute_advantage(put_rows(tq, rows, keys), {})
    out = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["returns"]).to_padded_tensor()
    data = as_verl_builds_it(rows)
    _, want = core_algos.compute_gae_advantage_return(data.batch["rm_scores"], data.batch["values"], data.batch["response_mask"],
                                                      gamma=1.0, lam=0.9)
    m = data.batch["response_mask"].bool()
    torch.testing.assert_close(out["returns"][m], want[m])
    tq.kv_clear(keys=keys, partition_id="train")
