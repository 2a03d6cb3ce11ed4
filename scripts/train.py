"""CompactionRL training: collect compacted episodes, estimate cross-trajectory advantages, token-summed PPO.

    python scripts/train.py [--config configs/default.yaml] [key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_zero2.yaml scripts/train.py [key=value ...]

The loop lives in :class:`crl.trainer.Trainer` (importable by other projects); this script parses arguments,
loads and validates the config (crl/config.py documents every key) and calls ``Trainer(cfg).fit()``.
Writes RUN_DIR/{config.yaml, metrics.jsonl, curves.png, checkpoints/, evidence/} (see crl/evidence.py).
"""
from __future__ import annotations

import argparse
import sys

from crl.config import ConfigValidationError, load_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config (see crl/config.py)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.iterations=5 algo.lambda_length=segment")
    parser.add_argument("--debug", action="store_true", help="show the traceback of user errors (bad config, busy run_dir, disk full)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from crl.trainer import Trainer  # after the config: a bad config fails fast, before torch is imported

        Trainer(cfg).fit()
    except ConfigValidationError as err:
        _user_error(args, f"config error: {err}")
    except Exception as err:
        from crl.run_dir import RunDirError
        from crl.warm_start import WarmStartError

        if isinstance(err, WarmStartError):  # ends the run before any RL iteration: one line, the probe and what to change
            _user_error(args, f"warm start failed: {err}")
        if not isinstance(err, (RunDirError, OSError)):
            raise  # a bug, not a user error: the traceback is the report
        _user_error(args, f"error: {err}")


def _user_error(args, message: str) -> None:
    """One line naming the key, file or path and the fix; the traceback only with --debug."""
    if args.debug:
        raise
    sys.exit(message)


if __name__ == "__main__":
    main()
