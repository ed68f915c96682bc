"""Scheduling policies: the order in which waiting requests are admitted and which running request
is preempted when KV blocks run out.

A policy is one `key` function. Waiting requests are admitted smallest key first; when blocks run out
the running request with the largest key is preempted (recomputed later). To try a new policy, write a
subclass with its own `key` in a short file and register it in POLICIES (or pass an instance).
"""

from __future__ import annotations

import abc
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


def make_policy(policy: str | SchedulingPolicy) -> SchedulingPolicy:
    if isinstance(policy, SchedulingPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy]()
