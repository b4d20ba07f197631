"""The quota node agent (quota_manager): makes the HTTP calls the scheduler's quota core lets go.

``service.py`` is the agent on the shared runtime (``tangram.agent``) with an HTTP executor
(one call per dispatch, the quota's API key added from this process's environment);
``http.py`` makes a call guarded hop by hop by ``reach.py`` (the SSRF guard: scheme,
allow-list, IP literals, sizes, the resolved address); ``config.py`` its settings
(``TANGRAM_QUOTA_*``). The quota cores (limiter, fair queue, AIMD) live in the scheduler,
which owns allocation.
"""
