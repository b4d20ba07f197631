"""SkyRL adapter: :class:`TangramTextEnv`, a ``BaseTextEnv`` whose ``step`` runs the model's
command in the trajectory's own environment through the mesh.

Register it with SkyRL-Gym and name it in the data set's ``env_class``::

    skyrl_gym.register(id="tangram", entry_point="tangram.integrations.skyrl:TangramTextEnv")

A step whose action holds ``<bash>...</bash>`` runs it and answers its output; a step
without one ends the episode and is scored: by the reward service when ``reward_service``
is set, else by ``test_command``'s exit code (1.0 when it exits 0), else 0. Settings come
from the env config (``environment.skyrl_gym.tangram`` in SkyRL's config) and may be
overridden per sample in ``extras`` (``max_turns``, ``reward_spec.ground_truth``,
``test_command``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from tangram.client import SyncClient
from tangram.contract import ActionResult
from tangram.integrations import clients, rewards
from tangram.integrations.config import RewardConfig
from tangram.integrations.observation import metrics, observation

__all__ = ["EnvConfig", "TangramTextEnv", "command_in"]


class EnvConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    job_id: str = "skyrl"
    tag: str = "bash"  # the action's command is inside <tag>...</tag>
    max_turns: int = 5
    timeout_s: float = 600.0
    cpus: int = 1
    test_command: str = ""  # run at the episode's end; exit 0 scores 1.0
    reward_service: str = ""  # or score the final answer with this model service


def command_in(action: str, tag: str) -> str | None:
    """The last ``<tag>...</tag>`` block of an action, stripped (None when there is none)."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", action, re.DOTALL)
    return found[-1].strip() if found else None


class TangramTextEnv(BaseTextEnv):  # type: ignore[misc,unused-ignore]  # skyrl_gym ships no type information
    """Each episode is one trajectory with its own environment, removed by :meth:`close`."""

    def __init__(
        self,
        env_config: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
        *,
        client: SyncClient | None = None,
    ) -> None:
        super().__init__()
        extras = extras or {}
        given = {**_plain(env_config), **_per_sample(extras)}
        self.settings = msgspec.convert(given, EnvConfig)
        self.max_turns = self.settings.max_turns
        self.ground_truth = (extras.get("reward_spec") or {}).get("ground_truth")
        self.trajectory_id = f"skyrl-{uuid.uuid4().hex}"
        self.client = client or clients.shared_sync_client()
        self.calls: list[dict[str, float]] = []

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        command = command_in(action, self.settings.tag)
        observations, metadata = [], {}
        if command is not None:
            result = self._run(command)
            observations = [{"role": "user", "content": observation(result)}]
            metadata = {"action_id": result.action_id, **metrics(result)}
        done = command is None or self.turns >= self.max_turns
        reward = self._final_reward(action) if done else 0.0
        return BaseTextEnvStepOutput(
            observations=observations, reward=reward, done=done, metadata=metadata
        )

    def close(self) -> None:
        self.client.close_env(self.trajectory_id)

    def get_metrics(self) -> dict[str, Any]:
        infra = sum(c["infrastructure_failure"] for c in self.calls)
        return {"tangram_calls": len(self.calls), "tangram_infrastructure_failures": infra}

    def _run(self, command: str) -> ActionResult:
        s = self.settings
        result = self.client.exec(
            command,
            trajectory_id=self.trajectory_id,
            job_id=s.job_id,
            timeout_s=s.timeout_s,
            cpus=s.cpus,
        )
        self.calls.append(metrics(result))
        return result

    def _final_reward(self, action: str) -> float:
        s = self.settings
        if s.reward_service:
            query = rewards.RewardQuery(response=action, label=self.ground_truth)
            cfg = RewardConfig(service=s.reward_service, job_id=s.job_id)
            return rewards.score_sync(self.client, query, cfg).score
        if s.test_command:
            return 1.0 if self._run(s.test_command).ok else 0.0
        return 0.0


def _plain(env_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """SkyRL passes an OmegaConf ``DictConfig``; any mapping of plain values will do."""
    return {str(k): env_config[k] for k in env_config} if env_config else {}


def _per_sample(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {k: extras[k] for k in ("max_turns", "test_command", "reward_service") if k in extras}
