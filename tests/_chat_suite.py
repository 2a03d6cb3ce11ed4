"""A small TorchRL chat suite for the torchrl_chat tests: a tool that echoes a long line, a verifier on ``FINAL <word>``.

``make_suite`` is an ``env.factory`` (``tests._chat_suite:make_suite``). The task: the secret word is in the task text;
each assistant message gets a tool reply of ``filler`` characters (so compaction triggers from the budget); an
assistant message ``FINAL <word>`` ends the episode with reward 1 if the word is the secret.
"""
from __future__ import annotations

import torch
from torchrl.data import Composite, Unbounded
from torchrl.envs import TransformedEnv
from torchrl.envs.llm import ChatEnv
from torchrl.envs.llm.transforms.tools import ToolTransformBase
from torchrl.envs.transforms import Transform


class EchoTool(ToolTransformBase):
    """Answers every assistant message that is not a FINAL answer with ``filler`` characters of log."""

    def __init__(self, filler: int = 60):
        super().__init__()
        self.filler = filler

    def _process_batch_item(self, content: str, index: int):
        if content.strip().startswith("FINAL"):
            return None
        return ["log: " + "ab" * (self.filler // 2)]


class FinalAnswerReward(Transform):
    """reward 1 and done when the last assistant message is ``FINAL <secret>``; a wrong FINAL ends with 0."""

    def __init__(self, secret: str):
        super().__init__()
        self.secret = secret

    def _step(self, tensordict, next_tensordict):
        history = next_tensordict["history"].prompt[0]
        text = [m for m, r in zip(history.content, history.role) if r == "assistant"][-1].strip()
        final = text.startswith("FINAL")
        reward = float(final and text.split()[1:2] == [self.secret])
        next_tensordict.set("reward", torch.full((1, 1), reward))
        done = torch.full((1, 1), final)
        next_tensordict.set("done", done | next_tensordict.get("done"))
        next_tensordict.set("terminated", done | next_tensordict.get("terminated"))
        return next_tensordict

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset

    def transform_reward_spec(self, reward_spec):
        reward_spec["reward"] = Unbounded(shape=reward_spec.shape + (1,), dtype=torch.float32)
        return reward_spec


class EchoSuite:
    def __init__(self, tokenizer, seed: int = 0, n_tasks: int = 6, filler: int = 60, system: str = "Answer with FINAL <word>."):
        self.tokenizer, self.filler, self.system = tokenizer, filler, system
        words = ["apple", "river", "stone", "cloud", "maple", "ember", "frost", "delta"]
        self._tasks = {split: [words[(seed + i + 3 * j) % len(words)] for i in range(n_tasks)]
                       for j, split in enumerate(("train", "dev", "test"))}

    def tasks(self, split):
        return self._tasks[split]

    def query(self, task):
        return f"The secret word is {task}. Reply FINAL {task}."

    def make_env(self, task, compaction):
        env = ChatEnv(batch_size=(1,), input_mode="history", system_prompt=self.system, tokenizer=self.tokenizer)
        return TransformedEnv(env, compaction(EchoTool(self.filler), FinalAnswerReward(task)))


def make_suite(tokenizer, seed: int = 0, tools=None, **kwargs):
    return EchoSuite(tokenizer, seed=seed, **kwargs)


class LongTaskSuite(EchoSuite):
    """EchoSuite whose fourth train task has a prompt far longer than any context (tests of the load-time check)."""

    def query(self, task):
        long = task == self._tasks["train"][3]
        return super().query(task) + (" Context: " + "lorem ipsum " * 400 if long else "")


def make_long_suite(tokenizer, seed: int = 0, tools=None, **kwargs):
    return LongTaskSuite(tokenizer, seed=seed, **kwargs)


#: switched on by a test: every episode of a train task then fails (a tool server that went down mid-run)
TRAIN_ENVS_DOWN = {"on": False}


class FlakySuite(EchoSuite):
    def make_env(self, task, compaction):
        if TRAIN_ENVS_DOWN["on"] and task in self._tasks["train"]:
            raise RuntimeError("tool server down")
        return super().make_env(task, compaction)


def make_flaky_suite(tokenizer, seed: int = 0, tools=None, **kwargs):
    return FlakySuite(tokenizer, seed=seed, **kwargs)
