"""The process backend: plain subprocesses pinned to their granted cores, one working directory
per trajectory, each trajectory as a uid of its own when the agent runs as root (``users``).
Beyond file ownership it does NOT isolate trajectories; it runs where no Docker engine is
available."""
