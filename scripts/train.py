"""CompactionRL training: collect compacted episodes, estimate cross-trajectory advantages, token-summed PPO.

    python scripts/train.py [--config configs/default.yaml] [key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_zero2.yaml scripts/train.py [key=value ...]

The loop lives in :class:`crl.trainer.Trainer` (importable by other projects); this script parses arguments,
loads and validates the config (crl/config.py documents every key) and calls ``Trainer(cfg).fit()``.
Writes RUN_DIR/{config.yaml, metrics.jsonl, curves.png, checkpoints/, evidence/} (see crl/evidence.py).
"""
from __future__ import annotations

import argparse
import os
import re
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
        if lost_process_group(err):  # another machine died, hung or left the network: where to resume, not a traceback
            _user_error(args, resume_advice(cfg.run_dir, err))
        if engine_died(err):  # this rank's vLLM engine process died: the others then lose the group (the line above)
            _user_error(args, resume_advice(cfg.run_dir, err, what="its vLLM engine died", why="the engine process was killed or crashed "
                                            "(out of memory? its log is above)"))
        if not isinstance(err, (RunDirError, OSError)):
            raise  # a bug, not a user error: the traceback is the report
        _user_error(args, f"error: {err}")


#: what gloo and NCCL say when a peer of a collective died (its sockets closed) or did not answer within the process
#: group's timeout (train.dist_timeout_s); gloo raises plain RuntimeErrors, NCCL torch.distributed.DistError's
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe", "NCCL communicator was aborted")


def lost_process_group(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a collective that lost another process of the group."""
    import torch.distributed as dist

    while err is not None:
        if isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(s in str(err) for s in LOST_PEER)):
            return True
        err = err.__cause__ or err.__context__
    return False


def engine_died(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is vLLM's ``EngineDeadError`` (matched by name: vLLM is optional)."""
    while err is not None:
        if type(err).__name__ == "EngineDeadError":
            return True
        err = err.__cause__ or err.__context__
    return False


def resume_advice(run_dir, err: BaseException, what: str = "lost the process group",
                  why: str = "a process on another machine died, hung past train.dist_timeout_s or became unreachable") -> str:
    """One line: which rank failed (``what``, ``why``) and the checkpoint the restart or a relaunch continues from."""
    from crl.run_dir import newest_intact_checkpoint

    checkpoint = newest_intact_checkpoint(run_dir, report=lambda _: None)
    restarts, done = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if checkpoint is None:
        where = f"{run_dir} has no intact checkpoint yet: a restart or relaunch starts afresh"
    elif done < restarts:
        where = (f"the newest intact checkpoint is {checkpoint}: torchrun restarts the group (restart {done + 1} of {restarts}), which "
                 "resumes from it")
    else:
        where = (f"the newest intact checkpoint is {checkpoint}: relaunch the same command on every machine to resume from it "
                 "(checkpoint.resume=auto), or launch with torchrun --max-restarts to restart by itself")
    # gloo's source location
    cause = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().splitlines()[0]) if str(err).strip() else type(err).__name__
    cause = cause if len(cause) <= 160 else cause[:160] + "..."
    return (f"error: rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')} {what} ({cause}): {why}; {where} "
            "(docs/cluster.md)")


def _user_error(args, message: str) -> None:
    """One line naming the key, file or path and the fix; the traceback only with --debug."""
    if args.debug:
        raise
    sys.exit(message)


if __name__ == "__main__":
    main()
