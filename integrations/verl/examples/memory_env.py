"""An environment factory for crl_verl's agent loop: crl's memory chain (remember a code through distractors and
forced compactions; crl/envs/memory_chain.py), one task per verl dataset row.

verl calls ``make_env(row)`` with the row's dataset fields; this one reads ``row["extra_info"]["index"]`` (and an
optional ``"split"``, default ``train``). The environment's ``reset()`` is the task text, ``step(command)`` runs one
console command (``next`` / ``submit <code>``) and its verifier gives the reward (1.0 for the right code).
"""
from crl.envs.memory_chain import MemoryChainSuite

SUITE = MemoryChainSuite(length=6, compaction_steps=(2, 4), split_sizes={"train": 8, "dev": 4, "test": 4})


def make_env(row):
    info = row.get("extra_info") or {}
    tasks = SUITE.tasks(info.get("split", "train"))
    return SUITE.make_env(tasks[int(info.get("index", 0)) % len(tasks)])
