"""Scheduling policies: objects the scheduler calls to order requests.

A policy says which waiting request is admitted first (`admit_order`) and which running
request is preempted first when the page pool runs out (`victim`). FCFS admits by arrival
and preempts the newest; priority admits by (priority, arrival), lower first (vLLM's
habit), and preempts the lowest priority, the newest among equals. A new policy (the
SLA-aware one of the server) is one more class with these two methods, registered here.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxdec.engine.request import Request
from jaxdec.errors import JaxdecError


class FCFS:
    name = "fcfs"

    def key(self, r: Request):
        return (r.arrival,)

    def admit_order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=self.key)

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt: the one that would be admitted last."""
        return max(running, key=self.key)


class Priority(FCFS):
    name = "priority"

    def key(self, r: Request):
        return (r.priority, r.arrival)


POLICIES = {p.name: p for p in (FCFS, Priority)}


def make(name: str):
    if name not in POLICIES:
        raise JaxdecError(f"unknown scheduling policy {name!r} (one of {', '.join(POLICIES)})")
    return POLICIES[name]()
