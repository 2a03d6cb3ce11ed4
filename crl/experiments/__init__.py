"""Controlled experiments of docs/design.md §7 that run on a CPU (policies, backends, gates; episodes are played by
:class:`crl.collectors.CompactionCollector`).

* :mod:`crl.experiments.tabular_chain` — the 96-step memory chain (:mod:`crl.envs.memory_chain`) with a compact
  tabular policy trained through the episode contract, :class:`~crl.objectives.CrossTrajectoryGAE` and
  :class:`~crl.objectives.CompactionPPOLoss`; run by ``scripts/tabular_chain.py``, reported in docs/tabular_chain.md.
* :mod:`crl.experiments.sweep` — the multi-seed runner: every (config, seed, CPU kernel) an ordinary training run,
  audited, reported with rliable's statistics; run by ``scripts/sweep.py`` and ``scripts/lm_study.py``.
* :mod:`crl.experiments.lm_study` — the LM studies on top of the sweep: arms x seeds, a warm start shared per seed,
  the preregistered gates (the keep rule in exact fractions), each finished run exported for committing; run by
  ``scripts/lm_study.py``.
* :mod:`crl.experiments.summary_content` — what a run's summaries hold, decoded from its evidence; run by
  ``scripts/summary_content.py``.
* :mod:`crl.experiments.records_shortcuts` — the exact price of every shortcut on a sequential-records task.
"""
