"""Controlled experiments of docs/design.md §7 that run on a CPU (policies, backends, gates; episodes are played by
:class:`crl.collectors.CompactionCollector`), and the multi-seed studies built on ordinary training runs.

* :mod:`crl.experiments.tabular_chain` — the 96-step memory chain (:mod:`crl.envs.memory_chain`) with a compact
  tabular policy (:mod:`~crl.experiments.tabular_policy`; its arms and stages: :mod:`~crl.experiments.tabular_arms`)
  trained through the episode contract, :class:`~crl.objectives.CrossTrajectoryGAE` and
  :class:`~crl.objectives.CompactionPPOLoss`; run by ``scripts/tabular_chain.py``, reported in docs/tabular_chain.md.
* :mod:`crl.experiments.sweep` — the multi-seed runner: every (config, seed, CPU kernel) an ordinary training run,
  audited, reported (:mod:`~crl.experiments.sweep_report`) with rliable's statistics (:mod:`~crl.experiments.stats`),
  reusing only runs saved with the settings it would launch (:mod:`~crl.experiments.same_settings`);
  what it reads from a run directory: :mod:`~crl.experiments.run_files`; the float paths: :mod:`~crl.experiments.kernels`.
  Run by ``scripts/sweep.py`` and ``scripts/lm_study.py``.
* :mod:`crl.experiments.lm_study` — the LM studies on top of the sweep: arms x seeds, a warm start shared per seed, the
  preregistered gates (:mod:`~crl.experiments.gates`; the keep rule in exact fractions: :mod:`~crl.experiments.keep_rule`),
  each finished run exported for committing and carried back only as committed (:mod:`~crl.experiments.exports`), the
  report PNGs (:mod:`~crl.experiments.plots`); run by ``scripts/lm_study.py``.
* :mod:`crl.experiments.summary_content` — what a run's summaries hold, decoded from its evidence; run by
  ``scripts/summary_content.py``.
* :mod:`crl.experiments.records_shortcuts` — the exact price of every shortcut on a sequential-records task.
* :mod:`crl.experiments.zero_shot` — what a pretrained model does with a task before any training.
"""
