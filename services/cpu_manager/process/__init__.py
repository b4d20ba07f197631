"""The process backend: plain subprocesses pinned to their granted cores, one working directory
per trajectory. It does NOT isolate trajectories; it runs where no Docker engine is available."""
