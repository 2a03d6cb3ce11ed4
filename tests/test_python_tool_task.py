"""The Python tool task end to end: TorchRL's ChatEnv + crl's CompactionTransform + the sandboxed
PythonTool + the executable verifier, driven by a scripted policy through TorchRL's TransformersWrapper; then
``scripts/train.py --config configs/python_tool.yaml`` (config-built model, and SmolLM2 for one iteration) with an
audit PASS. The scripted policy's text is forced through generate (tests/_torchrl_chat.py), so every id, tool
message and compaction below went through the same code path as a sampled episode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from crl.compaction import CompactionConfig
from crl.envs.python_tasks import PythonTaskReward, PythonTaskSuite, is_final
from crl.episode import EpisodeStatus, Provenance, SegmentKind, load_episodes
from crl.sandbox import Sandbox, SandboxLimits
from crl.torchrl_llm import CompactionTransform, to_episodes
from crl.torchrl_llm.python_tool import PythonTool

from _torchrl_chat import _llama_cls, byte_ids, chat_tokenizer, list_to_stack_mode  # noqa: F401

from torchrl.envs import TransformedEnv
from torchrl.envs.llm import ChatEnv
from torchrl.modules.llm import TransformersWrapper

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
C, T_COMP, MAX_NEW = 3072, 1536, 160
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      vocab_size=len(tok), max_position_embeddings=2 * C, pad_token_id=0, eos_token_id=EOS, bos_token_id=None)
    return _llama_cls()(cfg).eval()


@pytest.fixture(scope="module")
def task():
    return PythonTaskSuite(seed=0, n_train=2, n_dev=1, n_test=1, specs=["max_minus_min"]).tasks("train")[0]


def episode(tok, model, task, script, *, timeout_s=2.0, max_steps=12, max_compactions=2, max_output=1536, context=C):
    """Play one episode whose i-th policy call emits ``script[i]`` (text); returns the collector-style rows."""
    limits = SandboxLimits(timeout_s=timeout_s, max_output_bytes=max_output)
    tool = PythonTool(Sandbox(limits=limits, files=task.files), skip=is_final)
    reward = PythonTaskReward([task], Sandbox(limits=limits))
    cfg = CompactionConfig(context_capacity=context, min_remaining=T_COMP, max_compactions=max_compactions, keep_recent=1,
                           max_steps=max_steps)
    env = TransformedEnv(ChatEnv(batch_size=(1,), input_mode="history", system_prompt="You write Python.", tokenizer=tok),
                         CompactionTransform(tok, cfg, MAX_NEW, tool, reward))
    wrapper = TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True, prefer_tokens=True,
                                  generate_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=True, top_k=len(tok)))
    calls = iter(script)

    def policy(td):
        model.script = byte_ids(next(calls), tok)
        return wrapper(td)

    td = env.reset(TensorDict(query=[task.prompt], batch_size=(1,)))
    with torch.no_grad():
        rows = env.rollout(len(script), policy, tensordict=td, auto_reset=False, break_when_any_done=True).reshape(-1)
    model.script = None
    return rows, reward


def tool_messages(rows, i):
    h = rows[i]["next", "history"].prompt
    return [c for r, c in zip(h.role, h.content) if r == "tool"]


PRINT_DATA = "```python\nprint(open('data.txt').read())\n```"
SUMMARY = "The task: solve(xs) as asked; data.txt printed, nothing else learned."


def test_a_printed_data_file_triggers_compaction_by_budget_then_a_correct_answer_scores_1(tok, model, task):
    final = "FINAL\n```python\ndef solve(xs):\n    return max(xs) - min(xs)\n```"
    rows, reward = episode(tok, model, task, [PRINT_DATA, SUMMARY, final])
    phases = rows["compaction", "phase"].reshape(-1).tolist()
    assert phases == [0, 1, 0], phases  # the printed data.txt pushed C - L below T_comp: a summary turn
    printed = tool_messages(rows, 0)
    assert len(printed) == 1 and printed[0].startswith(task.data_text[:50])
    ep = to_episodes(rows, vocab_size=len(tok))
    assert ep["segment_kind"].tolist() == [SegmentKind.EXECUTION, SegmentKind.SUMMARY, SegmentKind.EXECUTION]
    assert ep["status"].tolist() == [EpisodeStatus.COMPLETED] * 3 and ep["reward"].tolist() == [1.0] * 3, reward.last_verdicts
    # the tool output is context (OBSERVATION), never trained; the summary is trained
    assert not ep["loss_mask"][ep["provenance"] == Provenance.OBSERVATION].any()
    assert ep["loss_mask"][ep["provenance"] == Provenance.SUMMARY].all()


def test_bad_tool_code_is_an_observation_and_the_episode_goes_on(tok, model, task):
    script = [
        "```python\nwhile True:\n    pass\n```",                       # hangs
        "```python\nraise ValueError('boom')\n```",                    # raises
        "```python\nprint('x' * 50_000_000)\n```",                      # prints megabytes
        "I will think about it without the tool.",                      # never calls the tool
        "FINAL\n```python\ndef solve(xs):\n    return 0\n```",          # a wrong answer
    ]
    rows, reward = episode(tok, model, task, script, timeout_s=1.0, max_steps=10, max_compactions=0, max_output=256, context=2 * C)
    assert "[timed out after 1.0 s]" in tool_messages(rows, 0)[-1]
    assert "ValueError: boom" in tool_messages(rows, 1)[-1]
    assert "[output truncated at 256 bytes]" in tool_messages(rows, 2)[-1]
    assert len(tool_messages(rows, 3)) == len(tool_messages(rows, 2))  # no code block: no tool message
    assert bool(rows[-1]["next", "done"]) and float(rows[-1]["next", "reward"]) == 0.0
    assert reward.last_verdicts[0][0] == 0.0 and "wrong answer" in reward.last_verdicts[0][1]
    assert to_episodes(rows, vocab_size=len(tok))["status"].tolist() == [EpisodeStatus.COMPLETED]


def test_the_tool_task_refuses_to_start_without_its_sandbox(tmp_path, monkeypatch):
    from crl import sandbox
    from crl.builders import check_tool_sandbox
    from crl.config import ConfigValidationError, load_config

    cfg = load_config(ROOT / "configs/python_tool.yaml", [f"run_dir={tmp_path}"])
    monkeypatch.setattr(sandbox, "BWRAP", str(tmp_path / "no-bwrap-here"))
    with pytest.raises(ConfigValidationError, match="tools.sandbox.*bubblewrap|bubblewrap.*tools.sandbox|apt-get install bubblewrap"):
        check_tool_sandbox(cfg)
    cfg = load_config(ROOT / "configs/python_tool.yaml", [f"run_dir={tmp_path}", "tools.sandbox=none"])
    with pytest.warns(UserWarning, match="UNSANDBOXED"):
        check_tool_sandbox(cfg)


def test_the_tool_task_checks_the_syscall_filter_in_every_mode(tmp_path, monkeypatch):
    """tools.sandbox: none runs the same seccomp filter: a missing pyseccomp/libseccomp stops the trainer build
    under tools.sandbox with the fix, as in bwrap mode, instead of at the first tool call mid-run."""
    from crl.builders import check_tool_sandbox
    from crl.config import ConfigValidationError, load_config
    from crl.sandbox import seccomp_filter

    cfg = load_config(ROOT / "configs/python_tool.yaml", [f"run_dir={tmp_path}", "tools.sandbox=none"])
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import pyseccomp raises ImportError
    seccomp_filter.cache_clear()
    try:
        with pytest.raises(ConfigValidationError, match=r"tools\.sandbox: .*libseccomp through pyseccomp.*pip install pyseccomp"):
            check_tool_sandbox(cfg)
    finally:
        seccomp_filter.cache_clear()


def run_and_audit(cmd, run_dir, timeout=900):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout[-3000:] + audit.stderr[-2000:]
    return proc


@pytest.mark.slow
def test_train_py_on_the_tool_task_two_iterations_sandboxed_compacts_and_audits(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_and_audit([sys.executable, "scripts/train.py", "--config", "configs/python_tool.yaml", f"run_dir={run_dir}",
                          "train.iterations=2", "logging.wandb_mode=disabled", "logging.progress=false"], run_dir)
    assert "UNSANDBOXED" not in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("episode/compactions", 0) for r in rows) > 0
    rollout = load_episodes(run_dir / "evidence" / "iter_000000" / "rank_0" / "rollout.pt")
    assert (rollout["segment_kind"] == SegmentKind.SUMMARY).any()


@pytest.mark.real_model
def test_train_py_on_the_tool_task_with_smollm2_one_iteration(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct's own chat template and tokenizer (pad <|endoftext|>, not its EOS) through the tool task
    (~4 minutes on one CPU thread: a dev episode before and after, one training episode; BPE prompts ~330 tokens, so
    C - T_comp = 560 is reached within 4 steps of 64 tokens, or by one printed data.txt)."""
    run_dir = tmp_path / "run"
    run_and_audit([sys.executable, "scripts/train.py", "--config", "configs/python_tool.yaml", f"model.preset={smollm2_dir}",
                   f"run_dir={run_dir}", "train.iterations=1", "train.episodes_per_batch=1", "eval.every=0", "eval.episodes=1",
                   "compaction.context_capacity=1280", "compaction.min_remaining=720", "compaction.max_steps=6",
                   "logging.wandb_mode=disabled", "logging.progress=false"], run_dir)
    rollout = load_episodes(run_dir / "evidence" / "iter_000000" / "rank_0" / "rollout.pt")
    assert (rollout["segment_kind"] == SegmentKind.SUMMARY).any(), "no compaction happened"


def test_the_tool_tasks_sandboxes_get_tools_sandbox_ro_paths(tok, tmp_path, monkeypatch):
    """``tools.sandbox_ro_paths`` reaches both sandboxes of an episode (the tool's and the verifier's): a file under it
    is readable by tool code, read-only; without the key it is absent (crl.sandbox's minimal view)."""
    import crl.sandbox
    from torchrl.envs import Compose

    from crl.config import ToolsConfig
    from crl.envs.python_tasks import PythonToolSuite

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "table.txt").write_text("42")
    made = []

    class Recording(crl.sandbox.Sandbox):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(crl.sandbox, "Sandbox", Recording)
    tasks = PythonTaskSuite(seed=0, n_train=2, n_dev=1, n_test=1, specs=["max_minus_min"])
    code = f"import os\nprint(open({str(shared / 'table.txt')!r}).read() if os.path.exists({str(shared)!r}) else 'absent')"
    for ro_paths, expect in (([str(shared)], "42"), ([], "absent")):
        made.clear()
        suite = PythonToolSuite(tok, tasks, tools=ToolsConfig(sandbox_ro_paths=ro_paths))
        suite.make_env(tasks.tasks("train")[0], lambda tool, reward: Compose(tool, reward))
        assert len(made) == 2 and all(sb.ro_paths == tuple(ro_paths) for sb in made)
        assert made[0].run(code).stdout.strip() == expect
