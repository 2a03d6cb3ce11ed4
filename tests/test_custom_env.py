"""Your own environment and prompts without editing crl: env.factory / env.kwargs, the prompt.* texts, their load-time
errors, and examples/key_value.yaml trained through scripts/train.py and audited (crl/envs/factory.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from crl.builders import build_prompt_format, build_suite, build_tokenizer, check_budgets
from crl.config import ConfigValidationError, CurriculumStage, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "key_value.yaml"


def built(overrides=(), path=EXAMPLE):
    """Load, then the checks a Trainer runs when it is built (tokenizer, prompt format, budgets, warm-start hooks)."""
    cfg = load_config(path, list(overrides))
    codec = build_tokenizer(cfg)
    fmt = build_prompt_format(cfg, codec)
    check_budgets(cfg, codec, fmt)
    return cfg, codec, fmt


def write_factory(tmp_path, body: str) -> str:
    path = tmp_path / "my_env.py"
    path.write_text("from crl.envs import StepResult\n" + body)
    return f"{path}:make"


def test_example_suite_comes_from_the_factory_with_its_kwargs_and_the_configured_prompt():
    cfg, codec, fmt = built(["env.kwargs.length=6", "env.kwargs.seed=3"])
    suite = build_suite(cfg)
    assert type(suite).__name__ == "KeyValueSuite" and suite.length == 6 and suite.seed == 3
    assert suite.compaction_steps == (4,)
    assert codec.decode(fmt.system_ids()) == cfg.prompt.system
    assert codec.decode(fmt.observation_ids("record : key 3 value red")) == "<|observation|> record : key 3 value red <|assistant|>"
    # the splits are disjoint and seeded: another seed, other tasks
    assert {t.to_json() for t in suite.tasks("train")}.isdisjoint({t.to_json() for t in suite.tasks("test")})
    assert build_suite(load_config(EXAMPLE, ["env.kwargs.seed=4"])).tasks("dev") != suite.tasks("dev")
    # a curriculum stage passes length= and compaction_steps= on top of env.kwargs
    staged = build_suite(cfg, CurriculumStage(length=3, compaction_steps=[2]))
    assert staged.length == 3 and staged.compaction_steps == (2,) and staged.seed == 3


def test_example_env_plays_its_own_protocol():
    suite = build_suite(load_config(EXAMPLE))
    task = suite.tasks("dev")[0]
    env = suite.make_env(task)
    assert env.reset() == task.prompt
    assert env.step("next").info["invalid"]  # the console's command means nothing here
    early = suite.make_env(task)
    early.reset()
    assert early.step(f"answer {task.answer}").reward == 0.0  # before the question: no shortcut
    steps = [env.step("continue").observation for _ in range(len(task.items) + 1)]
    assert steps[0] == task.items[0] and steps[-1] == task.question
    result = env.step(f"answer {task.answer}")
    assert result.done and result.reward == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["env.name=memory_chain"], "env.name: env.factory="),
    (["env.factory=null", "env.kwargs={}"], "env.factory: env.name=custom needs env.factory"),
    (["env.name=memory_chain", "env.factory=null"], "env.kwargs: are the factory's keyword arguments"),
    (["env.factory=examples/key_value_env.py"], "is not 'package.module:function'"),
    (["env.factory=missing_env.py:make_suite"], "file missing_env.py does not exist"),
    (["env.factory=examples/key_value_env.py:make"], "has no attribute 'make'"),
    (["env.factory=examples/key_value_env.py:COLOURS"], "is a tuple, not a callable"),
    (["env.factory=no_such_package.envs:make"], "cannot import 'no_such_package.envs'"),
    (["prompt.task_template=<|user|> the task <|assistant|>"], "prompt.task_template: must contain {task} exactly once"),
    (["prompt.observation_template=<|observation|> {observation} {step}"], "no other field"),
    (["prompt.observation_template=<|observation|> {observation"], "is not a format string"),
    (["prompt.summary_instruction='  '"], "prompt.summary_instruction: must be a non-blank text"),
])
def test_bad_factory_and_prompt_settings_fail_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigValidationError, match=None) as err:
        load_config(EXAMPLE, overrides)
    assert message in str(err.value), str(err.value)


def test_unknown_words_in_a_plain_prompt_and_a_factory_that_breaks_fail_before_the_run(tmp_path):
    with pytest.raises(ConfigValidationError, match=r"prompt.system: \['hello', 'world'\] are not in the project's word vocabulary"):
        built(["prompt.system=<|system|> hello world , you are an agent ."])
    with pytest.raises(ConfigValidationError, match=r"env.factory: .*length must be >= 2"):
        built(["env.kwargs.length=1"])
    with pytest.raises(ConfigValidationError, match=r"unexpected keyword argument 'colour'"):
        built(["env.kwargs.colour=red"])
    spec = write_factory(tmp_path, "def make(**kw):\n    return [1, 2]\n")
    with pytest.raises(ConfigValidationError, match=r"returned a list without a tasks\(\) method"):
        built([f"env.factory={spec}"])
    spec = write_factory(tmp_path, "class S:\n    def tasks(self, split): return () if split == 'test' else ('t',)\n"
                                   "    def make_env(self, task): pass\n\ndef make(**kw):\n    return S()\n")
    with pytest.raises(ConfigValidationError, match=r"tasks\('test'\) returned tuple \(\); every split needs a non-empty sequence"):
        built([f"env.factory={spec}"])


MINIMAL = """
class Env:
    def __init__(self, task): self.task = task
    def reset(self): return "remember the code ."
    def step(self, action):
        return StepResult("submitted correct", True, float(action.strip() == "submit 3"), {})

class Suite:
    def tasks(self, split): return [f"{split}-{i}" for i in range(3)]
    def make_env(self, task): return Env(task)

def make(**kw):
    return Suite()
"""


def test_a_minimal_suite_needs_the_warm_start_hooks_only_when_the_warm_start_runs(tmp_path):
    spec = write_factory(tmp_path, MINIMAL)
    with pytest.raises(ConfigValidationError, match=r"warm_start.enabled: the warm start needs the environment's oracle_action\(\)"):
        built([f"env.factory={spec}", "env.kwargs={}"])
    built([f"env.factory={spec}", "env.kwargs={}", "warm_start.enabled=false"])  # plain objects, no base class


@pytest.mark.real_model
def test_chat_prompt_texts_render_through_the_template(smollm2_dir):
    """prompt.* in chat format: the texts are turn contents, rendered exactly like apply_chat_template."""
    from crl.chat import load_chat_tokenizer

    cfg, codec, fmt = built([f"model.preset={smollm2_dir}", "prompt.format=chat", "model.backend=transformers",
                             "prompt.system=You read records. Answer with one command.",
                             "prompt.task_template='Task: {task}'", "prompt.observation_template='Output: {observation}'"])
    tok = load_chat_tokenizer(smollm2_dir)
    messages = [{"role": "system", "content": cfg.prompt.system}, {"role": "user", "content": "Task: find it"}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert codec.decode(fmt.system_ids() + fmt.task_ids("find it")) == expected
    assert "Output: record 1" in codec.decode(fmt.observation_ids("record 1"))


@pytest.mark.slow
def test_example_trains_through_scripts_train_and_audits(tmp_path):
    """The user's path: scripts/train.py --config examples/key_value.yaml, from the repository root, then the audit."""
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin"}
    run_dir = tmp_path / "kv"
    cmd = [sys.executable, "scripts/train.py", "--config", str(EXAMPLE), f"run_dir={run_dir}", "model.preset=llama-tiny",
           "model.value_head_init=normal",
           "train.iterations=2", "train.episodes_per_batch=6", "warm_start.steps=20", "warm_start.batch_episodes=4",
           "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false",
           "train.critic_warmup_iterations=0", "checkpoint.evidence_every=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    assert sum(r.get("episode/compactions", 0) for r in rows if r["step"] >= 1) > 0, "the forced compaction never ran"
    from crl.episode import load_episodes
    from crl.modules.tokenizer import decode

    rollout = load_episodes(run_dir / "evidence" / "iter_000001" / "rank_0" / "rollout.pt")
    text = decode(rollout["tokens"][0][rollout["attention_mask"][0]].tolist())
    assert text.startswith(load_config(EXAMPLE).prompt.system) and "record : key" in text, text
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr
