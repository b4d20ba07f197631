"""Gateway configuration (environment variables ``TANGRAM_GATEWAY_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from services.gateway.admission import Bounds
from tangram import config
from tangram.config import MeshConfig


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_in_flight: int = 4096
    max_cpus_per_action: int = 256
    max_memory_mb: int = 256 * 1024
    max_batch: int = 512
    # Admission control (admission.py): a new submit is refused with ``busy`` while the mesh
    # holds more accepted-but-unfinished actions than MAX_BACKLOG_S of work at its measured
    # drain rate. 5 s: an accepted action then waits at most ~5 s for its turn however much is
    # offered, while the queue still holds enough to keep every core fed until refused
    # clients come back (they are told to retry when half of it has drained).
    admission: bool = True
    max_backlog_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # The floor, for a mesh with no drain rate yet (cold, or only long actions): a burst of
    # 512 is accepted at once, and the rest of a bigger one is told to come back in 1 s, by
    # when finishes give a rate. Not more: on a slow mesh (~100/s, this 2-core machine under
    # load) 512 is already ~5 s of work, and a short queue keeps the scheduler's pass cheap
    # (15 µs per action empty, 112 µs at 3k queued, issue 13).
    min_backlog: Annotated[int, msgspec.Meta(ge=1)] = 512
    # The ceiling, whatever the rate: the open-action scans of the overload cliff (issue 13)
    # grow with the number of open rows.
    max_backlog: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    # How long a service registration waits for the scheduler's answer. The timeouts nest,
    # each longer than the one it waits on, so the caller hears the innermost typed error (a
    # factory stuck past TANGRAM_GPU_PREPARE_TIMEOUT_S, 90 s; a GPU node silent past
    # TANGRAM_SCHEDULER_PREPARE_TIMEOUT_S, 120 s) and never this bare timeout: keep it above
    # the scheduler's prepare timeout when raising that one.
    register_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 150.0

    def bounds(self) -> Bounds:
        return Bounds(
            backlog_s=self.max_backlog_s,
            floor=self.min_backlog,
            ceiling=max(self.min_backlog, self.max_backlog),
            enabled=self.admission,
        )


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, GatewayConfig]:
    return config.service(GatewayConfig, "TANGRAM_GATEWAY_", overrides)
