"""Controlled experiments of DESIGN.md §7 that run on a CPU (policies, drivers, gates).

* :mod:`crl.experiments.memory_chain` — the 96-step memory chain with a compact learnable policy trained through
  the episode contract, :class:`~crl.objectives.CrossTrajectoryGAE` and :class:`~crl.objectives.CompactionPPOLoss`.
"""
