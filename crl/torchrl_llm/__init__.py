"""crl inside TorchRL's LLM stack: compaction for ``ChatEnv``, crl episodes from ``LLMCollector``, crl's loss on a
TorchRL wrapper (docs/torchrl.md).

Optional: it needs the TorchRL / tensordict versions it was tested with (the LLM API of TorchRL still moves between
releases, and crl works around defects of this one), checked here at import with the fix in the message.
"""
from __future__ import annotations

TESTED = {"torchrl": "0.14", "tensordict": "0.14"}  # major.minor tested (torchrl 0.14.1, tensordict 0.14.3)


def _check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    for pkg, want in TESTED.items():
        try:
            have = version(pkg)
        except PackageNotFoundError:
            raise ImportError(f"crl.torchrl_llm needs {pkg} {want}.x: pip install 'crl[torchrl-llm]'") from None
        if ".".join(have.split(".")[:2]) != want:
            raise ImportError(
                f"crl.torchrl_llm was tested with {pkg} {want}.x and found {pkg} {have}; TorchRL's LLM API changes between releases "
                f"and crl pins its workarounds to this one (docs/torchrl.md): pip install '{pkg}=={want}.*' or 'crl[torchrl-llm]'"
            )


_check_versions()

from crl.torchrl_llm.convert import LogProbActor, to_episodes  # noqa: E402
from crl.torchrl_llm.transform import CompactionTransform  # noqa: E402

__all__ = ["CompactionTransform", "LogProbActor", "to_episodes", "TESTED"]
