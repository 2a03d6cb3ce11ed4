"""The one status/reward mapping of an ended episode (crl.episode.terminal_outcome) against a plain truth table."""
import itertools

import pytest

from crl.episode import EpisodeStatus, terminal_outcome

C, T, F = EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED, EpisodeStatus.FAILED

# (failed, env_done, truncated) -> status; the reward is the verifier's only when COMPLETED, else 0
TABLE = {
    (False, True, False): C,  # the environment ended the task
    (False, True, True): T,  # the environment's own step limit
    (False, False, False): T,  # the engine's TRUNCATE (context full, no compaction left, max_steps)
    (False, False, True): T,
    (True, True, False): F,  # an error or timeout wins over everything
    (True, True, True): F,
    (True, False, False): F,
    (True, False, True): F,
}


@pytest.mark.parametrize("failed,env_done,truncated", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("reward", [0.0, 1.0, 0.25])
def test_terminal_outcome_truth_table(failed, env_done, truncated, reward):
    status, r = terminal_outcome(env_done, truncated, reward, failed=failed)
    assert status == TABLE[(failed, env_done, truncated)]
    assert r == (reward if status == C else 0.0) and isinstance(r, float)


def test_reward_only_read_when_completed():
    assert terminal_outcome(False, False, None) == (T, 0.0)  # nothing to score: no verifier reward needed
    assert terminal_outcome(True, False, 1) == (C, 1.0)
