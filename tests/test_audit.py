"""The evidence audit (crl/audit/, its command line scripts/audit.py; docs/design.md §8): a clean run passes, every
doctored run fails by name."""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _evidence_factory import ITERATION, edit_json, edit_rows, ev, make_run
import crl.audit as audit
from crl.episode import EpisodeStatus, Provenance

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "audit.py"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "clean"
    make_run(run)
    return run


@pytest.fixture
def run(clean_run, tmp_path):
    """A fresh copy of the clean run, free to doctor."""
    dst = tmp_path / "run"
    shutil.copytree(clean_run, dst)
    return dst


def do_audit(run_dir, capsys=None):
    rc = audit.main([str(run_dir)])
    out = capsys.readouterr().out if capsys is not None else ""
    rep = json.loads((Path(run_dir) / "audit.json").read_text())
    return rc, rep, out


def check(rep, name):
    return next(c for c in rep["checks"] if c["name"] == name)


def assert_fails(run_dir, name, capsys):
    rc, rep, out = do_audit(run_dir, capsys)
    assert rc != 0 and rep["verdict"] == "FAIL"
    assert name in rep["failed"], rep["failed"]
    assert "PASS" not in out
    assert "Evidence audit: FAIL" in (Path(run_dir) / "audit.md").read_text()
    return rep


# ------------------------------------------------------------------------------------------------------------


def test_cli_clean_run_passes(run):
    """The path users run: a subprocess on the clean run exits 0 and writes audit.json / audit.md."""
    # -X importtime lists every imported module on stderr: the audit must not use the trainer's estimator
    proc = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPT), str(run)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "audit: PASS" in proc.stdout
    assert "crl.modules.networks" in proc.stderr and "crl.objectives" not in proc.stderr
    rep = json.loads((run / "audit.json").read_text())
    assert rep["verdict"] == "PASS" and rep["failed"] == []
    names = [c["name"] for c in rep["checks"]]
    assert names == [
        "evidence_files", "rollout_training_agree", "trainable_set_complete", "siblings_share_reward_status",
        "execution_summary_execution_path", "summary_tokens_optimized", "non_sampled_tokens_masked",
        "n_after_rollout_length", "advantages_value_targets", "grad_norms", "checkpoint", "files_manifest",
    ]
    adv = check(rep, "advantages_value_targets")["measured"]
    assert adv["max_abs_err_advantage"] < 1e-6 and adv["max_abs_err_value_target"] < 1e-6
    assert adv["optimized_tokens"] > 0
    stats = check(rep, "trainable_set_complete")["measured"]
    assert stats["collected"]["by_status"] == {"COMPLETED": 3, "TRUNCATED": 1, "FAILED": 1}
    assert stats["collected"]["success_rate_over_completed"] == pytest.approx(2 / 3)
    assert stats["trainable"]["rollouts"] == 5 and stats["trainable"]["segments"] == 17
    files = {f["path"]: f for f in rep["files"]}
    for r in (0, 1):
        for name in ("rollout.pt", "training.pt", "grad_norms.json", "meta.json"):
            f = files[f"evidence/iter_{ITERATION:06d}/rank_{r}/{name}"]
            assert f["bytes"] > 0 and len(f["sha256"]) == 64
    for name in ("policy/model.safetensors", "policy/config.json", "critic.safetensors", "meta.json"):
        assert f"checkpoints/iter_{ITERATION:06d}/{name}" in files
    md = (run / "audit.md").read_text()
    assert "Evidence audit: PASS" in md and files[f"checkpoints/iter_{ITERATION:06d}/policy/model.safetensors"]["sha256"] in md


@pytest.mark.parametrize(
    "estimator",
    [
        dict(lambda_length="rollout", value_target="corrected"),
        dict(alpha=None, lmbda=0.9, gamma=0.97, cross_trajectory=False),
        dict(whiten=True),
        dict(boundary="bootstrap", cross_trajectory=False),
    ],
    ids=["rollout-corrected", "fixed-lambda-no-cross", "whiten", "bootstrap"],
)
def test_estimator_variants_pass(tmp_path, estimator, capsys):
    make_run(tmp_path, seed=5, estimator=estimator)
    rc, rep, out = do_audit(tmp_path, capsys)
    assert rc == 0, rep["failed"]
    assert check(rep, "advantages_value_targets")["measured"]["max_abs_err_advantage"] < 1e-5


def test_every_iteration_is_audited(tmp_path, capsys):
    make_run(tmp_path, seed=1)
    make_run(tmp_path, seed=2, iteration=ITERATION + 1, rid_offset=100, estimator=dict(whiten=True))
    rc, rep, _ = do_audit(tmp_path, capsys)
    assert rc == 0, rep["failed"]
    assert check(rep, "evidence_files")["measured"]["iterations"] == [ITERATION, ITERATION + 1]
    assert check(rep, "trainable_set_complete")["measured"]["collected"]["rollouts"] == 10

    def bump(td):
        s, t = _first_opt(td)
        td["advantage"][s, t] += 1e-3
        return td

    edit_rows(tmp_path, 1, "training.pt", bump, iteration=ITERATION + 1)
    assert_fails(tmp_path, "advantages_value_targets", capsys)


def test_rollout_id_reused_across_iterations_fails(tmp_path, capsys):
    make_run(tmp_path, seed=1)
    make_run(tmp_path, seed=2, iteration=ITERATION + 1)
    assert_fails(tmp_path, "siblings_share_reward_status", capsys)


def test_whiten_needs_every_rank(tmp_path, capsys):
    """Whitening is over all ranks: recomputing it per rank would not match, so a mislabelled meta fails."""
    make_run(tmp_path, seed=5, estimator=dict(whiten=True))
    for r in (0, 1):
        edit_json(ev(tmp_path, r) / "meta.json", lambda m: dict(m, estimator=dict(m["estimator"], whiten=False)))
    assert_fails(tmp_path, "advantages_value_targets", capsys)


def _first_opt(td, prov=None):
    """(row, token) of the first optimized token (or the first token of provenance ``prov``)."""
    sel = td["loss_mask"] if prov is None else td["provenance"] == int(prov)
    s, t = (int(x) for x in sel.nonzero()[0])
    return s, t


def test_flipped_mask_bit_on_observation_fails(run, capsys):
    def flip(td):
        s, t = _first_opt(td, Provenance.OBSERVATION)
        td["loss_mask"][s, t] = True
        return td

    edit_rows(run, 1, ["rollout.pt", "training.pt"], flip)
    rep = assert_fails(run, "non_sampled_tokens_masked", capsys)
    assert check(rep, "non_sampled_tokens_masked")["measured"]["loss_mask_bits_on_non_sampled"]["OBSERVATION"] == 2


def test_mask_flip_in_training_only_is_caught(run, capsys):
    def flip(td):
        s, t = _first_opt(td, Provenance.COPIED_SUMMARY)
        td["loss_mask"][s, t] = True
        return td

    edit_rows(run, 0, "training.pt", flip)
    rep = assert_fails(run, "non_sampled_tokens_masked", capsys)
    assert "rollout_training_agree" in rep["failed"]


@pytest.mark.parametrize("delta,fails", [(1e-3, True), (2e-5, False)])
def test_changed_advantage(run, capsys, delta, fails):
    def bump(td):
        s, t = _first_opt(td)
        td["advantage"][s, t] += delta
        return td

    edit_rows(run, 1, "training.pt", bump)
    rc, rep, out = do_audit(run, capsys)
    err = check(rep, "advantages_value_targets")["measured"]["max_abs_err_advantage"]
    assert err == pytest.approx(delta, rel=0.05)
    if fails:
        assert rc != 0 and rep["failed"] == ["advantages_value_targets"] and "PASS" not in out
    else:
        assert rc == 0 and rep["verdict"] == "PASS"


def test_nonzero_value_target_off_mask_fails(run, capsys):
    def bump(td):
        s, t = _first_opt(td, Provenance.OBSERVATION)
        td["value_target"][s, t] = 0.5
        return td

    edit_rows(run, 0, "training.pt", bump)
    rep = assert_fails(run, "advantages_value_targets", capsys)
    assert check(rep, "advantages_value_targets")["measured"]["nonzero_off_mask"] == 1


def test_nan_advantage_fails(run, capsys):
    def nan(td):
        s, t = _first_opt(td)
        td["advantage"][s, t] = float("nan")
        return td

    edit_rows(run, 0, "training.pt", nan)
    assert_fails(run, "advantages_value_targets", capsys)


def test_missing_checkpoint_fails(run, capsys):
    shutil.rmtree(run / "checkpoints")
    rep = assert_fails(run, "checkpoint", capsys)
    assert "files_manifest" in rep["failed"]


def test_stale_checkpoint_fails(run, capsys):
    """A checkpoint older than the evidence is not post-update."""
    old = run / "checkpoints" / f"iter_{ITERATION - 1:06d}"
    (run / "checkpoints" / f"iter_{ITERATION:06d}").rename(old)
    edit_json(old / "meta.json", lambda m: dict(m, iteration=ITERATION - 1))
    for r in (0, 1):
        edit_json(ev(run, r) / "meta.json", lambda m: dict(m, checkpoint=f"checkpoints/{old.name}"))
    assert_fails(run, "checkpoint", capsys)


@pytest.mark.parametrize("file, key", [("critic.safetensors", "value_head.bias"), ("policy/model.safetensors", "model.norm.weight")])
def test_checkpoint_that_does_not_load_fails(run, capsys, file, key):
    from safetensors.torch import load_file, save_file

    path = run / "checkpoints" / f"iter_{ITERATION:06d}" / file
    sd = load_file(str(path))
    sd.pop(key)
    save_file(sd, str(path))
    assert_fails(run, "checkpoint", capsys)


def test_non_finite_parameter_fails(run, capsys):
    from safetensors.torch import load_file, save_file

    path = run / "checkpoints" / f"iter_{ITERATION:06d}" / "policy" / "model.safetensors"
    sd = load_file(str(path))
    next(v for k, v in sd.items() if v.is_floating_point())[0] = float("inf")
    save_file(sd, str(path))
    assert_fails(run, "checkpoint", capsys)


def _drop_failed(td):
    return td[td["status"] != int(EpisodeStatus.FAILED)]


def test_failed_episodes_drop_rule(run, capsys):
    """meta failed_episodes=drop: the evidence's FAILED rollout must not be in training.pt (it is, in the factory's
    run, which trained every episode); once its rows are removed from training.pt the audit passes."""
    for r in (0, 1):
        edit_json(ev(run, r) / "meta.json", lambda m: dict(m, failed_episodes="drop"))
    rep = assert_fails(run, "trainable_set_complete", capsys)
    assert "failed_episodes=drop" in check(rep, "trainable_set_complete")["detail"]
    for r in (0, 1):
        edit_rows(run, r, "training.pt", _drop_failed)
    rc, rep, out = do_audit(run, capsys)
    assert rc == 0 and "audit: PASS" in out, out
    assert check(rep, "trainable_set_complete")["measured"]["dropped_failed_rollouts"] == 1


def test_failed_episodes_train_rule_needs_the_failed_rollout(run, capsys):
    """With failed_episodes=train (the default of evidence that does not say), a FAILED rollout left out fails."""
    for r in (0, 1):
        edit_rows(run, r, "training.pt", _drop_failed)
    assert_fails(run, "trainable_set_complete", capsys)


def test_update_skipped_iteration_must_train_nothing(run, capsys):
    """meta update_skipped: true is only consistent with an iteration whose every rollout FAILED and nothing trained."""
    for r in (0, 1):
        edit_json(ev(run, r) / "meta.json", lambda m: dict(m, update_skipped=True))
    rep = assert_fails(run, "trainable_set_complete", capsys)
    assert "update_skipped" in check(rep, "trainable_set_complete")["detail"]
    assert "grad_norms" in rep["failed"]


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_grad_norm_fails(run, capsys, value):
    edit_json(ev(run, 1) / "grad_norms.json", lambda g: dict(g, critic=[1.0, value]))
    rep = assert_fails(run, "grad_norms", capsys)
    assert rep["failed"] == ["grad_norms"]


def test_zero_grad_norms_pass_alone_but_not_for_the_whole_run(run, capsys):
    """A zero-advantage minibatch has gradient exactly 0 (legitimate); a run whose every actor norm is 0 never learned."""
    edit_json(ev(run, 1) / "grad_norms.json", lambda g: dict(g, critic=[1.0, 0.0]))
    rc, rep, _ = do_audit(run, capsys)
    assert rc == 0 and rep["verdict"] == "PASS"
    for it in (0, 1):
        edit_json(ev(run, it) / "grad_norms.json", lambda g: dict(g, actor=[0.0] * len(g["actor"])))
    assert_fails(run, "grad_norms", capsys)


def test_empty_actor_grad_norms_fail(run, capsys):
    edit_json(ev(run, 0) / "grad_norms.json", lambda g: dict(g, actor=[]))
    assert_fails(run, "grad_norms", capsys)


def test_siblings_disagree_on_reward_fails(run, capsys):
    """Rollout 101 is split across ranks: its rank-1 segments claim reward 1."""

    def reward(td):
        td["reward"][td["rollout_id"] == 101] = 1.0
        return td

    edit_rows(run, 1, ["rollout.pt", "training.pt"], reward)
    assert_fails(run, "siblings_share_reward_status", capsys)


def test_siblings_disagree_on_status_fails(run, capsys):
    def status(td):
        td["status"][(td["rollout_id"] == 102) & (td["segment_index"] == 4)] = int(EpisodeStatus.COMPLETED)
        return td

    edit_rows(run, 1, ["rollout.pt", "training.pt"], status)
    assert_fails(run, "siblings_share_reward_status", capsys)


@pytest.mark.parametrize("rid,status", [(102, "TRUNCATED"), (103, "FAILED")])
def test_unfinished_episode_left_out_of_training_fails(run, capsys, rid, status):
    edit_rows(run, 1, "training.pt", lambda td: td[td["rollout_id"] != rid])
    rep = assert_fails(run, "trainable_set_complete", capsys)
    assert f"rollout {rid} ({status})" in check(rep, "trainable_set_complete")["detail"]


def test_one_segment_left_out_fails(run, capsys):
    edit_rows(run, 1, "training.pt", lambda td: td[~((td["rollout_id"] == 102) & (td["segment_index"] == 3))])
    assert_fails(run, "trainable_set_complete", capsys)


def test_stale_n_after_fails(run, capsys):
    def stale(td):
        td["n_after"][(td["rollout_id"] == 100) & (td["segment_index"] == 0)] += 1
        return td

    edit_rows(run, 0, ["rollout.pt", "training.pt"], stale)
    assert_fails(run, "n_after_rollout_length", capsys)


def test_log_prob_disagreement_fails(run, capsys):
    def logp(td):
        s, t = _first_opt(td)
        td["sample_log_prob"][s, t] -= 0.1
        return td

    edit_rows(run, 1, "training.pt", logp)
    rep = assert_fails(run, "rollout_training_agree", capsys)
    assert rep["failed"] == ["rollout_training_agree"]


def test_no_summary_path_fails(run, capsys):
    """Without any compaction in the run there is no execution→summary→execution path (and no summary token)."""
    for r in (0, 1):
        edit_rows(run, r, ["rollout.pt", "training.pt"], lambda td: td[td["rollout_id"] == 104] if r == 1 else td[:0])
    rep = assert_fails(run, "execution_summary_execution_path", capsys)
    assert "summary_tokens_optimized" in rep["failed"]


@pytest.mark.parametrize("name", ["grad_norms.json", "training.pt", "rollout.pt", "meta.json"])
def test_missing_evidence_file_fails(run, capsys, name):
    (ev(run, 1) / name).unlink()
    rep = assert_fails(run, "evidence_files", capsys)
    assert "files_manifest" in rep["failed"]


def test_missing_rank_fails(run, capsys):
    shutil.rmtree(ev(run, 1))
    assert_fails(run, "evidence_files", capsys)


def test_missing_evidence_dir_fails_every_data_check(run, capsys):
    shutil.rmtree(run / "evidence")
    rep = assert_fails(run, "evidence_files", capsys)
    assert all(c["status"] == "FAIL" for c in rep["checks"])


def test_looser_tolerance_is_refused(run):
    with pytest.raises(SystemExit):
        audit.main([str(run), "--tolerance", "1e-3"])


def test_not_a_directory(tmp_path, capsys):
    assert audit.main([str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert "PASS" not in captured.out + captured.err


def test_independent_gae_matches_eq15():
    """V ≡ 0 and one shared λ: Â_i = R (γλ)^(N_>s + n_s - 1 - i) (docs/design.md §4, Eq. 15)."""
    gamma, lam, R, n, n_after = 0.99, 0.95, 2.0, 5, 7
    _, A_hat = audit.segment_gae([0.0] * n, R, n_after, lam, gamma, True)
    want = [R * (gamma * lam) ** (n_after + n - 1 - i) for i in range(n)]
    np.testing.assert_allclose(A_hat, want, rtol=1e-12)
    assert audit.segment_lambda(dict(lmbda=None, alpha=1.5, lambda_length="segment"), 4, 10) == pytest.approx(1 - 1 / 6)
    assert audit.segment_lambda(dict(lmbda=None, alpha=1.5, lambda_length="rollout"), 4, 10) == pytest.approx(1 - 1 / 15)
    assert audit.segment_lambda(dict(lmbda=None, alpha=1.5, lambda_length="segment"), 0, 10) == 0.0


# What the audit must not import, directly or through another crl module: the estimator, the loss, the learner and
# the trainer that uses them (it recomputes what it checks with its own plain loops).
NOT_IMPORTED_BY_THE_AUDIT = ("crl.objectives", "crl.learner", "crl.training", "crl.trainer")


def crl_sources() -> dict[str, str]:
    """Every crl module's source by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in (ROOT / "crl").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def crl_imports(start: str, sources: dict[str, str]) -> dict[str, str | None]:
    """Every crl module that importing ``start`` can execute, each with the module that imports it (``start``: None):
    its imports at any depth, lazy ones (inside functions) included, and the parent packages of each (importing
    ``crl.a.b`` runs the ``__init__.py`` of ``crl.a``); ``from crl.a import b`` counts ``crl.a.b`` when that is a module."""

    def imported(name: str):
        for node in ast.walk(ast.parse(sources[name], name)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    package = name.split(".")[: len(name.split(".")) - node.level + (name in packages)]
                    base = ".".join(package + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                yield from (m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in sources)

    packages = {n for n in sources if any(m.startswith(n + ".") for m in sources)}
    seen, todo = {start: None}, [start]
    while todo:
        name = todo.pop()
        for target in imported(name):
            if target not in seen:
                seen[target] = name
                todo.append(target)
    return seen


def forbidden_imports(reached: dict[str, str | None]) -> list[str]:
    """The reached modules the audit must not import, each as its import chain (``crl.audit -> ... -> module``)."""
    def chain(m):
        return chain(reached[m]) + [m] if reached[m] is not None else [m]

    return [" -> ".join(chain(m)) for m in sorted(reached) if any(m == f or m.startswith(f + ".") for f in NOT_IMPORTED_BY_THE_AUDIT)]


def audit_modules(sources: dict[str, str]) -> list[str]:
    """The modules of the audit: the package crl.audit and every module in it."""
    return sorted(m for m in sources if m == "crl.audit" or m.startswith("crl.audit."))


def test_the_audit_imports_nothing_of_the_estimator_loss_or_learner():
    """Every module of crl.audit, its imports followed through every crl module they reach (lazy imports included),
    never reaches crl.objectives, crl.learner, crl.training or crl.trainer; and importing crl.audit runs every one of
    them. Complements test_cli_clean_run_passes, which sees only the modules one clean run happens to import."""
    sources = crl_sources()
    modules = audit_modules(sources)
    assert {"crl.audit.evidence", "crl.audit.estimator", "crl.audit.grad_norms", "crl.audit.checkpoints",
            "crl.audit.report"} <= set(modules)
    reached = crl_imports("crl.audit", sources)
    assert set(modules) - {"crl.audit.__main__"} <= set(reached), "a module of the audit that crl.audit does not import"
    assert "crl.modules.networks" in reached  # the graph sees the lazy import of the checkpoint check (ValueModel)
    for module in modules:
        found = forbidden_imports(crl_imports(module, sources))
        assert not found, f"{module} imports the trainer's estimator/loss/learner:\n" + "\n".join(found)


@pytest.mark.parametrize("module", ["crl.audit", "crl.audit.estimator", "crl.audit.checkpoints"])
@pytest.mark.parametrize("added, through", [
    ("from crl.objectives.ppo import CompactionPPOLoss", None),  # direct
    ("from crl.evaluation import evaluate_policy", "crl.evaluation"),  # transitive: crl.evaluation reaches crl.objectives
])
def test_the_import_check_fails_when_the_audit_imports_the_estimator(module, added, through):
    """The check above, on one audit module's source with one lazy import added: it names the chain to the estimator,
    from crl.audit through that module."""
    sources = crl_sources()
    sources[module] += f"\n\ndef _doctored():\n    {added}\n"
    found = forbidden_imports(crl_imports("crl.audit", sources))
    via = "crl.audit" if module == "crl.audit" else f"crl.audit -> {module}"
    assert found and all(f.startswith(f"{via} -> ") for f in found), found
    assert through is None or any(f.startswith(f"{via} -> {through} -> ") for f in found), found


# ------------------------------------------------------------------------------------------------------------
# Critic warm-up iterations and the frozen-summary arm
# ------------------------------------------------------------------------------------------------------------


def _warmup(run, ranks=(0, 1), actor=()):
    for r in ranks:
        edit_json(ev(run, r) / "meta.json", lambda m: dict(m, critic_warmup=True))
        edit_json(ev(run, r) / "grad_norms.json", lambda g: dict(g, actor=list(actor)))


def test_critic_warmup_iteration_without_actor_grads_passes(tmp_path, capsys):
    """Evidence on a warm-up iteration (critic only) next to a normal iteration: PASS."""
    make_run(tmp_path, seed=1)
    make_run(tmp_path, seed=2, iteration=ITERATION + 1, rid_offset=100)
    _warmup(tmp_path)  # iteration ITERATION is a warm-up iteration
    rc, rep, _ = do_audit(tmp_path, capsys)
    assert rc == 0, rep["failed"]
    assert check(rep, "evidence_files")["measured"]["critic_warmup_iterations"] == [ITERATION]
    assert check(rep, "grad_norms")["measured"]["entries"]["actor"] == 4  # the normal iteration's


def test_non_warmup_iteration_without_actor_grads_still_fails(tmp_path, capsys):
    make_run(tmp_path, seed=1)
    make_run(tmp_path, seed=2, iteration=ITERATION + 1, rid_offset=100)
    _warmup(tmp_path)
    edit_json(ev(tmp_path, 1, ITERATION + 1) / "grad_norms.json", lambda g: dict(g, actor=[]))
    rep = assert_fails(tmp_path, "grad_norms", capsys)
    assert rep["failed"] == ["grad_norms"]
    assert "critic_warmup" in check(rep, "grad_norms")["detail"]


def test_critic_warmup_false_is_not_a_pass(run, capsys):
    for r in (0, 1):
        edit_json(ev(run, r) / "meta.json", lambda m: dict(m, critic_warmup=False))
    edit_json(ev(run, 0) / "grad_norms.json", lambda g: dict(g, actor=[]))
    assert_fails(run, "grad_norms", capsys)


def test_warmup_with_actor_grads_is_inconsistent(run, capsys):
    _warmup(run, actor=[0.5])
    rep = assert_fails(run, "grad_norms", capsys)
    assert "critic_warmup but 1 actor gradient norms" in check(rep, "grad_norms")["detail"]


def test_only_warmup_evidence_fails_no_actor_norm_in_run(run, capsys):
    _warmup(run)
    rep = assert_fails(run, "grad_norms", capsys)
    assert "no actor gradient norm in the whole run" in check(rep, "grad_norms")["detail"]


@pytest.mark.parametrize("flag", ["critic_warmup", "frozen_summary"])
def test_non_bool_meta_flags_fail(run, capsys, flag):
    edit_json(ev(run, 0) / "meta.json", lambda m: dict(m, **{flag: "yes"}))
    assert_fails(run, "evidence_files", capsys)


@pytest.fixture(scope="module")
def frozen_clean(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "frozen"
    make_run(run, frozen_summary=True)
    return run


@pytest.fixture
def frozen(frozen_clean, tmp_path):
    dst = tmp_path / "frozen"
    shutil.copytree(frozen_clean, dst)
    return dst


def test_frozen_summary_run_passes_with_its_own_rule(frozen, capsys):
    rc, rep, _ = do_audit(frozen, capsys)
    assert rc == 0, [(c["name"], c["detail"]) for c in rep["checks"] if c["status"] == "FAIL"]
    names = [c["name"] for c in rep["checks"]]
    # the rule replaces "summary tokens are optimized" in the same place: never a silent skip
    assert "summary_tokens_optimized" not in names
    assert names[5] == "frozen_summary_not_trained"
    fz = check(rep, "frozen_summary_not_trained")
    assert fz["measured"]["frozen_summary_tokens"] > 0 and "loss_mask 0" in fz["detail"]
    assert "FROZEN_SUMMARY" in check(rep, "execution_summary_execution_path")["detail"]
    assert check(rep, "evidence_files")["measured"]["frozen_summary"] is True


def test_frozen_tokens_without_the_meta_flag_fail_with_a_hint(frozen, capsys):
    for r in (0, 1):
        edit_json(ev(frozen, r) / "meta.json", lambda m: {k: v for k, v in m.items() if k != "frozen_summary"})
    rep = assert_fails(frozen, "summary_tokens_optimized", capsys)
    assert "frozen_summary: true" in check(rep, "summary_tokens_optimized")["detail"]


def test_frozen_summary_with_mask_bit_fails(frozen, capsys):
    def flip(td):
        s, t = [int(x) for x in (td["provenance"] == int(Provenance.FROZEN_SUMMARY)).nonzero()[0]]
        td["loss_mask"][s, t] = True
        return td

    edit_rows(frozen, 0, ["rollout.pt", "training.pt"], flip)
    rep = assert_fails(frozen, "frozen_summary_not_trained", capsys)
    assert "loss_mask 1 on FROZEN_SUMMARY" in check(rep, "frozen_summary_not_trained")["detail"]


def test_frozen_run_with_trainable_summary_fails(frozen, capsys):
    """A frozen arm whose summaries are (partly) trainable SUMMARY tokens is contaminated."""
    def unfreeze(td):
        s, t = [int(x) for x in (td["provenance"] == int(Provenance.FROZEN_SUMMARY)).nonzero()[0]]
        td["provenance"][s, t] = int(Provenance.SUMMARY)
        td["loss_mask"][s, t] = True
        return td

    edit_rows(frozen, 0, ["rollout.pt", "training.pt"], unfreeze)
    rep = assert_fails(frozen, "frozen_summary_not_trained", capsys)
    assert "trainable SUMMARY tokens in a frozen-summary run" in check(rep, "frozen_summary_not_trained")["detail"]


def test_frozen_summary_with_nonzero_advantage_fails(frozen, capsys):
    def bump(td):
        s, t = [int(x) for x in (td["provenance"] == int(Provenance.FROZEN_SUMMARY)).nonzero()[0]]
        td["advantage"][s, t] = 0.3
        return td

    edit_rows(frozen, 1, "training.pt", bump)
    rep = assert_fails(frozen, "frozen_summary_not_trained", capsys)
    assert "non-zero adv on FROZEN_SUMMARY" in check(rep, "frozen_summary_not_trained")["detail"]


def test_frozen_run_without_any_summary_fails(frozen, capsys):
    for r in (0, 1):
        edit_rows(frozen, r, ["rollout.pt", "training.pt"], lambda td: td[td["rollout_id"] == 104] if r == 1 else td[:0])
    rep = assert_fails(frozen, "frozen_summary_not_trained", capsys)
    assert "no FROZEN_SUMMARY token" in check(rep, "frozen_summary_not_trained")["detail"]
    assert "execution_summary_execution_path" in rep["failed"]


def test_frozen_flag_on_some_ranks_only_fails(frozen, capsys):
    edit_json(ev(frozen, 1) / "meta.json", lambda m: dict(m, frozen_summary=False))
    rep = assert_fails(frozen, "evidence_files", capsys)
    assert "one run is one arm" in check(rep, "evidence_files")["detail"]
