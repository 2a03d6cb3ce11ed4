"""Text environments with a console protocol (``next`` / ``submit <answer>``) and seeded task suites."""
from crl.envs.base import SPLITS, StepResult, Task, TaskSuite, TextEnv, seeded_rng
from crl.envs.memory_chain import MemoryChainEnv, MemoryChainSuite
from crl.envs.sequential_records import RecordsTask, SequentialRecordsEnv, SequentialRecordsSuite

__all__ = [
    "SPLITS",
    "StepResult",
    "Task",
    "TaskSuite",
    "TextEnv",
    "seeded_rng",
    "RecordsTask",
    "SequentialRecordsEnv",
    "SequentialRecordsSuite",
    "MemoryChainEnv",
    "MemoryChainSuite",
]
