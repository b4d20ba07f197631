"""Every NATS subject of the mesh, and the union type each one carries."""

from __future__ import annotations

from typing import Final

PREFIX: Final = "tangram.v1"

GATEWAY: Final = f"{PREFIX}.gateway"  # GatewayRequest -> GatewayReply (queue group "gateway")
SCHED_ACTIONS: Final = f"{PREFIX}.sched.actions"  # SchedulerRequest -> Ack | ErrorReply
SCHED_NODES: Final = f"{PREFIX}.sched.nodes"  # NodeMessage -> Ack | ErrorReply
NODES_BROADCAST: Final = f"{PREFIX}.nodes.all"  # NodeCommand (Reconcile) to every node agent
RESULTS_PREFIX: Final = f"{PREFIX}.results"  # ActionResult pushed to a client

GATEWAY_QUEUE: Final = "gateway"
SCHEDULER_QUEUE: Final = "scheduler"


def node(node_id: str) -> str:
    """The command subject of one node agent (NodeCommand -> Ack | ErrorReply)."""
    return f"{PREFIX}.node.{node_id}"


def results(client_id: str) -> str:
    """Where the results of one client's actions are pushed."""
    return f"{RESULTS_PREFIX}.{client_id}"
