"""Independent evidence audit of a crl training run (docs/design.md §8).

Usage (``scripts/audit.py`` is a thin command line over :func:`main`)::

    python scripts/audit.py RUN_DIR [--tolerance 5e-5]

Independent of the trainer: no module of this package imports anything of crl's estimator, loss or learner
(``crl.objectives``, ``crl.learner``, ``crl.training``, ``crl.trainer``), directly or through another crl module; it
recomputes what it checks with its own plain loops (tests/test_audit.py checks the import graph of every module here).
Reads only what the run saved under ``RUN_DIR``, runs every check below, writes ``RUN_DIR/audit.json`` and
``RUN_DIR/audit.md`` (each check, its measured value, PASS/FAIL, and sizes + SHA-256 of the evidence), prints one
line per check and exits 0 only when every check passes. Exit 1: some check failed or evidence is missing;
exit 2: ``RUN_DIR`` is not a directory. The word PASS is printed only for an all-pass verdict.

Layout assumed (written by the trainer; the evidence part is ``crl/evidence.py``)::

    RUN_DIR/
      evidence/iter_NNNNNN/rank_R/        one per iteration and data-parallel rank (at least one required)
        rollout.pt                        the collected rows, crl.episode.save_episodes format
        training.pt                       the rows as trained: + state_value, advantage, value_target [S, T]
                                          (+ optional kl_penalty [S, T], the per-token reward term, if used)
        grad_norms.json                   {"actor": [float, ...], "critic": [float, ...]} per optimizer step
        meta.json                         {"estimator": {"gamma", "alpha", "lmbda", "lambda_length",
                                           "cross_trajectory", "value_target", "boundary", "whiten"},
                                           "iteration": N, "rank": R, "world_size": W,
                                           "checkpoint": "checkpoints/iter_MMMMMM"}   (relative to RUN_DIR)
                                          "critic_warmup": bool (optional, default false): a critic-only
                                          warm-up iteration; its actor list must then be empty
                                          "frozen_summary": bool (optional, default false): the run is the
                                          frozen-summary ablation (equal in every meta of the run)
                                          "failed_episodes": "drop" | "train" (optional, default "train"): what
                                          the learner does with FAILED episodes (equal in every meta of the run)
                                          "update_skipped": bool (optional, default false): every episode of the
                                          iteration failed and nothing was trained
      checkpoints/iter_MMMMMM/            post-update checkpoint, M >= N (crl/training/checkpoints.py)
        policy/                           a transformers checkpoint directory of the policy (config.json,
                                          model.safetensors, tokenizer): AutoModelForCausalLM.from_pretrained
        critic.safetensors                state dict of crl.modules.networks.ValueModel: backbone.* (the
                                          AutoModel.from_config(policy config) backbone) + value_head.weight/bias
                                          (only value_head.* when the critic shares the policy's backbone)
        meta.json                         {"iteration": M, ...}

Rows are matched across files by ``(rollout_id, segment_index)``; the rows of one iteration are the union over
its ranks (segments of one rollout may sit on different ranks). The checks, in the order they run (names as in
audit.json), one module per part of what they check (each module's docstring says what its checks require):

* :mod:`crl.audit.evidence`: ``evidence_files`` — the files exist, load and agree on the settings (what it loads:
  :class:`~crl.audit.evidence.Evidence`, its rows :class:`~crl.audit.rows.Row`);
* :mod:`crl.audit.rollouts`: ``rollout_training_agree``, ``trainable_set_complete``, ``siblings_share_reward_status``
  — the rollouts across the files;
* :mod:`crl.audit.tokens`: ``execution_summary_execution_path``, ``summary_tokens_optimized`` (in a frozen-summary
  run ``frozen_summary_not_trained``), ``non_sampled_tokens_masked`` — which tokens are trained;
* :mod:`crl.audit.rollouts`: ``n_after_rollout_length``;
* :mod:`crl.audit.estimator`: ``advantages_value_targets`` — the estimator recomputed by plain loops;
* :mod:`crl.audit.grad_norms`: ``grad_norms``;
* :mod:`crl.audit.checkpoints`: ``checkpoint`` — the checkpoints the evidence points to load, strictly and finite;
* :mod:`crl.audit.report`: ``files_manifest`` — size and SHA-256 of every file read; the driver and the report.
"""
from crl.audit.checkpoints import CHECKPOINT_FILES, load_checkpoint
from crl.audit.estimator import TOLERANCE, WHITEN_EPS, segment_gae, segment_lambda
from crl.audit.evidence import ESTIMATOR_KEYS, EVIDENCE_FILES, GROUP_ESTIMATOR_KEYS, ITER_RE, RANK_RE, Evidence, first
from crl.audit.report import Audit, Check, jsonable, main
from crl.audit.rows import ROW_KEYS, TRAIN_KEYS, Row, load_rows, same_array
from crl.audit.tokens import MUST_BE_MASKED, OPTIMIZED

__all__ = ["main", "Audit", "Check", "Evidence", "Row", "load_rows", "load_checkpoint", "segment_gae", "segment_lambda", "jsonable",
           "first", "same_array", "TOLERANCE", "WHITEN_EPS", "EVIDENCE_FILES", "CHECKPOINT_FILES", "ESTIMATOR_KEYS",
           "GROUP_ESTIMATOR_KEYS", "ROW_KEYS", "TRAIN_KEYS", "OPTIMIZED", "MUST_BE_MASKED", "ITER_RE", "RANK_RE"]
