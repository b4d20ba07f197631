"""verl adapters: :class:`TangramTool`, a ``BaseTool`` that runs each tool call as an action
in the trajectory's environment, and :func:`compute_score` (and :func:`compute_score_async`),
a custom reward function that calls a pooled reward service.

Tool config (the ``config:`` of a tool in verl's tool YAML)::

    - class_name: tangram.integrations.verl.TangramTool
      config: {type: native, job_id: my-run, cpus: [1, 4], timeout_s: 120}
      tool_schema: ...   # optional: a ``bash`` tool taking ``command`` by default

Reward (``custom_reward_function.path`` is this module's file,
``custom_reward_function.name: compute_score_async``, and
``custom_reward_function.reward_kwargs: {service: my-judge}``; the ``TANGRAM_REWARD_*``
settings otherwise).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from tangram.errors import InvalidRequest
from tangram.integrations import clients, config, rewards
from tangram.integrations.observation import metrics, observation

__all__ = ["DEFAULT_SCHEMA", "TangramTool", "ToolConfig", "compute_score", "compute_score_async"]

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in your own sandbox; files persist between calls.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}


class ToolConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a :class:`TangramTool` asks of the mesh; unset fields take the contract's
    defaults. ``argument`` names the tool parameter holding the command."""

    type: str = "native"  # verl's own key
    job_id: str = "verl"
    argument: str = "command"
    cpus: int | list[int] | UnsetType = UNSET
    timeout_s: float | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    image: str | UnsetType = UNSET


class TangramTool(BaseTool):  # type: ignore[misc,unused-ignore]  # verl ships no type information
    """Each call runs ``parameters[argument]`` in the trajectory's own environment.

    The trajectory is verl's request (``agent_data.request_id``, the agent loop's), else
    ``create_kwargs["trajectory_id"]``, else the instance (the SGLang rollout's one instance
    per trajectory, whose ``release`` then closes the environment)."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        self.settings = msgspec.convert(
            {k: v for k, v in (config or {}).items() if v is not None}, ToolConfig
        )
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(config, schema)
        self._trajectories: dict[str, str] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        given = (kwargs.get("create_kwargs") or {}).get("trajectory_id")
        self._trajectories[instance_id] = str(given or instance_id)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        command = parameters.get(self.settings.argument)
        if not isinstance(command, str) or not command.strip():
            text = f"error: the tool needs a non-empty string {self.settings.argument!r}"
            return ToolResponse(text=text), 0.0, {"invalid_call": 1.0}
        client = await clients.shared_client()
        result = await client.exec(
            command, trajectory_id=self._trajectory(instance_id, kwargs), **self._action()
        )
        return ToolResponse(text=observation(result)), 0.0, metrics(result)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        trajectory = self._trajectories.pop(instance_id, None)
        if trajectory == instance_id:  # the environment was this instance's alone
            await (await clients.shared_client()).close_env(trajectory)

    async def close_trajectory(self, trajectory_id: str) -> None:
        """End a request's environment (verl's agent loop has no hook for it)."""
        await (await clients.shared_client()).close_env(trajectory_id)

    def _trajectory(self, instance_id: str, kwargs: dict[str, Any]) -> str:
        request_id = getattr(kwargs.get("agent_data"), "request_id", None)
        if request_id:
            return str(request_id)
        return self._trajectories.get(instance_id, instance_id)

    def _action(self) -> dict[str, Any]:
        fields = msgspec.structs.asdict(self.settings)
        for key in ("type", "argument"):
            del fields[key]
        cpus = fields.get("cpus")
        if isinstance(cpus, list):
            if len(cpus) != 2:
                raise InvalidRequest(f"cpus is a count or a [min, max] range, not {cpus}")
            fields["cpus"] = (cpus[0], cpus[1])
        return {k: v for k, v in fields.items() if v is not UNSET}


def _query(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any
) -> rewards.RewardQuery:
    extra = extra_info if isinstance(extra_info, dict) else {}
    prompt = extra.get("prompt", "")
    return rewards.RewardQuery(
        response=solution_str,
        label=ground_truth,
        source=data_source,
        prompt=prompt if isinstance(prompt, str | list) else str(prompt),
    )


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    **reward_kwargs: Any,
) -> float | dict[str, float]:
    """verl's custom reward function (blocking): one call of the reward service.
    ``reward_kwargs`` (verl's ``custom_reward_function.reward_kwargs``) may set
    ``service``, ``job_id``, ``timeout_s``."""
    client = clients.shared_sync_client()
    query = _query(data_source, solution_str, ground_truth, extra_info)
    cfg = _config(reward_kwargs)
    return rewards.score_sync(client, query, cfg).as_verl()


async def compute_score_async(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    **reward_kwargs: Any,
) -> float | dict[str, float]:
    """The same, for verl's reward loop (it awaits coroutine reward functions)."""
    client = await clients.shared_client()
    query = _query(data_source, solution_str, ground_truth, extra_info)
    reward = await rewards.score(client, query, _config(reward_kwargs))
    return reward.as_verl()


def _config(reward_kwargs: dict[str, Any]) -> config.RewardConfig:
    known = {k: v for k, v in reward_kwargs.items() if k in config.RewardConfig.__struct_fields__}
    return config.load(known)
