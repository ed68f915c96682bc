"""Scheduling policies: the order in which waiting requests are admitted and which running request
is preempted when KV blocks run out.

A policy is one `key` function. Waiting requests are admitted smallest key first; when blocks run out
the running request with the largest key is preempted (recomputed later). A request's key is taken
once, when it is queued (again after a preemption). To try a new policy, write a subclass with its own
`key` in a short file and name it as "FILE.py:Class" or "package.module:Class"
(`--scheduling-policy`, `scheduling_policy=`), pass an instance, or register it in POLICIES.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

from arcserve.engine.request import Request


class SchedulingPolicy(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def key(self, req: Request) -> Any:
        """Sort key: smaller is admitted first and preempted last."""

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.key)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: earliest arrival first, latest arrival preempted first."""

    name = "fcfs"

    def key(self, req: Request) -> Any:
        return (req.arrival_time, req.seq_no)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first (as in vLLM); FCFS among equal priorities."""

    name = "priority"

    def key(self, req: Request) -> Any:
        return (req.priority, req.arrival_time, req.seq_no)


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(policy) -> SchedulingPolicy:
    """A policy from an instance, a subclass, a name in POLICIES, or "FILE.py:Class" /
    "package.module:Class" (the class is made without arguments). ValueError says what is wrong."""
    if isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, SchedulingPolicy):
        return policy()
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    if not isinstance(policy, str) or ":" not in policy:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, \"FILE.py:Class\", "
                         f"\"package.module:Class\" or a SchedulingPolicy; got {policy!r}")  # fmt: skip
    where, _, name = policy.rpartition(":")
    module = _load_module(where, policy)
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, SchedulingPolicy)
                       and v.__module__ == module.__name__)  # fmt: skip
        raise ValueError(f"scheduling_policy {policy!r}: {where} has no SchedulingPolicy subclass {name!r}"
                         + (f" (it has {', '.join(found)})" if found else ""))  # fmt: skip
    try:
        return cls()
    except Exception as e:
        raise ValueError(f"scheduling_policy {policy!r}: {name}() raised {type(e).__name__}: {e}") from e


def _load_module(where: str, spec: str):
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"scheduling_policy {spec!r}: no file {where}")
        name = "arcserve_policy_" + hashlib.sha1(os.path.abspath(where).encode()).hexdigest()[:12]
        if name in sys.modules:  # (one module per file: loaded once per process)
            return sys.modules[name]
        loader = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"scheduling_policy {spec!r}: loading {where} raised {type(e).__name__}: {e}") from e
        sys.modules[name] = module
        return module
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise ValueError(f"scheduling_policy {spec!r}: cannot import {where}: {type(e).__name__}: {e}") from e
