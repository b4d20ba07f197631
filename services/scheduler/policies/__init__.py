"""Allocation policies: given one pool's FCFS queue, who starts now and with how many units.

``base.py`` declares the policy contract (``Policy`` and its optional hooks ``Learns`` and
``PerPool``) and the min baseline; ``spec.py`` parses a policy name as data and builds it;
``elastic.py`` is Algorithms 1-2 (with ``dparrange.py`` and its GPU ``chunks.py``,
``act_kernel.py`` compiled and ``durations.py`` learned durations); ``fixed.py`` and
``static.py`` are the baselines. Quotas: ``quota_limiter.py`` (one quota's concurrency,
rate and token windows), ``quota_adaptive.py`` (AIMD, rate-limit headers), ``quota_fair.py``
(weighted fair queueing across jobs).
"""
