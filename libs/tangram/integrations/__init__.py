"""Drop-in adapters for RL frameworks, each behind the framework's own extension point.

- :mod:`tangram.integrations.verl`: a ``BaseTool`` that runs tool calls in the trajectory's
  environment, and ``compute_score`` calling a pooled reward service.
- :mod:`tangram.integrations.skyrl`: a ``BaseTextEnv`` whose ``step`` runs through the mesh.
- :mod:`tangram.integrations.slime`: a custom reward function ``rm(args, sample)``.
- :mod:`tangram.integrations.rllm`: a sandbox backend with rLLM's ``Sandbox`` protocol.
- ``services.reward_front`` (started by ``tangram up``): HTTP endpoints for slime's
  ``--rm-url`` and OpenRLHF's ``--remote_rm_url``.

What they share lives here: the reward vocabulary (:mod:`.rewards`), what a command's
result looks like to a model (:mod:`.observation`), and the process-wide connection to the
mesh (:mod:`.clients`). Each framework module imports its framework; the shared modules do
not.
"""
