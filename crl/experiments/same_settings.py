"""Same settings or nothing: which run directories a sweep may reuse (the half of
:class:`crl.experiments.sweep.Sweep` that compares a run's saved ``config.yaml`` with the config the sweep would launch
now, and refuses, or with ``force`` moves aside, every run saved with other settings before anything trains).

Keys that only say where things are written (:data:`crl.experiments.run_files.LOCATION_KEYS`) are left out; a key the
saved config lacks counts as its default (:func:`crl.run_dir.config_diff`), so a config written before a key existed
still matches when the key is at its default.
"""
from __future__ import annotations

import time

from crl.config import Config, load_config, to_dict
from crl.experiments.run_files import LOCATION_KEYS
from crl.run_dir import config_diff

__all__ = ["SameSettings"]


class SameSettings:
    """Mixed into :class:`~crl.experiments.sweep.Sweep`: uses its ``jobs``, ``arms``, ``out``, ``force``,
    :meth:`run_dir`, :meth:`run_overrides`, :meth:`log_base`, :meth:`run_name`, :meth:`label` and :meth:`say`."""

    def config_changes(self, job) -> list[str]:
        """``["key: saved -> now", ...]``: how the config saved in the job's run directory (``config.yaml``, written by
        the trainer) differs from the one the sweep would launch, :data:`LOCATION_KEYS` aside; a key the saved config
        lacks counts as its default (:func:`crl.run_dir.config_diff`). [] when nothing was saved."""
        saved = self.run_dir(job) / "config.yaml"
        return self.recipe_changes(job, saved.read_bytes()) if saved.is_file() else []

    def recipe_changes(self, job, saved: bytes) -> list[str]:
        """``["key: saved -> now", ...]``: how a run's saved ``config.yaml`` (its bytes) differs from the config the sweep
        would launch for ``job``, :data:`LOCATION_KEYS` aside; a key the saved config lacks counts as its default
        (:func:`crl.run_dir.config_diff`). A file that does not parse is a difference too, never a silent match."""
        from omegaconf import OmegaConf

        try:
            stored = OmegaConf.to_container(OmegaConf.create(saved.decode()), resolve=True)
        except Exception as err:  # a torn or foreign file
            return [f"config.yaml unreadable ({type(err).__name__}: {err})"]
        if not isinstance(stored, dict):
            return [f"config.yaml holds a {type(stored).__name__}, not a config"]
        now = to_dict(load_config(self.arms[job[0]], self.run_overrides(job)))
        return config_diff(stored, now, ignore=LOCATION_KEYS, defaults=to_dict(Config()))

    def check_reuse(self) -> None:
        """Refuse, before anything trains, a run directory saved with other settings than the sweep would launch (its
        results would be reported under the new ones): one line naming the run and the differing keys. With
        ``force``, each such run is moved aside (``DIR/replaced/NAME.TIMESTAMP``, its timing file with it) and trains
        afresh."""
        changed = {job: diff for job in self.jobs if (diff := self.config_changes(job))}
        if not changed:
            return
        if not self.force:
            job, diff = next(iter(changed.items()))
            more = f" (and {len(changed) - 1} more run(s))" if len(changed) > 1 else ""
            raise SystemExit(f"{self.name}: {self.run_dir(job)} was run with other settings than this sweep would launch{more}; "
                             f"differing keys: {'; '.join(diff)}. Use another --out, the run's own settings, or --force to rerun it")
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for job, diff in changed.items():
            aside = self.out / "replaced" / f"{self.run_name(*job)}.{stamp}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            self.run_dir(job).rename(aside)
            timing = self.log_base(job).with_suffix(".json")
            if timing.is_file():
                timing.rename(aside / "timing.json")
            self.say(f"--force: {self.label(*job)} was run with other settings ({'; '.join(diff)}); moved to {aside}, rerunning it")
