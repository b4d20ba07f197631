"""The Docker backend: one locked-down container per trajectory, cores pinned per action.

``backend`` (DockerBackend: environments, pinning, quarantine) drives ``engine`` (every
blocking Docker SDK call), ``run`` (one action, via the in-container ``executor`` and its
``executor_client``, or ``docker exec``), ``pool`` (warm containers), ``cgroup`` (direct
cpuset/quota/OOM-counter access). ``config`` is its settings; ``sandbox_image`` builds the
default image offline.
"""
