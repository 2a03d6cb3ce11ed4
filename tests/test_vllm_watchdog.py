"""The vLLM dead-engine watchdog (crl.modules.vllm_backend.watch_engine) on stand-in engine clients: it attaches to
vLLM's private client internals, and when they are not there it says so, once, naming what is missing, instead of
switching itself off silently. The real engine, killed mid-call: tests/test_vllm_training.py."""
from __future__ import annotations

import queue
import warnings
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

import crl.modules.vllm_backend as vllm_backend
from crl.modules.vllm_backend import watch_engine


class SyncMPClient:
    """Stand-in for vLLM 0.32's synchronous multiprocess client: the parts the watchdog reads."""

    def __init__(self, drop: str | None = None):
        self.resources = SimpleNamespace(engine_dead=False)
        self.outputs_queue = queue.Queue()
        self.utility_results = {}
        if drop == "engine_dead":
            self.resources = SimpleNamespace()
        elif drop is not None:
            delattr(self, drop)


def llm_with(client) -> SimpleNamespace:
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(vllm_backend, "_WATCHDOG_WARNED", set())


def test_a_dead_engine_fails_the_waiting_calls():
    client = SyncMPClient()
    waiting = Future()
    client.utility_results[7] = waiting
    stop = watch_engine(llm_with(client), every_s=0.01)
    try:
        client.resources.engine_dead = True
        assert type(client.outputs_queue.get(timeout=5)).__name__ == "EngineDeadError"
        with pytest.raises(Exception) as err:
            waiting.result(timeout=5)
        assert type(err.value).__name__ == "EngineDeadError"
    finally:
        stop.set()


@pytest.mark.parametrize("drop, named", [
    ("engine_dead", "engine_core.resources.engine_dead"),
    ("outputs_queue", "engine_core.outputs_queue"),
    ("utility_results", "engine_core.utility_results"),
])
def test_a_client_without_a_part_warns_once_naming_it(drop, named):
    with pytest.warns(RuntimeWarning, match=rf"vLLM dead-engine watchdog off: .*engine client SyncMPClient\) has no {named}; .* will hang"):
        assert watch_engine(llm_with(SyncMPClient(drop))) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second engine of the same vLLM: said already, not repeated
        assert watch_engine(llm_with(SyncMPClient(drop))) is None


def test_an_llm_without_an_engine_client_warns():
    with pytest.warns(RuntimeWarning, match=r"has no llm\.llm_engine\.engine_core;"):
        assert watch_engine(SimpleNamespace()) is None


def test_an_in_process_engine_has_nothing_to_watch():
    InprocClient = type("InprocClient", (), {})  # vLLM's in-process client: no engine process that could die
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert watch_engine(llm_with(InprocClient())) is None
