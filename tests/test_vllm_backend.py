"""VLLMBackend against a fake ``vllm`` module (vLLM itself cannot be installed on the CPU machines).

Checks what does not need a GPU: the engine is built with processed log-probs and crl's worker extension;
per-request seeds never repeat across calls (or after a checkpoint round trip); weights are pushed through
``collective_rpc`` by method name and vLLM's prefix cache is reset; the worker extension loads them."""
import sys
import types

import pytest
import torch

from crl.modules.generation import SamplingParams, VLLMBackend, make_backend
from crl.modules.vllm_worker import CrlWorkerExtension


class FakeLLM:
    def __init__(self, model, seed, **kwargs):
        self.model, self.seed, self.kwargs = model, seed, kwargs
        self.requests, self.rpcs, self.prefix_resets = [], [], 0

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.requests.append(sampling_params)
        outs = []
        for p, sp in zip(prompts, sampling_params):
            ids = [7, 2][: sp.max_tokens]
            comp = types.SimpleNamespace(token_ids=ids, logprobs=[{t: types.SimpleNamespace(logprob=-0.5)} for t in ids], finish_reason="stop" if ids[-1] == 2 else "length")
            outs.append(types.SimpleNamespace(outputs=[comp]))
        return outs

    def collective_rpc(self, method, args=(), kwargs=None):
        self.rpcs.append((method, args))
        return [None]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    mod.inputs = types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: list(prompt_token_ids))
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def test_engine_is_built_with_processed_logprobs_and_the_worker_extension(fake_vllm):
    b = make_backend("vllm", model_path="ckpt", seed=3)
    assert isinstance(b, VLLMBackend)
    assert b.llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert b.llm.kwargs["worker_extension_cls"] == "crl.modules.vllm_worker.CrlWorkerExtension"


def test_request_seeds_differ_across_calls_and_survive_a_checkpoint(fake_vllm):
    b = VLLMBackend("ckpt", seed=5)
    params = SamplingParams(temperature=0.7, stop_token_ids=(2,))
    gens = b.generate([[1, 2, 3], [1, 4]], [4, 4], params)
    assert [g.token_ids for g in gens] == [[7, 2], [7, 2]] and all(g.stopped for g in gens) and gens[0].log_probs == [-0.5, -0.5]
    b.generate([[1, 2, 3], [1, 4]], [4, 4], params)  # the same prompts again: new draws, new seeds
    seeds = [r.seed for call in b.llm.requests for r in call]
    assert len(seeds) == 4 and len(set(seeds)) == 4
    assert all(r.logprobs == 0 and r.temperature == 0.7 and r.stop_token_ids == [2] for call in b.llm.requests for r in call)
    state = b.generator.get_state()
    resumed = VLLMBackend("ckpt", seed=5)
    resumed.generator.set_state(state)
    resumed.generate([[1]], [2], params)
    assert resumed.llm.requests[0][0].seed not in seeds
    other = VLLMBackend("ckpt", seed=6)  # another rank / seed: another stream
    other.generate([[1, 2, 3], [1, 4]], [4, 4], params)
    assert not {r.seed for r in other.llm.requests[0]} & set(seeds[:2])


def test_weight_push_uses_collective_rpc_by_name_and_resets_the_prefix_cache(fake_vllm):
    b = VLLMBackend("ckpt")
    w = torch.nn.Linear(2, 2)
    b.load_state_dict(w.state_dict())
    (method, args), = b.llm.rpcs
    assert method == "crl_load_weights" and [n for n, _ in args[0]] == ["weight", "bias"]
    assert all(t.device.type == "cpu" for _, t in args[0]) and b.llm.prefix_resets == 1


def test_worker_extension_loads_weights_into_the_served_model():
    got = []
    worker = type("W", (CrlWorkerExtension,), {})()
    worker.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=lambda weights: got.extend(weights)))
    assert worker.crl_load_weights([("a", torch.zeros(1)), ("b", torch.ones(1))]) == 2 and [n for n, _ in got] == ["a", "b"]


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'crl\[vllm\]'"):
        VLLMBackend("ckpt")
