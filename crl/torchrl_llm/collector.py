"""``ChatCollector``: crl's Trainer on a TorchRL chat environment (``env.name: torchrl_chat``).

The same surface as :class:`crl.collectors.CompactionCollector` — ``collect()`` returns validated episode rows,
``last_episodes`` / ``last_stats`` feed the metrics, ``state_dict()`` the checkpoint — but an episode is TorchRL's:
a ``ChatEnv`` (one conversation) built by the user's suite with crl's :class:`~crl.torchrl_llm.CompactionTransform`
in it, played by ``env.rollout`` with a ``TransformersWrapper`` over the trainer's own policy module (the weights
the learner updates, so no weight sync; each episode's ``generate`` calls reuse the keys/values of the prefix the
previous turn ran, :mod:`crl.torchrl_llm.prefix_cache`), and turned into crl rows by :func:`~crl.torchrl_llm.to_episodes`, which
re-scores the behaviour log-probs with the trainer's actor at the sampling temperature.

The suite (what ``env.factory`` returns, called with ``tokenizer=``, ``seed=`` and ``env.kwargs``)::

    suite.tasks(split) -> sequence of tasks            # split in train / dev / test
    suite.query(task) -> str                           # the user turn ChatEnv is reset with
    suite.make_env(task, compaction) -> EnvBase        # a TransformedEnv over ChatEnv(batch_size=(1,)) holding
                                                       # compaction(*on_action): call it with your tools / verifier
    suite.summary_holds(task, text) -> bool | None     # optional: does this summary hold what the episode needs?
                                                       # (crl.envs.base.TextEnv.summary_holds; a diagnostic)

Sampling is reproducible: each episode samples under ``torch`` seeded from the collector's stream and the episode
number, inside :func:`crl.sampling.seeded_torch_rng` (the trainer's global RNG is untouched, CUDA's included). An environment that raises
ends its episode as FAILED (counted, logged, one row of its task text, never trained by default); the batch goes on.
"""
from __future__ import annotations

import functools
import time
import warnings

import torch
from tensordict import TensorDict, set_list_to_stack
from tqdm.auto import tqdm

from crl.collectors.compaction_collector import EpisodeStream, EpisodeSummary
from crl.compaction import CompactionConfig
from crl.episode import EpisodeStatus, Provenance, Segment, SegmentKind, build_episode, concat_episodes, validate_episodes
from crl.streams import stream_seed
from crl.modules.networks import actor_module
from crl.sampling import SamplingSpec, seeded_torch_rng, warn_ignored_generation_keys
from crl.torchrl_llm.convert import to_episodes
from crl.torchrl_llm.prefix_cache import EpisodePrefixCache
from crl.torchrl_llm.transform import CompactionTransform

__all__ = ["ChatCollector", "check_chat_suite"]

SUITE_METHODS = ("tasks", "query", "make_env")


def check_chat_suite(suite, source: str = "env.factory") -> None:
    missing = [m for m in SUITE_METHODS if not callable(getattr(suite, m, None))]
    if missing:
        raise TypeError(
            f"{source} returned {type(suite).__name__}, which lacks {', '.join(missing)}(): a torchrl_chat suite has tasks(split), "
            "query(task) -> str and make_env(task, compaction) -> a TransformedEnv over ChatEnv (crl/torchrl_llm/collector.py)"
        )


class ChatCollector(EpisodeStream):
    """Collect batches of compacted TorchRL chat episodes (see the module docstring).

    Args:
        suite: the user's suite. split: its split to play.
        backend: the trainer's :class:`crl.modules.generation.TransformersBackend` — its model (the policy module),
            its seed (the sampler stream) and its ``policy_version``. tokenizer: its ``transformers`` tokenizer (chat template).
        compaction: Eq. 7–9 numbers. texts: ``summary_instruction`` / ``resume_prefix`` / ``resume_suffix`` overrides.
        episodes_per_batch, temperature, top_p, max_new_tokens: as crl's collector (one generation limit for actions
            and summaries: TorchRL's wrapper takes one). task_seed: the task draw. rank / world_size / group_size / tasks_in_order: as
            crl's.
        sampling: the :class:`crl.sampling.SamplingSpec` (default: ``temperature``, ``top_p``, the pad token
            suppressed: TorchRL's wrapper reads pad as padding). The wrapper's ``generate`` runs inside
            :meth:`~crl.sampling.SamplingSpec.applied_to`, so the policy's ``generation_config.json`` cannot add a
            penalty or a top-k (one warning names what it sets); the re-scoring actor applies the same spec.
    """

    def __init__(self, suite, split: str, backend, tokenizer, compaction: CompactionConfig, *, episodes_per_batch: int,
                 temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 16, task_seed: int = 0, rank: int = 0, world_size: int = 1,
                 tasks_in_order: bool = False, group_size: int = 1, texts: dict | None = None, progress: bool = False,
                 sampling: SamplingSpec | None = None):
        from torchrl.modules.llm import TransformersWrapper

        check_chat_suite(suite)
        if group_size < 1 or episodes_per_batch % group_size:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide episodes_per_batch={episodes_per_batch}")
        self.suite, self.split, self.tasks = suite, split, list(suite.tasks(split))
        if not self.tasks:
            raise ValueError(f"split {split!r} of {type(suite).__name__} has no tasks")
        self.backend, self.lm, self.tokenizer, self.config = backend, backend.model, tokenizer, compaction
        lm = self.lm
        self.sampler_seed = backend.generator.initial_seed()  # the backend's stream: evaluation forks give their own
        self.texts = dict(texts or {})
        self.episodes_per_batch, self.max_new_tokens, self.total_batches = episodes_per_batch, max_new_tokens, -1
        self.seed, self.rank, self.world_size = task_seed, rank, world_size  # seed: the task order (EpisodeStream)
        self.tasks_in_order, self.group_size, self.progress = tasks_in_order, group_size, progress
        # one distribution for the sampler (generate's kwargs, the model's generation_config swapped for the call) and
        # the re-scoring actor: exactly the learner's (tests/test_sampling.py checks against generate's own scores)
        self.sampling = sampling or SamplingSpec(temperature, top_p, suppress_ids=(int(tokenizer.pad_token_id),))
        if int(tokenizer.pad_token_id) not in self.sampling.suppress_ids:
            raise ValueError(f"the chat sampler must suppress the pad token ({tokenizer.pad_token_id}): TorchRL's wrapper reads it as "
                             "padding")
        warn_ignored_generation_keys(lm, self.sampling)
        self.policy = TransformersWrapper(lm, tokenizer=tokenizer, input_mode="history", generate=True,
                                          generate_kwargs=self.sampling.generate_kwargs(max_new_tokens), return_log_probs=True,
                                          prefer_tokens=True)
        self.actor = actor_module(lm, sampling=self.sampling)
        self.stop_id = self.compaction_factory(0)().stop_id  # fail now, not mid-run: the transform checks the budget against the texts
        self.engine = self  # the trainer reads collector.engine.config.forced_steps (none here: compaction is by budget)
        self.episodes_started = 0
        self._prompt_tokens = self._reused_tokens = 0  # this batch's: given to generate, of which from the prefix cache
        self.batches_yielded = 0
        self.last_episodes: list[EpisodeSummary] = []
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ crl collector surface
    def update_policy_weights_(self, state_dict: dict | None = None) -> None:
        """The wrapper holds the trainer's own module: nothing to copy unless weights are given."""
        if state_dict is not None:
            self.lm.load_state_dict(state_dict)

    def shutdown(self) -> None:
        """Environments are built and closed per episode."""

    # ------------------------------------------------------------------ episodes
    @staticmethod
    def make_compaction(tokenizer, config: CompactionConfig, max_new_tokens: int, texts: dict, rollout_id: int):
        """``compaction(*on_action)`` for a suite's ``make_env``: a CompactionTransform numbering its one episode ``rollout_id``."""
        return functools.partial(CompactionTransform, tokenizer, config, max_new_tokens, first_rollout_id=rollout_id, rollout_id_stride=1,
                                 **texts)

    def compaction_factory(self, rollout_id: int):
        return self.make_compaction(self.tokenizer, self.config, self.max_new_tokens, self.texts, rollout_id)

    def _play(self, task, rollout_id: int, n: int):
        env = self.suite.make_env(task, self.compaction_factory(rollout_id))
        try:
            cap = (self.config.max_steps or 10_000) * 2 + 2 * self.config.max_compactions + 2  # rollout's own step cap: never reached
            with (seeded_torch_rng(stream_seed(self.sampler_seed, "chat", self.rank, n), next(self.lm.parameters()).device),
                  set_list_to_stack(True), self.sampling.applied_to(self.lm), EpisodePrefixCache(self.lm) as prefix):
                reset = env.reset(TensorDict(query=[self.suite.query(task)], batch_size=(1,)))
                with torch.no_grad():
                    rows = env.rollout(cap, self.policy, tensordict=reset, auto_reset=False, break_when_any_done=True)
            self._prompt_tokens += prefix.prompt_tokens
            self._reused_tokens += prefix.reused_tokens
        finally:
            env.close(raise_if_closed=False)
        return rows.reshape(-1)

    def _failed_rows(self, task, rollout_id: int, group_id: int) -> TensorDict:
        """A failed episode as crl's own collector records one: a single EXECUTION segment of its task text (nothing
        sampled, nothing optimized), status FAILED, reward 0. It is in the rollout evidence the audit reads, and a rank
        whose episodes all failed still yields rows: the learner drops them (``train.failed_episodes=drop``) and the
        rank takes part in every collective, so the iteration's update is skipped on every rank, or made by the
        others, instead of this rank dying while the others wait."""
        try:
            ids = list(self.tokenizer(str(self.suite.query(task)), add_special_tokens=False)["input_ids"])
        except Exception:  # the task itself is what failed: the row needs a token, not the text
            ids = []
        segment = Segment(SegmentKind.EXECUTION)
        segment.extend(ids or [self.tokenizer.eos_token_id], Provenance.TASK)
        td = build_episode([segment], rollout_id, 0.0, EpisodeStatus.FAILED)
        td["policy_version"] = torch.full((1,), int(getattr(self.backend, "policy_version", 0)), dtype=torch.int64)
        td["group_id"] = torch.full((1,), group_id, dtype=torch.int64)
        return td

    def _judge_summaries(self, task, td: TensorDict) -> dict:
        """The suite's verdicts (``suite.summary_holds(task, text)``, optional) on the episode ``td``'s summaries, in
        segment order, each decoded as the compaction transform copies it (the sampled tokens without the stop
        token): the :class:`EpisodeSummary` fields ``summaries_judged`` / ``summaries_holding`` / ``last_summary_holds``."""
        out = {"summaries_judged": 0, "summaries_holding": 0, "last_summary_holds": None}
        hook = getattr(self.suite, "summary_holds", None)
        if hook is None:
            return out
        rows = td[td["segment_kind"] == int(SegmentKind.SUMMARY)]
        for i in rows["segment_index"].argsort().tolist():
            ids = rows["tokens"][i][rows["loss_mask"][i]].tolist()
            ids = ids[:-1] if ids and ids[-1] == self.stop_id else ids
            verdict = hook(task, self.tokenizer.decode(ids, skip_special_tokens=False))
            if verdict is None:
                continue
            if not isinstance(verdict, bool):
                raise TypeError(f"suite.summary_holds returned {verdict!r} ({type(verdict).__name__}); expected True, False or None")
            out["summaries_judged"] += 1
            out["summaries_holding"] += verdict
            out["last_summary_holds"] = verdict
        return out

    def collect(self) -> TensorDict:
        """Play ``episodes_per_batch`` episodes to the end and return their validated rows."""
        t0 = time.perf_counter()
        was_training = self.lm.training
        self.lm.eval()
        episodes, self.last_episodes = [], []
        generated = {"action": 0, "summary": 0}
        self._prompt_tokens = self._reused_tokens = 0
        bar = tqdm(total=self.episodes_per_batch, desc=f"chat episodes ({self.split})", disable=not self.progress, leave=False)
        try:
            for _ in range(self.episodes_per_batch):
                n = self.episodes_started
                self.episodes_started += 1
                rid, group_id = self._rollout_id(n), self._group_id(n)
                task = self._next_task(n)
                task_id = str(getattr(task, "task_id", task))[:80]
                try:
                    rows = self._play(task, rid, n)
                    td = to_episodes(rows, self.actor, vocab_size=len(self.tokenizer))
                    verdicts = self._judge_summaries(task, td)
                except Exception as err:  # the user's environment (or its tools) failed: this episode only
                    warnings.warn(f"torchrl_chat episode {rid} ({task_id}) failed: {type(err).__name__}: {err}", stacklevel=2)
                    self.last_episodes.append(EpisodeSummary(rid, task_id, EpisodeStatus.FAILED, 0.0, 0, 0, 1,
                                                             f"{type(err).__name__}: {err}"))
                    episodes.append(self._failed_rows(task, rid, group_id))
                    bar.update(1)
                    continue
                td["policy_version"] = torch.full((td.batch_size[0],), int(getattr(self.backend, "policy_version", 0)), dtype=torch.int64)
                td["group_id"] = torch.full((td.batch_size[0],), group_id, dtype=torch.int64)
                episodes.append(td)
                summary_rows = td["segment_kind"] == 1
                generated["summary"] += int(td["loss_mask"][summary_rows].sum())
                generated["action"] += int(td["loss_mask"][~summary_rows].sum())
                last = rows[-1]
                self.last_episodes.append(EpisodeSummary(
                    rid, task_id, EpisodeStatus(int(td["status"][0])), float(td["reward"][0]),
                    int(last.get(("next", "compaction", "n_steps")).reshape(-1)[0]), int(summary_rows.sum()), int(td.batch_size[0]),
                    **verdicts,
                ))
                bar.update(1)
        finally:
            bar.close()
            self.lm.train(was_training)
        batch = concat_episodes(episodes)
        validate_episodes(batch, vocab_size=len(self.tokenizer))
        elapsed = time.perf_counter() - t0
        self.batches_yielded += 1
        n_done = len(self.last_episodes)
        self.last_stats = {
            "episodes": n_done, "generated_action_tokens": generated["action"], "generated_summary_tokens": generated["summary"],
            "seconds": elapsed, "episodes_per_s": n_done / elapsed,
            "generated_tokens_per_s": (generated["action"] + generated["summary"]) / elapsed,
            "prompt_tokens_reused": self._reused_tokens / max(self._prompt_tokens, 1),
        }
        return batch

