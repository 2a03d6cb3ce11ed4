"""Training configuration: typed schema (omegaconf structured configs), YAML files, command-line overrides.

``load_config(path, overrides)`` merges ``configs/default.yaml``-style files (with an optional ``defaults:``
list of other files to layer first, relative to the file) and ``key=value`` overrides onto the schema below,
then validates. Unknown keys, wrong types and contradictory choices fail here, at load time, with a message
that names the key — never mid-run. Loading is pure: it builds no model and no tokenizer. The checks that need
them (token budgets, the model's context length) run when :class:`crl.trainer.Trainer` is built, before the
run directory is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import dataclasses
import json
import math

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from crl.modules.presets import PRESETS
from crl.objectives.options import EstimatorOptionError, check_estimator_options


class ConfigValidationError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (crl/modules/lora.py, through peft): only the adapters are trained."""

    enabled: bool = False
    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapters' input: must be 0 (merged adapters, which the sampler decodes with, cannot apply it)
    # the linear layers adapted (names inside each decoder layer; Llama/Qwen2: attention and MLP projections)
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # the transformers sampler decodes with the adapters merged into a copy of the adapted layers (W + alpha/r B A,
    # refreshed after every update: no adapter matmuls per decode step; memory: one copy of those layers, in bf16 under
    # train.precision=bf16) | false: it samples through the learner's own peft model
    merge_for_sampling: bool = True


@dataclass
class ModelConfig:
    preset: str = "llama-tiny"  # a crl.modules.presets name, or a local checkpoint directory
    # critic = a value head on the policy's own trunk (one network: one forward and one backward per micro-batch for
    # both losses, weighted algo.critic_coef; crl.modules.networks.PolicyValueLM) | false: a copy of the backbone with a
    # head, its own optimizer and steps
    share_critic_backbone: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_action_tokens: int = 8
    backend: str = "transformers"  # or "vllm": an engine per rank (settings: the vllm section; `make vllm` installs it)
    value_head_init: str = "zero"  # zero: V starts at 0 | normal: N(0, 0.02) weights (rewards all 0 still train the critic)
    gradient_checkpointing: bool = False  # recompute activations in backward (actor and critic): less memory, more time
    lora: LoraSettings = field(default_factory=LoraSettings)  # adapters instead of full fine-tuning (critic: adapters of its own)


@dataclass
class LearnerConfig:
    """How the learner runs the actor and the critic over segment rows (crl/learner.py); the maths is unchanged."""

    prefix_sharing: bool = True  # an execution segment that prefixes the next summary row is read from that row's forward
    max_padding: float = 0.04  # padding allowed per length bucket (fraction of the positions it processes)
    max_chunk_tokens: Optional[int] = None  # positions per forward call (bounds activation memory); null: unbounded


@dataclass
class PromptConfig:
    # plain: the project's word protocol (crl/prompts.py); chat: every turn rendered through the checkpoint
    # tokenizer's chat template (crl/chat.py), stopping on its end-of-turn token
    format: str = "plain"
    # The texts of the fixed pieces (docs/design.md §1, Eqs. 8-9); null: the format's own (crl/prompts.py for plain,
    # crl/chat.py for chat). Plain: each text is the whole piece as tokenized (tags included); chat: each is a turn's
    # content (the template adds the turn markup). Templates hold the environment's text as {task} / {observation}.
    system: Optional[str] = None  # s: the system prompt
    summary_instruction: Optional[str] = None  # q_sum: the summary request (Eq. 8)
    resume_prefix: Optional[str] = None  # u_resume before the copied summary (Eq. 9)
    resume_suffix: Optional[str] = None  # u_resume after the copied summary
    task_template: Optional[str] = None  # u from the environment's task text, e.g. "Task: {task}"
    # chat: own (a system turn holding prompt.system or crl's text, crl/chat.py) | template (what the chat template
    # renders for a conversation with no system message: SmolLM2's built-in one, 21 tokens against 48)
    system_turn: str = "own"
    observation_template: Optional[str] = None  # o_i from the environment's observation, e.g. "Output: {observation}"


@dataclass
class EnvConfig:
    name: str = "memory_chain"  # memory_chain | sequential_records | custom (your own suite: env.factory) | torchrl_chat
    # torchrl_chat: env.factory returns a suite of TorchRL ChatEnv episodes (tasks(split), query(task), make_env(task,
    # compaction)), called with tokenizer=, seed=, tools= (the tools section) and env.kwargs: crl/torchrl_llm/collector.py
    # custom: "package.module:function" or "path/to/file.py:function" returning a task suite (crl.envs.base: tasks(split),
    # make_env(task) -> reset() / step(action) -> StepResult), called with env.kwargs (plus length= and, when a stage
    # sets it, compaction_steps= under a curriculum). The knobs below are the built-in suites'; custom ignores them.
    factory: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    length: int = 4  # memory chain: distractor steps
    n_facts: int = 4
    compaction_steps: Optional[list] = None  # memory chain forced schedule; None: the suite's default
    n_records: int = 4  # sequential records
    distractor_rate: float = 0.25
    n_keys: int = 2
    n_values: int = 10  # sequential records: values 0 .. n_values - 1 (a guess is right 1 / n_values of the time)
    # sequential records: the asked key's final write is never among the last m records (crl/envs/sequential_records.py)
    question_not_in_last: int = 0
    # sequential records: key (the question draws a key the rule above allows) | uniform (the asked key's final write at
    # a uniform position of 1 .. n_records - question_not_in_last, never written after it); crl/envs/sequential_records.py
    asked_position: str = "key"
    # sequential records: a compaction forced right after the atomic step of this number (n_records: after the last
    # record, before the question; with invalid_command=fail no action can move it); null: the Eq. 7 budget alone
    compact_after_step: Optional[int] = None
    extra_steps: int = 4
    seed: int = 0
    step_timeout_s: Optional[float] = None  # an environment step (or reset) slower than this ends its episode FAILED
    early_submit: str = "accept"  # a submit before the question: accept (verified; the shortcut) | fail (reward 0); crl/envs/base.py
    # a command other than next / submit <answer>: observe (an error observation, one step) | fail (ends the episode,
    # reward 0: no stalling an item past a forced compaction); crl/envs/base.py
    invalid_command: str = "observe"


@dataclass
class CompactionSettings:
    enabled: bool = True  # False: the no-compaction ablation (plain long context, max_compactions = 0)
    context_capacity: int = 1024  # C
    min_remaining: int = 64  # T_comp
    max_compactions: int = 3
    keep_recent: int = 2  # k
    max_summary_tokens: int = 8
    keep_task_prompt: bool = False
    max_steps: Optional[int] = None  # action steps per episode (summaries not counted); reaching it truncates. null: no limit
    forced: bool = True  # use the environment's forced schedule (memory chain) on top of the Eq. 7 trigger


@dataclass
class AlgoConfig:
    # gae: the cross-trajectory GAE with a critic (the paper's) | group: critic-free, an episode's reward minus its
    # group's (train.group_size episodes of one task; GRPO/RLOO); no critic is built (crl/objectives/group.py)
    estimator: str = "gae"
    group_baseline: str = "mean"  # group: mean (GRPO) | leave_one_out (RLOO)
    group_scale: str = "none"  # group: none | std (divide by the group's reward standard deviation)
    gamma: float = 1.0
    alpha: Optional[float] = 1.5
    lmbda: Optional[float] = None  # fixed λ instead of the length-adaptive one (then set alpha to null)
    lambda_length: str = "segment"  # segment | rollout
    cross_trajectory: bool = True
    value_target: str = "local"  # local | corrected
    boundary: str = "terminal"  # terminal | bootstrap
    whiten_advantage: bool = False
    aggregation: str = "token_sum_global"  # token_sum_global | segment_mean | microbatch_token_mean
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_value: Optional[float] = None
    entropy_coef: float = 0.0
    # constant | linear: the entropy bonus decays linearly to 0 over train.iterations: exploration early, none left
    # to push a converged policy's entropy back up late (crl.training.update.PPOUpdate.set_entropy_coef)
    entropy_schedule: str = "constant"
    kl_coef: float = 0.0
    # what the KL penalty (kl_coef > 0) pulls toward: behaviour (the sampling policy of the batch) | reference (the policy
    # as RL started, after the warm start: the frozen adapter under LoRA, a frozen copy otherwise), Schulman's k3 per token
    kl_to: str = "behaviour"
    # with train.branches > 1: the weight w of the siblings' leave-one-out mean return in the value of every optimized
    # token from the branch point on, V <- (1 - w) V_critic + w mean_{b' != b} R_b' (docs/design.md §4: a Monte Carlo
    # value of the branch point's context); 0: the critic's alone, 1: the siblings' alone
    sibling_value_weight: float = 0.0
    # null | > 0: stop an iteration's policy steps once the approximate KL to the sampling policy, measured by a step's
    # own forward on its minibatch, exceeds 1.5 x target_kl; that step is not applied (SB3's PPO target_kl;
    # crl.training.update.PPOUpdate.update_policy). Not with DeepSpeed, whose engine steps inside the accumulation loop.
    target_kl: Optional[float] = None
    frozen_summary: bool = False  # summaries from a frozen copy of the initial policy, masked from the loss
    # a critic on the policy's trunk (model.share_critic_backbone): one loss L = L_policy + critic_coef * L_value through
    # one forward and one backward per micro-batch (TorchRL's ClipPPOLoss critic_coef); separate_losses (TorchRL's
    # name): the value loss trains the value head only, reading the trunk's features detached
    critic_coef: float = 1.0
    separate_losses: bool = False


@dataclass
class CurriculumStage:
    length: int = 4  # memory chain length (or records per task) of this stage
    promote_at: float = 1.1  # move to the next stage when train success reaches this (> 1: never)
    # memory chain only: the atomic steps after which this stage forces a compaction ([]: none, so the stage
    # trains reading a visible fact); null: derived from the length (round(L/4), round(L/2), round(3L/4)).
    # Staging the NUMBER of compactions (0 -> 1 -> 2 -> 3) is docs/design.md §10's curriculum.
    compaction_steps: Optional[list] = None


@dataclass
class TrainConfig:
    iterations: int = 40
    episodes_per_batch: int = 32  # per data-parallel rank
    group_size: int = 1  # episodes of the same task in a batch (consecutive, one rank); algo.estimator=group needs >= 2
    # k > 1: each task's execution prefix is played once and continued k times from its first compaction (k summaries
    # of one context, each to its own reward; crl.collectors.CompactionCollector): episodes_per_batch / k contexts,
    # minibatches of whole branch groups; the group estimator and algo.sibling_value_weight compare the k branches
    branches: int = 1
    # groups (train.branches or train.group_size) whose rewards all agree carry no signal between their members:
    # train (as any episode) | drop (DAPO's dynamic sampling: kept in the evidence, left out of the update)
    uniform_groups: str = "train"
    micro_batches: int = 2  # gradient-accumulation micro-batches per optimizer step (per rank)
    policy_epochs: int = 1
    policy_minibatches: int = 1
    critic_updates: int = 2  # critic optimizer steps per iteration
    critic_warmup_iterations: int = 2  # critic-only iterations at the start
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    # constant | linear: both learning rates decay linearly to 0 over train.iterations (CleanRL's anneal_lr): late
    # updates, on a nearly converged policy, stay small (crl.training.update.PPOUpdate.set_learning_rates)
    lr_schedule: str = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # the policy's gradient norm clip (its own tensors: with a shared trunk, not the value head)
    critic_max_grad_norm: float = 1.0  # the critic's own tensors' clip (a separate critic, or the value head on a shared trunk)
    # the policy's learning rate rises linearly over its first lr_warmup_steps optimizer steps (step s at (s + 1) / W of
    # its rate): Adam's first steps move every coordinate by about the learning rate whatever the gradient; 0: none
    lr_warmup_steps: int = 0
    seed: int = 0
    threads: int = 1  # torch threads per process
    # how long a collective waits for the other ranks before it raises (the process group's timeout, gloo and NCCL):
    # a hung or unreachable machine ends the run on the others after this, with the checkpoint to resume from
    # (scripts/train.py, docs/cluster.md). The warm start's wait has a group of its own (it may take longer).
    dist_timeout_s: float = 1800.0
    # auto: bf16 mixed precision on CUDA, fp32 on CPU | fp32 | bf16 (autocast; also on a CPU, slow without bf16 units)
    precision: str = "auto"
    # episodes that FAILED (an environment exception or step timeout: the infrastructure, not the policy): drop them
    # from the learner (counted as episode/failed, kept in the evidence) | train them with reward 0
    failed_episodes: str = "drop"
    curriculum: list = field(default_factory=list)  # list of CurriculumStage; empty: env.length throughout


@dataclass
class WarmStartConfig:
    enabled: bool = True
    steps: int = 200
    batch_episodes: int = 16
    # forward/backward passes per step, each over whole rows of the step's batch (its gradient unchanged): the
    # activations and logits of batch_episodes long episodes at once outgrow a CPU's memory (SmolLM2 on
    # configs/lm_keep: ~12 rows of ~450 tokens peak at 11-17 GB in one pass). <= batch_episodes; 1 with summary_content=balanced
    micro_batches: int = 1
    lr: float = 3e-3
    # random | untrained | format | balanced (see crl/warm_start/demonstrations.py): never the correct content
    summary_content: str = "random"
    # format-only summaries drawn per compaction point with format / balanced: a content position's set is what they
    # put there, and misses one of K alternatives with probability ~ K (1 - 1/K)^n: 4e-4 for 4 codes at 32, 1e-4
    # for 10 digits at 128 (the records task), 0.34 for 10 digits at 32
    format_draws: int = 32
    # stop once the answer probe on train tasks (reading a fact from a correct summary) reaches this; steps is then
    # the maximum. null: exactly `steps` steps
    stop_answer_p: Optional[float] = None
    probe_every: int = 100  # steps between the stopping rule's probes
    # tasks each answer probe plays (the stopping rule's and the final visible/summary probes), one teacher-forced
    # forward over a whole oracle episode each: at 40, a third of a one-iteration SmolLM2-135M run on one CPU thread
    probe_tasks: int = 40
    # a directory shared by runs (ablation arms of one seed): the warm-started weights are stored under a hash of
    # everything they depend on and reused by the next run with the same inputs (a warm start in progress also
    # checkpoints itself there every probe_every steps, and a killed one continues from it); null: always recompute
    cache_dir: Optional[str] = None


@dataclass
class EvalConfig:
    every: int = 5  # iterations between dev evaluations (0: only at start and end)
    episodes: int = 60
    temperature: float = 1.0


@dataclass
class CheckpointConfig:
    every: int = 10
    keep_last: int = 2
    evidence_every: int = 10  # iterations whose evidence (docs/design.md §8) is kept; the last one always is
    # auto: continue from the newest intact checkpoint of run_dir (refused if the config differs);
    # force: the same, accepting a changed config; never: start afresh; or a checkpoint directory.
    resume: str = "auto"


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    project: str = "crl"
    run_name: Optional[str] = None
    progress: bool = True


@dataclass
class VLLMConfig:
    """The vLLM engine of ``model.backend=vllm`` (crl/modules/vllm_backend.py): one per data-parallel rank, on its
    own device (GPU) or core (CPU), holding the learner's weights (synced after the warm start, a resume and every
    update)."""

    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA | float32 | bfloat16 | float16
    max_model_len: Optional[int] = None  # the engine's context length; null: compaction.context_capacity
    gpu_memory_utilization: float = 0.3  # GPU fraction the engine may take (actor, critic and optimizer use the rest)
    cpu_kv_cache_gb: float = 1.0  # CPU: the KV cache's size (vLLM otherwise asks for most of the RAM)
    enforce_eager: bool = True  # no CUDA graphs / torch.compile: starts in ~25 s instead of ~100 s on CPU, same outputs
    enable_prefix_caching: bool = True  # reuse the keys/values of an episode's growing context
    sleep_between_phases: bool = False  # free the engine's GPU memory during the update (vLLM sleep mode; GPU only)
    cpu_threads_bind: str = "rank"  # CPU: rank: local rank r's engine on core r | auto: vLLM's choice | a core list "0-3"
    # where each machine's weight syncs are written (local rank 0 of a machine writes, its engines read): a directory
    # local to the machine, never a shared filesystem; null: /dev/shm (RAM), else $TMPDIR (docs/cluster.md)
    weights_dir: Optional[str] = None


@dataclass
class DeepSpeedConfig:
    config: Optional[str] = None  # a DeepSpeed JSON (configs/deepspeed/zero2.json); null: plain accelerate


@dataclass
class ToolsConfig:
    """How tools run model-written code (crl/sandbox.py); passed to a torchrl_chat factory as ``tools=``."""

    sandbox: str = "bwrap"  # bwrap: bubblewrap + rlimits (apt-get install bubblewrap) | none: unisolated (a warning on every start)
    timeout_s: float = 5.0  # wall clock of one tool call
    memory_mb: int = 512  # memory of one tool call: all its processes together (a cgroup) and each one's address space
    max_output_bytes: int = 4096  # tool output kept (the rest is dropped and marked)
    # host paths (absolute, existing) tool code may read, at the same place, read-only; bwrap mode shows nothing else
    # of the host but /usr, a few /etc files and the interpreter's directories (crl.sandbox)
    sandbox_ro_paths: list = field(default_factory=list)
    # a cgroup v2 directory delegated to crl (docker's --cgroup-parent, systemd's Delegate=yes): the calls' cgroups are
    # made below it; null: below the cgroup crl runs in, where the kernel allows it (crl/cgroups.py)
    cgroup_parent: Optional[str] = None


@dataclass
class Config:
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


CHOICES = {
    "model.backend": ("transformers", "vllm"),
    "prompt.format": ("plain", "chat"),
    "prompt.system_turn": ("own", "template"),
    "train.precision": ("auto", "fp32", "bf16"),
    "model.value_head_init": ("zero", "normal"),
    "env.name": ("memory_chain", "sequential_records", "custom", "torchrl_chat"),
    "tools.sandbox": ("bwrap", "none"),
    "algo.aggregation": ("token_sum_global", "segment_mean", "microbatch_token_mean"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "warm_start.summary_content": ("random", "untrained", "format", "balanced"),
    "env.early_submit": ("accept", "fail"),
    "env.invalid_command": ("observe", "fail"),
    "train.failed_episodes": ("drop", "train"),
    "train.lr_schedule": ("constant", "linear"),
    "algo.entropy_schedule": ("constant", "linear"),
    "vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "algo.estimator": ("gae", "group"),
    "algo.group_baseline": ("mean", "leave_one_out"),
    "algo.group_scale": ("none", "std"),
    "algo.kl_to": ("behaviour", "reference"),
    "train.uniform_groups": ("train", "drop"),
}


def _read_yaml(path: Path, seen: tuple = ()) -> DictConfig:
    if path in seen:
        raise ConfigValidationError(f"config {path}: circular `defaults:` include")
    if not path.is_file():
        raise ConfigValidationError(f"config file {path} does not exist")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigValidationError(f"config file {path}: YAML syntax error{where}: {problem}") from None
    except OmegaConfBaseException as err:
        raise ConfigValidationError(f"config file {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigValidationError(f"config file {path}: the top level must be a mapping of sections (model:, train:, ...), "
                                    f"got a {type(cfg).__name__}")
    includes = cfg.pop("defaults", None) or []
    merged = OmegaConf.create()
    for inc in includes:
        merged = OmegaConf.merge(merged, _read_yaml((path.parent / inc).resolve(), seen + (path,)))
    return OmegaConf.merge(merged, cfg)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema ← YAML file (with its ``defaults:`` includes) ← ``key=value`` overrides; then :func:`validate`."""
    schema = OmegaConf.structured(Config)
    try:
        layers = [schema]
        if path is not None:
            layers.append(_read_yaml(Path(path).resolve()))
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.merge(*layers)
        stages = cfg.train.curriculum
        if stages:
            cfg.train.curriculum = [OmegaConf.merge(OmegaConf.structured(CurriculumStage), s) for s in stages]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigValidationError(f"config key {key!r}: {str(err).splitlines()[0]}") from None
    obj: Config = OmegaConf.to_object(cfg)
    obj.train.curriculum = [s if isinstance(s, CurriculumStage) else CurriculumStage(**s) for s in obj.train.curriculum]
    validate(obj)
    return obj


def zero_stage(deepspeed_config: dict | str | Path) -> int:
    """The ZeRO stage a DeepSpeed config (a dict, or its JSON file) asks for (0 when it names none)."""
    ds = deepspeed_config if isinstance(deepspeed_config, dict) else json.loads(Path(deepspeed_config).read_text())
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def check_deepspeed(cfg: Config, stage: int) -> None:
    """Refuse what the trainer cannot run under DeepSpeed ZeRO ``stage``: when the config loads (``deepspeed.config``)
    and again when the trainer builds its engines (``accelerate launch --use_deepspeed`` names the JSON only there).

    Its engines step inside the accumulation loop, at the last micro-batch's ``step()``, before the step's KL is known
    and without a warm-up factor of ours. A value head on the policy's trunk gets an engine of its own beside the
    policy's (each clips its own norm), which needs the head to read the trunk's features detached: ZeRO reduces each
    gradient once per micro-step, so the value loss cannot also reach the policy's tensors."""
    a, t = cfg.algo, cfg.train
    _need(a.target_kl is None, "algo.target_kl", "is not supported with DeepSpeed (its engine steps inside the accumulation "
          "loop, before the step's KL is known): set it to null, or deepspeed.config to null")
    _need(a.kl_to == "behaviour", "algo.kl_to", "reference is not supported with DeepSpeed yet: set it to behaviour")
    _need(t.lr_warmup_steps == 0, "train.lr_warmup_steps", "is not supported with DeepSpeed (its engine owns the step): set it to 0")
    if cfg.model.share_critic_backbone and a.estimator == "gae":
        _need(a.separate_losses, "algo.separate_losses",
              "must be true for a value head on the policy's trunk under DeepSpeed (the head and the policy are stepped by "
              "two engines, and ZeRO reduces a gradient once: the value loss cannot also reach the trunk): set it to true, "
              "or deepspeed.config to null (DDP runs both)")
        _need(stage != 3, "model.share_critic_backbone",
              "is not supported under DeepSpeed ZeRO-3 (its partitioned trunk would be read by two engines): use ZeRO-2 or none")


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigValidationError(f"{key}: {msg}")


def _non_finite(obj, prefix: str = ""):
    """Dotted keys of every float field that is NaN or infinite (walks nested config dataclasses)."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _non_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            yield key, value


def _check_torchrl_chat(cfg: Config) -> None:
    """What env.name=torchrl_chat (TorchRL's ChatEnv through crl.torchrl_llm) supports; the rest is refused here."""
    what = "env.name=torchrl_chat"
    _need(cfg.model.backend == "transformers", "model.backend",
          f"{what} samples through TorchRL's TransformersWrapper: use transformers (vLLM is not wired to ChatEnv yet)")
    _need(cfg.prompt.format == "chat", "prompt.format",
          f"{what} renders turns through the tokenizer's chat template: set prompt.format=chat")
    _need(not cfg.warm_start.enabled, "warm_start.enabled",
          f"{what} has no oracle episodes to warm-start from: set warm_start.enabled=false")
    _need(not cfg.algo.frozen_summary, "algo.frozen_summary", f"{what} does not support the frozen-summary ablation yet")
    _need(not cfg.train.curriculum, "train.curriculum", f"{what} has no curriculum: remove train.curriculum")
    _need(cfg.compaction.enabled, "compaction.enabled",
          f"{what} compacts through CompactionTransform: set compaction.enabled=true (max_compactions=0 disables it)")
    _need(cfg.compaction.min_remaining >= cfg.model.max_action_tokens, "compaction.min_remaining",
          f"{what}: T_comp={cfg.compaction.min_remaining} must be >= model.max_action_tokens={cfg.model.max_action_tokens} "
          "(one generation limit for every call)")
    _need(not cfg.compaction.keep_task_prompt, "compaction.keep_task_prompt",
          f"{what}: the resume context is system + summary + tail (Eq. 9)")
    for key in ("task_template", "observation_template", "system"):
        _need(getattr(cfg.prompt, key) is None, f"prompt.{key}",
              f"{what}: the ChatEnv suite writes the system prompt, task and observations; remove prompt.{key}")
    if cfg.deepspeed.config is not None and Path(cfg.deepspeed.config).is_file():
        _need(zero_stage(cfg.deepspeed.config) != 3, "deepspeed.config",
              f"{what} samples with the full module: ZeRO-3 is not supported (use ZeRO-2 or none)")


def validate(cfg: Config) -> None:
    """Refuse impossible or contradictory settings, naming the key."""
    for key, value in _non_finite(cfg):
        raise ConfigValidationError(f"{key}: {value} is not a finite number")
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _need(value in allowed, key, f"{value!r} is not one of {allowed}")
    a, t, c = cfg.algo, cfg.train, cfg.compaction
    _need(c.context_capacity >= 1, "compaction.context_capacity", f"must be >= 1, got {c.context_capacity}")
    for key in ("min_remaining", "max_compactions", "keep_recent"):
        _need(getattr(c, key) >= 0, f"compaction.{key}", f"must be >= 0, got {getattr(c, key)}")
    _need(c.max_steps is None or c.max_steps >= 1, "compaction.max_steps", f"must be >= 1 or null, got {c.max_steps}")
    _need(c.max_summary_tokens >= 1, "compaction.max_summary_tokens", f"must be >= 1, got {c.max_summary_tokens}")
    e = cfg.env
    for key in ("length", "n_facts", "n_records", "n_keys"):
        _need(getattr(e, key) >= 1, f"env.{key}", f"must be >= 1, got {getattr(e, key)}")
    _need(e.extra_steps >= 0, "env.extra_steps", f"must be >= 0, got {e.extra_steps}")
    _need(2 <= e.n_values <= 10, "env.n_values", f"must be in [2, 10] (one-digit values), got {e.n_values}")
    _need(0 <= e.question_not_in_last < e.n_records, "env.question_not_in_last",
          f"must be in [0, env.n_records={e.n_records}), got {e.question_not_in_last}")
    _need(e.name == "sequential_records" or (e.n_values == 10 and e.question_not_in_last == 0 and e.compact_after_step is None),
          "env.n_values/question_not_in_last/compact_after_step", f"are sequential_records knobs; env.name is {e.name}")
    _need(e.compact_after_step is None or e.compact_after_step >= 1, "env.compact_after_step",
          f"must be >= 1 or null, got {e.compact_after_step}")
    _need(0.0 <= e.distractor_rate < 1.0, "env.distractor_rate", f"must be in [0, 1), got {e.distractor_rate}")
    from crl.envs.sequential_records import ASKED_POSITIONS

    _need(e.asked_position in ASKED_POSITIONS, "env.asked_position", f"must be one of {ASKED_POSITIONS}, got {e.asked_position!r}")
    _need(e.asked_position == "key" or e.name == "sequential_records", "env.asked_position",
          f"is a sequential_records knob; env.name is {e.name}")
    _need(e.asked_position == "key" or e.n_keys >= 2, "env.asked_position",
          f"'uniform' needs env.n_keys >= 2 (the records after the asked key's final write write other keys), got {e.n_keys}")
    if e.name == "sequential_records" and e.question_not_in_last:
        from crl.envs.sequential_records import askable_possible, unaskable

        _need(askable_possible(e.n_keys, e.distractor_rate), "env.question_not_in_last",
              unaskable(e.n_keys, e.question_not_in_last, "env."))
    _need(e.step_timeout_s is None or e.step_timeout_s > 0, "env.step_timeout_s", f"must be > 0 seconds or null, got {e.step_timeout_s}")
    _need(e.factory is None or e.name in ("custom", "torchrl_chat"), "env.name",
          f"env.factory={e.factory!r} builds your own suite: set env.name=custom (got {e.name})")
    _need(e.name != "torchrl_chat" or bool(e.factory), "env.factory",
          "env.name=torchrl_chat needs env.factory: 'package.module:function' returning a ChatEnv suite "
          "(crl/torchrl_llm/collector.py)")
    _need(e.name != "custom" or bool(e.factory), "env.factory",
          "env.name=custom needs env.factory: 'package.module:function' or 'path/to/file.py:function' returning a task suite")
    _need(e.factory is not None or not e.kwargs, "env.kwargs",
          "are the factory's keyword arguments: set env.factory (and env.name=custom), or remove them")
    if e.factory is not None:
        from crl.envs.factory import FactoryError, resolve_factory

        try:
            resolve_factory(e.factory)
        except FactoryError as err:
            raise ConfigValidationError(f"env.factory: {err}") from None
    _check_prompt_texts(cfg.prompt)
    _need(cfg.prompt.system_turn == "own" or (cfg.prompt.format == "chat" and cfg.prompt.system is None), "prompt.system_turn",
          "template takes the chat template's own system turn: it needs prompt.format=chat and no prompt.system")
    if e.name == "torchrl_chat":
        _check_torchrl_chat(cfg)
    _need(cfg.tools.timeout_s > 0 and cfg.tools.memory_mb >= 16 and cfg.tools.max_output_bytes >= 64,
          "tools.timeout_s/memory_mb/max_output_bytes", "timeout_s > 0, memory_mb >= 16, max_output_bytes >= 64")
    _need(bool(cfg.run_dir), "run_dir", "must name a directory")
    _need(0.0 <= cfg.learner.max_padding < 1.0, "learner.max_padding", f"must be in [0, 1), got {cfg.learner.max_padding}")
    _need(cfg.learner.max_chunk_tokens is None or cfg.learner.max_chunk_tokens >= 1, "learner.max_chunk_tokens", "must be >= 1 or null")
    try:  # the estimator's own check (one home: crl/objectives/options.py), named in config keys
        check_estimator_options(a.gamma, a.alpha, a.lmbda, a.lambda_length, a.value_target, a.boundary, a.cross_trajectory)
    except EstimatorOptionError as err:
        raise ConfigValidationError(f"{'/'.join(f'algo.{name}' for name in err.option.split('/'))}: {err.reason}") from None
    _need(a.clip_eps_low > 0 and a.clip_eps_high > 0, "algo.clip_eps_low/high", "must be > 0")
    _need(a.clip_value is None or a.clip_value > 0, "algo.clip_value", "must be > 0 or null")
    _need(a.target_kl is None or a.target_kl > 0, "algo.target_kl", f"must be > 0 or null, got {a.target_kl}")
    _need(a.critic_coef > 0, "algo.critic_coef", f"must be > 0 (the value loss's weight), got {a.critic_coef}")
    _need(cfg.model.share_critic_backbone or (a.critic_coef == 1.0 and not a.separate_losses), "algo.critic_coef/separate_losses",
          "weigh and route the value loss of a critic on the policy's trunk (model.share_critic_backbone=true); a separate critic "
          "has its own optimizer: set train.critic_lr instead, or model.share_critic_backbone=true")
    _need(not (a.frozen_summary and not c.enabled), "algo.frozen_summary",
          "needs compaction.enabled=true (no summaries without compaction)")
    preset = cfg.model.preset
    _need(preset in PRESETS or (bool(preset) and Path(preset).is_dir()), "model.preset",
          f"{preset!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint directory (nothing is downloaded)")
    _need(not (cfg.prompt.format == "chat" and preset in PRESETS and cfg.env.name != "torchrl_chat"), "prompt.format",
          "'chat' needs a checkpoint directory whose tokenizer has a chat template (presets use the word tokenizer)")
    if preset not in PRESETS:
        _need((Path(preset) / "config.json").is_file(), "model.preset",
              f"directory {preset} has no config.json: not a transformers checkpoint "
              "(import one with scripts/import_checkpoint.py, or use a preset)")
    _need(not (cfg.model.backend == "vllm" and cfg.model.preset in PRESETS), "model.backend",
          "vllm serves a checkpoint directory; presets use the transformers backend")
    _need(cfg.model.temperature > 0, "model.temperature", "must be > 0 (behaviour log-probs need a proper distribution)")
    _need(0 < cfg.model.top_p <= 1, "model.top_p", "must be in (0, 1]")
    _need(cfg.model.max_action_tokens >= 1, "model.max_action_tokens", "must be >= 1")
    lora = cfg.model.lora
    if lora.enabled:
        _need(lora.rank >= 1, "model.lora.rank", f"must be >= 1, got {lora.rank}")
        _need(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
        _need(lora.dropout == 0, "model.lora.dropout", f"must be 0, got {lora.dropout}: the sampler decodes with the adapters merged into "
              "the weights (crl.modules.lora.MergedAdapters), which cannot drop their input, so with dropout the learner's log-probs "
              "would be another, random function of the weights than the behaviour log-probs (PPO's first ratio not 1); set it to 0")
        _need(bool(lora.target_modules) and all(isinstance(m, str) and m for m in lora.target_modules), "model.lora.target_modules",
              "must list the linear layers to adapt, e.g. [q_proj, v_proj]")
        if cfg.deepspeed.config is not None and Path(cfg.deepspeed.config).is_file():
            _need(zero_stage(cfg.deepspeed.config) != 3, "model.lora.enabled",
                  "LoRA is not supported under DeepSpeed ZeRO-3 (the adapters are a few MB: use ZeRO-2 or none)")
    for key in ("iterations", "episodes_per_batch", "micro_batches", "policy_epochs", "policy_minibatches"):
        _need(getattr(t, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    _need(t.critic_updates >= 0, "train.critic_updates", "must be >= 0")
    _need(t.dist_timeout_s > 0, "train.dist_timeout_s", f"must be > 0 seconds, got {t.dist_timeout_s}")
    _need(t.critic_warmup_iterations >= 0, "train.critic_warmup_iterations", "must be >= 0")
    _need(t.actor_lr > 0 and t.critic_lr > 0, "train.actor_lr/critic_lr", "must be > 0")
    _need(t.policy_minibatches <= t.episodes_per_batch, "train.policy_minibatches",
          f"{t.policy_minibatches} minibatches cannot split {t.episodes_per_batch} episodes")
    _need(t.group_size >= 1 and t.episodes_per_batch % t.group_size == 0, "train.group_size",
          f"{t.group_size} must be >= 1 and divide train.episodes_per_batch={t.episodes_per_batch} (a rank's batch holds whole groups)")
    _need(t.branches >= 1 and t.episodes_per_batch % t.branches == 0, "train.branches",
          f"{t.branches} must be >= 1 and divide train.episodes_per_batch={t.episodes_per_batch} "
          "(a rank's batch holds whole branch groups)")
    if t.branches > 1:
        _need(t.group_size == 1, "train.group_size", f"train.branches={t.branches} already makes groups of one task's episodes (sharing a "
              f"prefix): set train.group_size=1 (got {t.group_size})")
        _need(e.name != "torchrl_chat", "train.branches",
              "env.name=torchrl_chat plays episodes through TorchRL's ChatEnv, which crl cannot fork: set train.branches=1")
        _need(c.enabled and c.max_compactions >= 1, "train.branches",
              "branches part at the first compaction: needs compaction.enabled and max_compactions >= 1")
        contexts = t.episodes_per_batch // t.branches
        _need(t.policy_minibatches <= contexts, "train.policy_minibatches",
              f"minibatches hold whole branch groups: {t.policy_minibatches} cannot split {contexts} contexts "
              "(episodes_per_batch / branches)")
    _need(0.0 <= a.sibling_value_weight <= 1.0, "algo.sibling_value_weight", f"must be in [0, 1], got {a.sibling_value_weight}")
    _need(a.sibling_value_weight == 0 or (t.branches >= 2 and a.estimator == "gae"), "algo.sibling_value_weight",
          "mixes the siblings' returns into the critic's values: needs train.branches >= 2 and algo.estimator=gae")
    _need(t.uniform_groups == "train" or t.branches >= 2 or t.group_size >= 2, "train.uniform_groups",
          "drop leaves out groups whose rewards agree: needs train.branches >= 2 or train.group_size >= 2")
    _need(a.kl_to == "behaviour" or a.kl_coef > 0, "algo.kl_to",
          f"reference sets what algo.kl_coef's penalty pulls toward: set algo.kl_coef > 0 (got {a.kl_coef})")
    _need(a.kl_to == "behaviour" or cfg.model.lora.enabled, "algo.kl_to",
          "reference is the policy as RL started, kept as a frozen LoRA adapter: needs model.lora.enabled=true")
    _need(t.lr_warmup_steps >= 0, "train.lr_warmup_steps", f"must be >= 0, got {t.lr_warmup_steps}")
    _need(t.max_grad_norm > 0 and t.critic_max_grad_norm > 0, "train.max_grad_norm/critic_max_grad_norm", "must be > 0")
    if a.estimator == "group":
        _need(t.group_size >= 2 or t.branches >= 2, "train.group_size",
              f"algo.estimator=group compares episodes of one task: needs train.group_size >= 2 or train.branches >= 2, got {t.group_size}")
        _need(t.critic_warmup_iterations == 0, "train.critic_warmup_iterations",
              f"algo.estimator=group has no critic to warm up: set it to 0 (got {t.critic_warmup_iterations})")
        _need(not cfg.model.share_critic_backbone, "model.share_critic_backbone", "algo.estimator=group builds no critic")
    for i, stage in enumerate(t.curriculum):
        _need(stage.length >= 1, f"train.curriculum[{i}].length", "must be >= 1")
        steps = stage.compaction_steps
        if steps is None:
            continue
        key = f"train.curriculum[{i}].compaction_steps"
        _need(e.name in ("memory_chain", "custom"), key,
              f"a forced compaction schedule exists for memory_chain and custom suites, not {e.name} (remove the key)")
        _need(all(isinstance(s, int) and not isinstance(s, bool) for s in steps) and list(steps) == sorted(set(steps))
              and all(s >= 1 for s in steps),
              key, f"must be strictly increasing positive integers, got {list(steps)}")
        _need(not steps or steps[-1] <= stage.length + 1, key,
              f"step {steps[-1] if steps else 0} is after the last observation before the question (length {stage.length} + 1)")
        _need(len(steps) <= c.max_compactions, key,
              f"{len(steps)} forced compactions exceed compaction.max_compactions={c.max_compactions}")
    _need(cfg.eval.every >= 0 and cfg.eval.episodes >= 1, "eval.every/episodes", "every >= 0 and episodes >= 1")
    _need(cfg.eval.temperature > 0, "eval.temperature", "must be > 0")
    _need(cfg.checkpoint.every >= 1 and cfg.checkpoint.keep_last >= 1, "checkpoint.every/keep_last", "must be >= 1")
    _need(cfg.checkpoint.evidence_every >= 1, "checkpoint.evidence_every", "must be >= 1")
    r = cfg.checkpoint.resume
    _need(r in ("auto", "force", "never") or (Path(r) / "meta.json").is_file(), "checkpoint.resume",
          f"{r!r} is neither auto, force, never nor a complete checkpoint directory (one with meta.json)")
    _need(cfg.warm_start.steps >= 0 and cfg.warm_start.batch_episodes >= 1, "warm_start.steps/batch_episodes",
          "steps >= 0, batch_episodes >= 1")
    w = cfg.warm_start
    _need(1 <= w.micro_batches <= w.batch_episodes, "warm_start.micro_batches",
          f"between 1 and warm_start.batch_episodes={w.batch_episodes} (each micro-batch holds whole rows, at least one per episode)")
    _need(w.micro_batches == 1 or w.summary_content != "balanced", "warm_start.micro_batches",
          "1 with warm_start.summary_content=balanced (its balance term is a function of the whole batch)")
    _need(cfg.warm_start.stop_answer_p is None or 0 < cfg.warm_start.stop_answer_p <= 1, "warm_start.stop_answer_p",
          "a probability in (0, 1], or null")
    _need(cfg.warm_start.probe_every >= 1, "warm_start.probe_every", ">= 1")
    _need(cfg.warm_start.probe_tasks >= 1, "warm_start.probe_tasks", ">= 1")
    _need(cfg.warm_start.format_draws >= 2, "warm_start.format_draws", ">= 2 (content is what differs between draws)")
    v = cfg.vllm
    _need(v.max_model_len is None or v.max_model_len >= c.context_capacity, "vllm.max_model_len",
          f"{v.max_model_len} is below compaction.context_capacity={c.context_capacity}: contexts up to C tokens must fit (or null)")
    _need(0 < v.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", f"must be in (0, 1], got {v.gpu_memory_utilization}")
    _need(v.cpu_kv_cache_gb > 0, "vllm.cpu_kv_cache_gb", f"must be > 0, got {v.cpu_kv_cache_gb}")
    _need(v.weights_dir is None or Path(v.weights_dir).is_dir(), "vllm.weights_dir",
          f"{v.weights_dir} is not a directory on this machine: give a local directory (RAM: /dev/shm), or null")
    _need(v.cpu_threads_bind in ("rank", "auto") or all(part.replace("-", "").isdigit() for part in v.cpu_threads_bind.split(",")),
          "vllm.cpu_threads_bind", f"{v.cpu_threads_bind!r} is neither rank, auto nor a core list like 0-3 or 0,2")
    if cfg.deepspeed.config is not None:
        _need(Path(cfg.deepspeed.config).is_file(), "deepspeed.config", f"file {cfg.deepspeed.config} does not exist")
        check_deepspeed(cfg, zero_stage(cfg.deepspeed.config))
    for path in cfg.tools.sandbox_ro_paths:
        _need(isinstance(path, str) and Path(path).is_absolute() and Path(path).exists(), "tools.sandbox_ro_paths",
              f"{path!r} is not an existing absolute path")
    if cfg.tools.cgroup_parent is not None:
        from crl.cgroups import check_delegated

        problem = check_delegated(cfg.tools.cgroup_parent)
        _need(problem is None, "tools.cgroup_parent", f"{problem}; or null to use the cgroup crl runs in")
    # Token budgets need token lengths (the run's tokenizer): crl.builders.check_budgets, when a Trainer is built.


PROMPT_TEXTS = ("system", "summary_instruction", "resume_prefix", "resume_suffix")  # prompt.* texts of the fixed pieces
PROMPT_TEMPLATES = {"task_template": "task", "observation_template": "observation"}  # prompt.* templates and their field


def _check_prompt_texts(p: PromptConfig) -> None:
    """Prompt texts are non-blank strings; each template holds its one field (``{task}`` / ``{observation}``) once
    and no other (a literal brace is written ``{{`` / ``}}``)."""
    import string

    for key in (*PROMPT_TEXTS, *PROMPT_TEMPLATES):
        text = getattr(p, key)
        _need(text is None or bool(text.strip()), f"prompt.{key}", "must be a non-blank text, or null for the format's own")
    for key, name in PROMPT_TEMPLATES.items():
        text = getattr(p, key)
        if text is None:
            continue
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        except ValueError as err:
            raise ConfigValidationError(f"prompt.{key}: {text!r} is not a format string ({err}); "
                                        "write a literal brace as {{ or }}") from None
        _need(fields == [name], f"prompt.{key}", f"must contain {{{name}}} exactly once and no other field, got {text!r}")


def chance_success(cfg: Config) -> float | None:
    """The success rate of a policy that ignores every observation (a uniform guess of the answer), where the
    environment fixes it: ``1 / env.n_facts`` on the memory chain; None elsewhere. The yardstick of a learning claim
    (``make train``'s verdict, ``scripts/sweep.py``'s chance line)."""
    return 1 / cfg.env.n_facts if cfg.env.name == "memory_chain" else None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
