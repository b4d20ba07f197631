"""Registered model services and the bookkeeping of a registration (pure).

A registration waits until every GPU node that was live when it arrived has reported the
service (ready, or with the factory's error), a node that leaves stops being waited for, and
the wait is bounded. Its answer says where the service is ready, or why no node could
prepare it. What a node reports is kept per node (``GpuFacts.services``); this module reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.scheduler.core.books import GpuFacts
from tangram.contract import PreparedService, ServiceSpec, ServiceState


@dataclass
class Registration:
    spec: ServiceSpec
    waiting_on: set[str]  # GPU nodes that have not reported it yet
    deadline: float


def has_reported(facts: GpuFacts, spec: ServiceSpec) -> bool:
    """The node said something of every variant it can hold (or that the factory failed)."""
    entries = [e for (name, _), e in facts.services.items() if name == spec.name]
    if any(e.error for e in entries):
        return True
    seen = {e.dop for e in entries}
    return all(d in seen for d in spec.dops if d <= len(facts.gpus))


def missing(facts: GpuFacts, specs: Iterable[ServiceSpec]) -> list[ServiceSpec]:
    """Registered services this node's report says nothing of."""
    named = {name for name, _ in facts.services}
    return [s for s in specs if s.name not in named]


def state_of(spec: ServiceSpec, nodes: Mapping[str, GpuFacts]) -> ServiceState:
    """The service as the GPU nodes report it: where it is ready and resident, its footprint
    (of the smallest variant ready), the calls and batches run, and the factory's error when
    no node has it ready."""
    ready: list[str] = []
    resident: list[str] = []
    errors: list[str] = []
    footprint = calls = batches = device_hits = host_hits = 0
    for node_id, facts in sorted(nodes.items()):
        entries = sorted(
            (e for (n, _), e in facts.services.items() if n == spec.name), key=lambda e: e.dop
        )
        good = [e for e in entries if not e.error]
        errors += [f"{node_id}: {e.error}" for e in entries if e.error]
        if good:
            ready.append(node_id)
            footprint = footprint or good[0].footprint_mb
        resident += [f"{node_id}:{g}" for e in good for g in e.resident]
        calls += sum(e.calls for e in good)
        batches += sum(e.batches for e in good)
        device_hits += sum(e.device_hits for e in good)
        host_hits += sum(e.host_hits for e in good)
    return ServiceState(
        spec=spec,
        footprint_mb=footprint,
        prepared_on=tuple(ready),
        resident_on=tuple(sorted(set(resident))),
        error="" if ready else "; ".join(errors),
        calls=calls,
        batches=batches,
        device_hits=device_hits,
        host_hits=host_hits,
    )


def changed(
    old: Mapping[tuple[str, int], PreparedService], new: Mapping[tuple[str, int], PreparedService]
) -> set[str]:
    """The services whose variants or errors differ between two reports of one node: all that
    :func:`failed_everywhere` reads of a report (its footprints, residency and counts change
    with every heartbeat and do not matter to it)."""
    if old.keys() == new.keys():  # a heartbeat, usually
        return {k[0] for k, e in new.items() if old[k].error != e.error}
    names = {name for name, _ in old.keys() ^ new.keys()}
    names.update(k[0] for k, e in new.items() if k in old and old[k].error != e.error)
    return names


def failed_everywhere(spec: ServiceSpec, nodes: Mapping[str, GpuFacts]) -> str:
    """Why no live GPU node can run the service: every one reported an error for it (``""``
    while any node has it ready, or has not reported it, or there is no GPU node)."""
    if not nodes:
        return ""
    state = state_of(spec, nodes)
    if state.prepared_on or not all(has_reported(f, spec) for f in nodes.values()):
        return ""
    return state.error or "no GPU node can hold any of its dops"
