"""verl's own ``gae`` on the same rows equals crl's no-cross-trajectory ablation with a fixed λ where the two should
agree (every response ends on a sampled token, so verl's reward position is the last sampled token), and shows the
reward-placement hazard where they should not: verl v1 puts the reward on the last response token whatever its mask,
and verl's ``gae`` drops a reward that sits on a trailing mask-0 token; ``compaction_gae`` does not."""
from __future__ import annotations

import pytest
import torch
from conftest import make_episodes, to_crl_layout, verl_config

from crl.objectives.functional import cross_trajectory_gae
from crl_verl import estimator as est
from crl_verl.rows import rows_from_episodes
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F


def _ends_on(data, sampled: bool) -> torch.Tensor:
    length = data.batch["responses"].ne(0).sum(-1)  # tokens are never 0 in these episodes
    last = data.batch["response_mask"].gather(1, (length - 1).unsqueeze(1)).squeeze(1)
    return last == int(sampled)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.97, 0.8), (1.0, 1.0)])
def test_verl_gae_equals_crl_ablation_where_they_agree(gamma, lam):
    td = make_episodes(11, n_rollouts=8, values="finite", trailing_obs=False)
    data, keys = rows_from_episodes(td)
    mask = data.batch["response_mask"]
    has = mask.sum(-1) > 0
    assert _ends_on(data, sampled=True)[has].all(), "every response with a sampled token ends on one"
    verl_adv, verl_ret = core_algos.compute_gae_advantage_return(
        token_level_rewards=data.batch["rm_scores"], values=data.batch["values"], response_mask=mask, gamma=gamma, lam=lam)
    a_loc, target = cross_trajectory_gae(td["state_value"], td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                         gamma=gamma, lmbda=lam, cross_trajectory=False)
    on, m = td["loss_mask"], mask.bool()  # the same sampled tokens, in the same row-major order
    # returns = A_loc + V (crl's local value target); verl's advantages are its masked_whiten of the same A_loc
    torch.testing.assert_close(verl_ret[m], target[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((verl_ret - data.batch["values"])[m], a_loc[on], rtol=1e-5, atol=1e-5)
    crl_rows = torch.zeros_like(verl_adv)
    crl_rows[m] = a_loc[on]
    torch.testing.assert_close(verl_adv[m], verl_F.masked_whiten(crl_rows, mask)[m], rtol=1e-4, atol=1e-5)
    # and the registered estimator with the ablation's options gives crl's numbers on the same rows
    adv, ret = est.compute_compaction_gae_advantage(
        data.batch["rm_scores"], mask, config=verl_config(gamma=gamma, lmbda=lam, cross_trajectory=False).algorithm,
        values=data.batch["values"], row_keys=keys)
    assert torch.equal(to_crl_layout(adv, td), a_loc) and torch.equal(to_crl_layout(ret, td), target)


def test_reward_on_a_trailing_observation_is_dropped_by_verl_gae_not_by_compaction_gae():
    td = make_episodes(12, n_rollouts=8, values="finite", trailing_obs=True)
    data, keys = rows_from_episodes(td)  # verl v1's placement: the last response token
    mask, rm = data.batch["response_mask"], data.batch["rm_scores"]
    hazard = _ends_on(data, sampled=False) & (rm.sum(-1) != 0) & (mask.sum(-1) > 0)
    assert hazard.sum() >= 3, "rows whose reward sits on a trailing observation"
    gamma, lam = 1.0, 0.95
    _, ret = core_algos.compute_gae_advantage_return(token_level_rewards=rm, values=data.batch["values"], response_mask=mask,
                                                     gamma=gamma, lam=lam)
    _, ret_no_reward = core_algos.compute_gae_advantage_return(token_level_rewards=torch.zeros_like(rm), values=data.batch["values"],
                                                               response_mask=mask, gamma=gamma, lam=lam)
    m = mask[hazard].bool()
    assert torch.equal(ret[hazard][m], ret_no_reward[hazard][m]), "verl's gae: the reward never reaches these rows"
    within = verl_config(gamma=gamma, lmbda=lam, cross_trajectory=False).algorithm
    adv, ret_c = est.compute_compaction_gae_advantage(rm, mask, config=within, values=data.batch["values"], row_keys=keys)
    a_loc, target = cross_trajectory_gae(td["state_value"], td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                         gamma=gamma, lmbda=lam, cross_trajectory=False)
    assert torch.equal(to_crl_layout(ret_c, td), target), "compaction_gae puts R on the last sampled token"
    assert not torch.allclose(ret_c[hazard][m], ret[hazard][m])
