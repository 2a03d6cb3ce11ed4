"""The main job's task (configs/default.yaml) has no way around the summary: a policy that never reads a summary
scores at chance however it plays — answering early, waiting for the question, or stalling with invalid commands
so that the fact lands in the steps kept after the forced compaction (``env.invalid_command: fail`` closes that).
The agents below read only their own context tokens, never the task object."""
import re
from pathlib import Path

import pytest

from crl.builders import build_compaction_config, build_suite
from crl.collectors import play_oracle_episode
from crl.compaction import CompactionEngine
from crl.config import load_config
from crl.envs import MemoryChainSuite
from crl.envs.base import INVALID_COMMAND_FAILED
from crl.episode import EpisodeStatus
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS

ROOT = Path(__file__).resolve().parents[1]
CODE = re.compile(r"code is (\d+)")


class BlindAgent:
    """Answers with the code visible in its current context (else ``guess``); summaries are ``none``.

    ``stall``: invalid commands issued before the first ``next`` (each is one atomic step, so the fact is revealed
    that many steps later); ``eager``: submit as soon as a code is visible. Wraps the environment so that
    :func:`crl.collectors.play_oracle_episode` plays it."""

    def __init__(self, env, guess: str, eager: bool, stall: int):
        self.env, self.guess, self.eager, self.stall, self.ctx = env, guess, eager, stall, None

    def __getattr__(self, name):
        return getattr(self.env, name)

    def oracle_action(self) -> str:
        if self.env.steps < self.stall:
            return "wait"
        found = CODE.findall(decode(self.ctx.context_ids))
        code = found[-1] if found else None
        if (self.eager and code is not None) or self.env.question_shown:
            return f"submit {code if code is not None else self.guess}"
        return "next"

    def step(self, command):
        return self.env.step(command)


def play(cfg, guess: str, eager: bool = False, stall: int = 0, split: str = "dev"):
    eos = load_tokenizer().convert_tokens_to_ids(EOS)
    suite = build_suite(cfg)
    engine = CompactionEngine(build_compaction_config(cfg, suite), encode, eos_id=eos)
    none = list(encode("none")) + [eos]
    rewards, statuses = [], []
    for task in suite.tasks(split):
        agent = BlindAgent(suite.make_env(task), guess, eager, stall)
        agent.ctx = engine.start(agent.env.reset())
        status, reward = play_oracle_episode(agent, agent.ctx, encode, eos, lambda env, ctx: (list(none), False))
        rewards.append(reward)
        statuses.append(status)
    return sum(rewards) / len(rewards), statuses


def default(*overrides):
    return load_config(ROOT / "configs" / "default.yaml", list(overrides))


def test_default_task_closes_both_shortcuts():
    cfg = default()
    assert (cfg.env.early_submit, cfg.env.invalid_command) == ("fail", "fail")
    chance = 1 / cfg.env.n_facts
    n_dev = len(build_suite(cfg).tasks("dev"))
    for guess in map(str, range(cfg.env.n_facts)):
        for eager in (False, True):
            for stall in range(cfg.env.extra_steps + 1):
                success, statuses = play(cfg, guess, eager, stall)
                assert set(statuses) == {EpisodeStatus.COMPLETED}
                assert success <= chance + 0.05, (guess, eager, stall, success)
    # each option closes one shortcut: with the other setting the same blind agents score 1.0
    assert play(default("env.early_submit=accept"), "0", eager=True)[0] == 1.0  # answers at step 2, fact visible
    stalled = play(default("env.invalid_command=observe"), "0", stall=1)[0]
    assert stalled == 1.0, "one invalid command first puts the fact into the steps kept after the compaction"
    # sanity: the agent reads its context (no compaction: perfect)
    assert play(default("compaction.enabled=false"), "0")[0] == 1.0
    assert n_dev >= 60


@pytest.mark.parametrize("command", ["wait", "submit", "Next"])
def test_invalid_command_fail_ends_the_episode_with_reward_0(command):
    """``invalid_command: fail``: anything but ``next`` / ``submit <answer>`` (``submit`` alone included) ends the
    episode, completed with reward 0; ``observe`` answers with an error observation and goes on."""
    for rule, done in (("fail", True), ("observe", False)):
        suite = MemoryChainSuite(length=3, invalid_command=rule)
        env = suite.make_env(suite.tasks("train")[0])
        env.reset()
        result = env.step(command)
        assert result.done is done and result.reward == 0.0 and result.info["invalid"] is True
        assert (result.observation == INVALID_COMMAND_FAILED) is done
        assert not result.info["truncated"]
    with pytest.raises(ValueError, match="invalid_command must be one of"):
        MemoryChainSuite(length=3, invalid_command="ignore")
