"""Your own task suite without editing crl: ``env.name: custom`` + ``env.factory`` (+ ``env.kwargs``).

A factory is any callable named ``"package.module:function"`` (importable from the working directory or an installed
package) or ``"path/to/file.py:function"`` (relative to the working directory). It returns a *task suite*, the same
object the built-in suites are (:class:`crl.envs.base.TaskSuite` is one way to write it, not a requirement):

* ``suite.tasks(split)`` for ``split`` in ``train`` / ``dev`` / ``test``: a non-empty sequence of tasks (any
  objects; a ``task_id`` attribute names them in the evidence). Deterministic: every rank calls the factory and must
  see the same tasks.
* ``suite.make_env(task)``: a fresh environment with ``reset() -> str`` (the task text ``u``) and
  ``step(action: str) -> crl.envs.StepResult`` (observation text, done, reward, info). Actions are the policy's free
  text; the environment owns its protocol, its step limit and its verifier (reward of a completed episode).
* optional ``suite.compaction_steps``: atomic steps after which a compaction is forced (default: the Eq. 7 budget
  trigger only).
* for ``warm_start.enabled``: the environment's ``oracle_action()``, ``oracle_summary()`` and
  ``format_only_summary(rng)`` (see :class:`crl.envs.base.TextEnv`).
* optional: the environment's ``summary_holds(summary_text) -> bool | None`` (:meth:`crl.envs.base.TextEnv.summary_holds`),
  the verdicts behind the ``summary/*`` metrics.

Under a curriculum the factory is called once per stage with ``length=stage.length`` (and ``compaction_steps=`` when
the stage sets one) on top of ``env.kwargs``. ``examples/key_value_env.py`` is a complete example.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from crl.envs.base import SPLITS

__all__ = ["FactoryError", "resolve_factory", "build_custom_suite"]


class FactoryError(ValueError):
    """An ``env.factory`` that cannot be imported, called or used; the message says what to fix."""


def resolve_factory(spec: str):
    """The callable ``spec`` names (``module:function`` or ``file.py:function``); raises :class:`FactoryError`."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(part.strip() for part in spec.split(":")):
        raise FactoryError(f"{spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    where, name = (part.strip() for part in spec.split(":"))
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise FactoryError(f"file {where} does not exist (relative paths start at the working directory {os.getcwd()})")
        stat = path.stat()  # a file edited since it was imported is imported again
        module_name = f"crl_env_factory_{path.stem}_{hashlib.sha1(f'{path}|{stat.st_mtime_ns}|{stat.st_size}'.encode()).hexdigest()[:12]}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # before exec: dataclasses and pickling look their module up here
            try:
                loader_spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[module_name]
                raise FactoryError(f"importing {where} failed: {type(err).__name__}: {err}") from err
    else:
        if os.getcwd() not in sys.path:  # like `python -m`: a package in the working directory is importable
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            raise FactoryError(f"cannot import {where!r} ({err}); install its package, run from the directory that holds it, "
                               "or name the file: 'path/to/file.py:function'") from None
        except Exception as err:
            raise FactoryError(f"importing {where} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        raise FactoryError(f"{where} has no attribute {name!r}")
    if not callable(fn):
        raise FactoryError(f"{where}:{name} is a {type(fn).__name__}, not a callable returning a task suite")
    return fn


def build_custom_suite(spec: str, kwargs: dict, stage=None):
    """Call the factory (with the curriculum ``stage``'s length / schedule when given) and check the suite's shape."""
    kwargs = dict(kwargs)
    if stage is not None:
        kwargs["length"] = stage.length
        if stage.compaction_steps is not None:
            kwargs["compaction_steps"] = tuple(stage.compaction_steps)
    fn = resolve_factory(spec)
    try:
        suite = fn(**kwargs)
    except TypeError as err:
        raise FactoryError(f"{spec}(**{kwargs}) failed: {err} (env.kwargs are its keyword arguments; under a curriculum it "
                           "also gets length= and compaction_steps=)") from err
    except Exception as err:
        raise FactoryError(f"{spec}(**{kwargs}) raised {type(err).__name__}: {err}") from err
    for attr in ("tasks", "make_env"):
        if not callable(getattr(suite, attr, None)):
            raise FactoryError(f"{spec} returned a {type(suite).__name__} without a {attr}() method; a task suite has "
                               "tasks(split) and make_env(task) (crl/envs/factory.py)")
    for split in SPLITS:
        try:
            tasks = suite.tasks(split)
        except Exception as err:
            raise FactoryError(f"{spec}: the suite's tasks({split!r}) raised {type(err).__name__}: {err}") from err
        if not hasattr(tasks, "__len__") or len(tasks) == 0:
            raise FactoryError(f"{spec}: tasks({split!r}) returned {type(tasks).__name__} {tasks!r:.60}; every split needs a non-empty "
                               "sequence")
    return suite
