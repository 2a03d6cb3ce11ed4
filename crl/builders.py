"""From a validated :class:`crl.config.Config` to the objects a run needs: suites, compaction configs, models.

Shared by :class:`crl.trainer.Trainer`, the benchmarks and the tests, so every entry point builds the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
from crl.prompts import EOS


def build_suite(cfg, stage=None):
    """The task suite of ``cfg.env``, or of a curriculum ``stage`` (:class:`crl.config.CurriculumStage`: its
    length and, for the memory chain, its forced compaction schedule)."""
    e = cfg.env
    if e.name == "torchrl_chat":
        return build_chat_suite(cfg)
    if e.name == "custom":
        from crl.config import ConfigValidationError
        from crl.envs.factory import FactoryError, build_custom_suite

        try:
            return build_custom_suite(e.factory, e.kwargs, stage)
        except FactoryError as err:
            raise ConfigValidationError(f"env.factory: {err}") from None
    length = None if stage is None else stage.length
    if e.name == "memory_chain":
        n = e.length if length is None else length
        schedule = e.compaction_steps if stage is None else stage.compaction_steps  # None: derived from the length
        return MemoryChainSuite(length=n, n_facts=e.n_facts, compaction_steps=schedule, keep_recent=cfg.compaction.keep_recent,
                                seed=e.seed, extra_steps=e.extra_steps,
                                 early_submit=e.early_submit, invalid_command=e.invalid_command)
    n = e.n_records if length is None else length
    return SequentialRecordsSuite(n_records=n, distractor_rate=e.distractor_rate, n_keys=e.n_keys, n_values=e.n_values, seed=e.seed,
                                  extra_steps=e.extra_steps, early_submit=e.early_submit, invalid_command=e.invalid_command,
                                  question_not_in_last=e.question_not_in_last, asked_position=e.asked_position,
                                  compaction_steps=(e.compact_after_step,) if e.compact_after_step else ())


def eval_share(episodes: int, rank: int, world: int) -> int:
    """Rank ``rank``'s share of an evaluation of ``episodes`` episodes over ``world`` ranks: the global episodes
    ``rank, rank + world, ... < episodes`` (0 when ``episodes < world`` leaves the rank none)."""
    return len(range(rank, episodes, world))


def sampling_spec(cfg, codec: "TextCodec", *, evaluation: bool = False):
    """The run's :class:`crl.sampling.SamplingSpec`: every sampler (crl's collector on either backend, the TorchRL chat
    collector) and the learner's log-probs derive from it. ``model.temperature`` (``eval.temperature`` when
    ``evaluation``) and ``model.top_p``; EOS stops a generation; a torchrl_chat sampler never draws the pad token
    (TorchRL's wrapper reads it as padding)."""
    from crl.sampling import SamplingSpec

    chat = cfg.env.name == "torchrl_chat"
    return SamplingSpec(temperature=cfg.eval.temperature if evaluation else cfg.model.temperature, top_p=cfg.model.top_p,
                        stop_token_ids=(codec.eos_id,), suppress_ids=(codec.tokenizer.pad_token_id,) if chat else ())


def build_collector(cfg, split: str, stage, backend, codec: "TextCodec", prompt_format, *, evaluation: bool = False,
                    frozen_backend=None, rank: int = 0, world: int = 1, progress: bool = False):
    """The :class:`~crl.collectors.CompactionCollector` of ``split`` on curriculum ``stage`` (None: the env's own task).

    Training (``evaluation=False``): ``train.episodes_per_batch`` sampled tasks per batch at ``model.temperature``.
    Evaluation: rank ``r`` plays global episodes ``r, r + world, ... < eval.episodes`` (:func:`eval_share` of them),
    the split's tasks in that order, at ``eval.temperature``: ``eval.episodes`` in all, whatever the world size. ``frozen_backend``:
    summaries from a frozen copy (the frozen-summary ablation). Shared by the trainer and ``scripts/evaluate.py``, so both play the same
    episodes.
    """

    from crl.collectors import CompactionCollector

    if cfg.env.name == "torchrl_chat":
        return build_chat_collector(cfg, split, backend, codec, evaluation=evaluation, rank=rank, world=world, progress=progress)
    suite = build_suite(cfg, stage)
    return CompactionCollector(
        suite, split, backend, codec.encode, codec.decode, codec.eos_id, build_compaction_config(cfg, suite),
        episodes_per_batch=eval_share(cfg.eval.episodes, rank, world) if evaluation else cfg.train.episodes_per_batch,
        sampling=sampling_spec(cfg, codec, evaluation=evaluation),
        max_action_tokens=cfg.model.max_action_tokens, summary_backend=frozen_backend, rank=rank, world_size=world,
        seed=cfg.train.seed + 7 if evaluation else cfg.train.seed, tasks_in_order=evaluation,
        step_timeout=cfg.env.step_timeout_s, progress=progress, engine_kwargs={"prompt_format": prompt_format},
        group_size=1 if evaluation else cfg.train.group_size, branches=1 if evaluation else cfg.train.branches,
    )


def build_compaction_config(cfg, suite) -> CompactionConfig:
    c = cfg.compaction
    if not c.enabled:  # the no-compaction ablation: plain long context, truncated when full
        return CompactionConfig(context_capacity=c.context_capacity, min_remaining=c.min_remaining, max_compactions=0,
                                keep_recent=c.keep_recent,
                                max_summary_tokens=c.max_summary_tokens, max_steps=c.max_steps)
    forced = tuple(getattr(suite, "compaction_steps", ())) if c.forced else ()
    return CompactionConfig(
        context_capacity=c.context_capacity,
        min_remaining=c.min_remaining,
        max_compactions=c.max_compactions,
        keep_recent=c.keep_recent,
        max_summary_tokens=c.max_summary_tokens,
        keep_task_prompt=c.keep_task_prompt,
        forced_steps=forced,
        max_steps=c.max_steps,
    )


def curriculum_stages(cfg) -> list:
    """The curriculum's :class:`crl.config.CurriculumStage` s in order (``[None]``: the env's own task throughout)."""
    return list(cfg.train.curriculum) or [None]


@dataclass(frozen=True)
class TextCodec:
    """The tokenizer as the rest of the run uses it: text <-> ids without added special tokens, EOS, vocab size."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    eos_id: int
    vocab_size: int
    tokenizer: object = None  # the transformers tokenizer behind it (saved with every checkpoint's policy)


def build_tokenizer(cfg) -> TextCodec:
    """The project's shipped tokenizer for presets; a local checkpoint's own tokenizer when it has one."""
    path = Path(cfg.model.preset)
    chat_preset = cfg.env.name == "torchrl_chat" and not path.is_dir()  # free text (code): the byte-level chat tokenizer
    if chat_preset or (path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))):
        from transformers import AutoTokenizer

        tok = chat_tokenizer(cfg) if cfg.env.name == "torchrl_chat" else AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no EOS token; actions and summaries need one to stop")
        return TextCodec(
            lambda text: tok.encode(text, add_special_tokens=False),
            lambda ids: tok.decode(list(ids), skip_special_tokens=False),
            int(tok.eos_token_id),
            len(tok),
            tok,
        )
    from crl.modules import tokenizer as project

    tok = project.load_tokenizer()
    return TextCodec(project.encode, project.decode, tok.convert_tokens_to_ids(EOS), len(tok), tok)


def build_prompt_format(cfg, codec: TextCodec):
    """The :class:`crl.chat.PromptFormat` of ``cfg.prompt.format`` for the run's tokenizer.

    ``plain``: the project's tagged protocol encoded with ``codec`` (the engine's default). ``chat``: the
    pieces rendered through the chat template of the local checkpoint ``cfg.model.preset``; its end-of-turn
    token must be the codec's stop token (``codec.eos_id``), which every collector and sampler stops on.
    Raises :class:`crl.config.ConfigValidationError` naming the key when that cannot work.
    """
    from crl.chat import ChatFormat, ChatTemplateError, PlainFormat, load_chat_tokenizer
    from crl.config import ConfigValidationError

    p = cfg.prompt
    texts = {name: getattr(p, key) for name, key in (("system_prompt", "system"), ("summary_instruction", "summary_instruction"),
                                                    ("resume_prefix", "resume_prefix"), ("resume_suffix", "resume_suffix"))
             if getattr(p, key) is not None}
    if p.format == "plain":  # the only other choice, "chat", is checked by crl.config
        if p.task_template is not None:
            texts["format_task"] = lambda text, t=p.task_template: t.format(task=text)
        if p.observation_template is not None:
            texts["format_observation"] = lambda text, t=p.observation_template: t.format(observation=text)
        _check_known_words(cfg, codec)
        return PlainFormat(codec.encode, **texts)
    texts.update({key: getattr(p, key) for key in ("task_template", "observation_template") if getattr(p, key) is not None})
    texts["system_turn"] = p.system_turn
    path = Path(cfg.model.preset)
    if cfg.env.name == "torchrl_chat":  # the ChatEnv suite renders its own turns; this format names the stop token
        return ChatFormat(codec.tokenizer, **texts)
    if not (path.is_dir() and (path / "tokenizer_config.json").exists()):
        raise ConfigValidationError(f"prompt.format: chat needs a local checkpoint with a chat template; model.preset={cfg.model.preset!r} "
                                    "is a preset with the project's word tokenizer (use plain)")
    try:
        fmt = ChatFormat(load_chat_tokenizer(path), **texts)
    except ChatTemplateError as err:
        raise ConfigValidationError(f"prompt.format: chat: {err}") from None
    if fmt.stop_id != codec.eos_id:
        raise ConfigValidationError(
            f"prompt.format: chat: the template's end-of-turn {fmt.stop_token!r} (id {fmt.stop_id}) is not the tokenizer's EOS (id "
            f"{codec.eos_id}); set the checkpoint's eos_token to the end-of-turn token"
        )
    return fmt


def _check_known_words(cfg, codec: TextCodec) -> None:
    """Configured prompt texts in the project's word vocabulary: an unknown word would silently become ``<|unk|>``."""
    from crl.config import ConfigValidationError
    from crl.prompts import UNK

    tok = codec.tokenizer
    if tok is None or getattr(tok, "unk_token", None) != UNK:  # a checkpoint's own (subword) tokenizer covers any text
        return
    unk = tok.convert_tokens_to_ids(UNK)
    from crl.config import PROMPT_TEMPLATES, PROMPT_TEXTS

    for key in (*PROMPT_TEXTS, *PROMPT_TEMPLATES):
        text = getattr(cfg.prompt, key)
        if text is None:
            continue
        words = [w for w in text.replace("{task}", " ").replace("{observation}", " ").split() if unk in codec.encode(w)]
        if words:
            raise ConfigValidationError(f"prompt.{key}: {words} are not in the project's word vocabulary (crl/modules/tokenizer.py) and "
                                        "would "
                                        "all read as <|unk|>; use its words, or a checkpoint with its own tokenizer (model.preset)")


def chat_tokenizer(cfg):
    """The ``transformers`` tokenizer of an ``env.name: torchrl_chat`` run: the checkpoint's own, or for a preset the
    byte-level ChatML tokenizer (:mod:`crl.modules.byte_tokenizer`; any text round-trips, code included)."""
    path = Path(cfg.model.preset)
    if not path.is_dir():
        from crl.modules.byte_tokenizer import byte_chat_tokenizer

        return byte_chat_tokenizer()
    from crl.chat import load_chat_tokenizer

    tok = load_chat_tokenizer(path)
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        # TorchRL's wrapper masks responses with != pad: pad = EOS would drop the sampled EOS (docs/torchrl.md).
        # Another special token that the policy never ends a turn with serves (SmolLM2: <|endoftext|>).
        spare = [t for t in ("<|endoftext|>", tok.bos_token, tok.unk_token, "<|pad|>")
                 if t and t != tok.eos_token and tok.convert_tokens_to_ids(t) not in (None, tok.unk_token_id if t != tok.unk_token
                                                                                      else None)]
        if not spare:
            from crl.config import ConfigValidationError

            raise ConfigValidationError(f"model.preset: the tokenizer in {path} pads with its EOS and has no other special token to pad "
                                        "with; "
                                        "add a pad token to the checkpoint (tokenizer.add_special_tokens({'pad_token': '<|pad|>'}), resize "
                                        "the embeddings)")
        tok.pad_token = spare[0]
    return tok


_CHAT_SUITES: dict = {}


def build_chat_suite(cfg, tokenizer=None):
    """The user's TorchRL chat suite: ``env.factory(tokenizer=, seed=env.seed, tools=cfg.tools, **env.kwargs)``, built once
    per (factory, kwargs) in a process (a suite may hold expensive state: task lists, sandboxes)."""
    from crl.config import ConfigValidationError
    from crl.envs.factory import FactoryError, resolve_factory

    e = cfg.env
    key = (e.factory, repr(sorted(e.kwargs.items())), e.seed, repr(cfg.tools), id(tokenizer) if tokenizer is not None else None)
    if key in _CHAT_SUITES:
        from crl.cgroups import use_delegated

        use_delegated(cfg.tools.cgroup_parent)  # this config's, also when another config's suite was built since
        return _CHAT_SUITES[key]
    check_tool_sandbox(cfg)
    try:
        fn = resolve_factory(e.factory)
    except FactoryError as err:
        raise ConfigValidationError(f"env.factory: {err}") from None
    tok = tokenizer if tokenizer is not None else chat_tokenizer(cfg)
    try:
        suite = fn(tokenizer=tok, seed=e.seed, tools=cfg.tools, **e.kwargs)
    except Exception as err:
        raise ConfigValidationError(f"env.factory: {e.factory}(tokenizer=..., seed={e.seed}, tools=..., **{e.kwargs}) raised "
                                    f"{type(err).__name__}: {err}") from err
    from crl.torchrl_llm.collector import check_chat_suite

    try:
        check_chat_suite(suite)
    except TypeError as err:
        raise ConfigValidationError(f"env.factory: {err}") from None
    _CHAT_SUITES[key] = suite
    return suite


def check_tool_sandbox(cfg) -> None:
    """The tool sandbox must work on this machine before the first tool call (else a build-time error with the fix):
    in every mode its syscall filter (libseccomp), in ``bwrap`` bubblewrap too, and the delegated cgroup
    (``tools.cgroup_parent``) where one is set; ``none`` also warns on every start."""
    import warnings

    from crl.cgroups import call_budget, unavailable_reason, use_delegated
    from crl.config import ConfigValidationError
    from crl.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox(cfg.tools.sandbox)
    except SandboxUnavailable as err:
        raise ConfigValidationError(f"tools.sandbox: {err}") from None
    if cfg.tools.sandbox == "none":
        warnings.warn("tools.sandbox=none: model-written code runs UNSANDBOXED on this machine (files, network, processes); "
                      "use tools.sandbox=bwrap (apt-get install bubblewrap)", stacklevel=2)
    use_delegated(cfg.tools.cgroup_parent)  # this process's calls' cgroups: below it, or below the cgroup crl runs in
    if cfg.tools.cgroup_parent is not None and call_budget() is None:
        raise ConfigValidationError(f"tools.cgroup_parent: {unavailable_reason()}")


def chat_compaction_texts(cfg) -> dict:
    """The ``prompt.*`` overrides a torchrl_chat run passes to :class:`crl.torchrl_llm.CompactionTransform` (the rest of
    its turns are the suite's)."""
    p = cfg.prompt
    return {name: getattr(p, name) for name in ("summary_instruction", "resume_prefix", "resume_suffix") if getattr(p, name) is not None}


def build_chat_collector(cfg, split: str, backend, codec: "TextCodec", *, evaluation: bool = False, rank: int = 0, world: int = 1,
                         progress: bool = False):
    """The :class:`crl.torchrl_llm.collector.ChatCollector` of ``split`` (``env.name: torchrl_chat``): the same episode
    counts, temperatures, seeds and task order as :func:`build_collector`."""
    from crl.torchrl_llm.collector import ChatCollector

    texts = chat_compaction_texts(cfg)
    return ChatCollector(
        build_chat_suite(cfg, codec.tokenizer), split, backend, codec.tokenizer, build_compaction_config(cfg, None),
        episodes_per_batch=eval_share(cfg.eval.episodes, rank, world) if evaluation else cfg.train.episodes_per_batch,
        sampling=sampling_spec(cfg, codec, evaluation=evaluation), max_new_tokens=cfg.model.max_action_tokens,
        task_seed=cfg.train.seed + 7 if evaluation else cfg.train.seed, rank=rank,
        world_size=world, tasks_in_order=evaluation, group_size=1 if evaluation else cfg.train.group_size, texts=texts, progress=progress,
    )


def check_chat_budgets(cfg, codec: "TextCodec") -> None:
    """torchrl_chat: the CompactionTransform's own checks (texts vs budget) and, per split (train, dev), the reset of
    its first task and of its longest task prompt (``suite.query`` in tokens): a prompt that cannot fit the context
    fails here, naming the task, instead of every draw of it ending as FAILED mid-run."""
    from tensordict import TensorDict, set_list_to_stack

    from crl.compaction import ConfigError
    from crl.config import ConfigValidationError
    from crl.torchrl_llm.collector import ChatCollector

    suite = build_chat_suite(cfg, codec.tokenizer)
    texts = chat_compaction_texts(cfg)
    compaction = ChatCollector.make_compaction(codec.tokenizer, build_compaction_config(cfg, None), cfg.model.max_action_tokens, texts, 0)
    for split in ("train", "dev"):
        try:
            tasks = list(suite.tasks(split))
            if not tasks:
                raise ValueError(f"split {split!r} has no tasks")
            longest = max(range(len(tasks)), key=lambda i: len(codec.encode(suite.query(tasks[i]))))
        except Exception as err:
            raise ConfigValidationError(f"env: listing the {split} tasks of {cfg.env.factory} raised {type(err).__name__}: {err}") from err
        for which, i in (("first", 0), ("longest", longest)) if longest else (("first", 0),):
            try:
                env = suite.make_env(tasks[i], compaction)
                with set_list_to_stack(True):
                    env.reset(TensorDict(query=[suite.query(tasks[i])], batch_size=(1,)))
                env.close(raise_if_closed=False)
            except ConfigError as err:
                raise ConfigValidationError(f"compaction: starting the {which} {split} task (#{i}: {str(tasks[i])[:60]!r}) of "
                                            f"{cfg.env.factory}: {err}") from None
            except Exception as err:
                raise ConfigValidationError(f"env: starting the {which} {split} task (#{i}: {str(tasks[i])[:60]!r}) of {cfg.env.factory} "
                                            f"raised {type(err).__name__}: {err}") from err


def check_budgets(cfg, codec: TextCodec, prompt_format=None) -> None:
    """Build every stage's compaction engine and start one episode of each split with the run's tokenizer.

    Token budgets depend on token lengths, so this runs when a trainer is built (not when a config is loaded).
    ``prompt_format``: the run's :func:`build_prompt_format` (built here when not given).
    Raises :class:`crl.config.ConfigValidationError` with the engine's arithmetic (``|s| + ... > C``).
    """
    from crl.compaction import ConfigError
    from crl.config import ConfigValidationError

    if cfg.env.name == "torchrl_chat":
        return check_chat_budgets(cfg, codec)
    if prompt_format is None:
        prompt_format = build_prompt_format(cfg, codec)
    try:
        for stage in curriculum_stages(cfg):
            suite = build_suite(cfg, stage)
            engine = CompactionEngine(build_compaction_config(cfg, suite), codec.encode, eos_id=codec.eos_id, prompt_format=prompt_format)
            for split in ("train", "dev"):
                try:
                    env = suite.make_env(suite.tasks(split)[0])
                    prompt = env.reset()
                except Exception as err:
                    raise ConfigValidationError(f"env: starting the first {split} task raised {type(err).__name__}: {err}") from err
                if not isinstance(prompt, str):
                    raise ConfigValidationError(f"env: reset() of the first {split} task returned a {type(prompt).__name__}; it must "
                                                "return the task text (str)")
                engine.start(prompt)
            if cfg.warm_start.enabled:
                _check_warm_start_hooks(env)
    except ConfigError as err:
        raise ConfigValidationError(f"compaction: {err}") from None


def _check_warm_start_hooks(env) -> None:
    """The warm start plays oracle episodes: the environment must say what the optimal action and summary are."""
    import random

    from crl.config import ConfigValidationError

    for hook, args in (("oracle_action", ()), ("oracle_summary", ()), ("format_only_summary", (random.Random(0),))):
        try:
            value = getattr(env, hook)(*args)
        except (AttributeError, NotImplementedError):
            value = None
        if not isinstance(value, str):
            raise ConfigValidationError(
                f"warm_start.enabled: the warm start needs the environment's {hook}() returning a str ({type(env).__name__} "
                f"{'has none' if value is None else 'returned ' + type(value).__name__}); implement it (crl/envs/base.py TextEnv) "
                "or set warm_start.enabled=false"
            )
