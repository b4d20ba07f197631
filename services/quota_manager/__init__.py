"""The quota_manager service: cluster-wide API quotas for HTTP calls and leases.

Pure cores only so far (deterministic, time passed in as ``now``, no I/O): ``spec.py`` (the
user's ``QuotaSpec``), ``hosts.py`` (parsing ``host[:port]`` entries), ``limiter.py`` (one
quota's concurrency, request-rate and token windows), ``adaptive.py`` (AIMD learning of the
provider's real limit, rate-limit header hints), ``fair.py`` (weighted fair queueing across
jobs), ``reach.py`` (the SSRF guard) and ``sim.py`` (the DeepSearch policy comparison). The
async shell over NATS and the scheduler wiring come with the shared agent runtime.
"""
