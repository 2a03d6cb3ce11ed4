"""``PythonTool``: runs the ```python blocks of the model's last message in a :class:`crl.sandbox.Sandbox`.

A TorchRL tool transform (:class:`~torchrl.envs.llm.transforms.tools.ToolTransformBase`) for a ``ChatEnv`` in history
mode: after each step it reads the last message of ``("next", "history", "prompt")`` (the assistant's response),
runs its code blocks, one fresh sandboxed process each, and appends one ``tool`` message per block whose content is
:meth:`crl.sandbox.RunResult.as_observation` (the output, then any timeout, limit, truncation or exit code, or
``(no output)``). A message without a code block gets no tool message. Unlike TorchRL's ``PythonInterpreter``
(a plain subprocess, the host's filesystem and network), the code runs isolated (``crl/sandbox.py``).
"""
from __future__ import annotations

import re
from typing import Callable

from torchrl.envs.llm.transforms.tools import ToolTransformBase

from crl.sandbox import Sandbox, SandboxLimits

__all__ = ["PythonTool", "extract_code_blocks"]

# ```python / ```py / ```python3, then the code up to the closing fence (the newline before it not included).
_CODE_BLOCK = re.compile(r"```(?:python3?|py)[^\S\n]*\n(.*?)\n?```", re.DOTALL | re.IGNORECASE)


def extract_code_blocks(text: str) -> list[str]:
    """The ```python code blocks of ``text``, in order."""
    return _CODE_BLOCK.findall(text)


class PythonTool(ToolTransformBase):
    """Run the ```python code blocks of the last assistant message in a sandbox; one tool message per block.

    Args:
        sandbox: the :class:`~crl.sandbox.Sandbox` to run in (it carries the mode, limits and task files); by
            default one is built from ``mode`` and ``limits`` (bwrap mode raises
            :class:`~crl.sandbox.SandboxUnavailable` here when bubblewrap cannot run).
        mode, limits: for the default sandbox; not allowed together with ``sandbox``.
        max_blocks: blocks run per message; the rest are not run and the last observation says so.
        tool_role: the role of the appended messages.
        skip: ``skip(message) -> bool``; a message it accepts is not run and gets no tool message (e.g. a final
            answer, which a verifier runs instead).
        files_for: ``files_for(env_index) -> {name: content}``, the scratch files of the episode env ``env_index``
            is playing now (one env, many tasks: e.g. ``lambda i: reward.current_tasks[i].files``); they replace
            the sandbox's own files for that call.
    """

    use_step = True

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        mode: str = "bwrap",
        limits: SandboxLimits = SandboxLimits(),
        max_blocks: int = 1,
        tool_role: str = "tool",
        skip: Callable[[str], bool] | None = None,
        files_for: Callable[[int], dict] | None = None,
    ):
        super().__init__()
        if sandbox is not None and (mode != "bwrap" or limits != SandboxLimits()):
            raise ValueError("PythonTool: pass either a sandbox or mode/limits to build one, not both")
        if max_blocks < 1:
            raise ValueError(f"PythonTool: max_blocks must be >= 1, got {max_blocks}")
        self.sandbox = sandbox if sandbox is not None else Sandbox(mode=mode, limits=limits)
        self.max_blocks = max_blocks
        self.tool_role = tool_role
        self.skip = skip
        self.files_for = files_for

    def _process_batch_item(self, content: str, index: int) -> list[str] | None:
        if self.skip is not None and self.skip(content):
            return None
        blocks = extract_code_blocks(content)
        if not blocks:
            return None
        box = self.sandbox
        if self.files_for is not None:  # same mode and limits (already checked), this episode's files
            box = Sandbox._unchecked(box.mode, box.limits, self.files_for(index), box.python, box.bwrap)
        results = [box.run(code).as_observation() for code in blocks[: self.max_blocks]]
        skipped = len(blocks) - self.max_blocks
        if skipped > 0:
            results[-1] += f"\n[{skipped} more code block(s) not run: at most {self.max_blocks} per message]"
        return results

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(sandbox={self.sandbox!r}, max_blocks={self.max_blocks}, tool_role={self.tool_role!r})"
