"""The scheduler's pure core: no I/O, no clock of its own (every call takes ``now``).

``scheduler.py`` owns the books (queue, nodes, environments, running actions) and returns
effects; ``books.py`` holds their records; ``effects.py`` the effects and the one builder of
``ActionResult``; ``views.py`` how queued and running actions look to a policy;
``placement.py`` which concrete cores an action gets. ``quota.py`` grants http calls and
leases under the declared quotas (its records and verdicts in ``quota_books.py``).
``gpu_sched.py`` grants infer actions GPU chunks and tracks model services (their
registrations in ``registry.py``; chunks, residency and restore cost in ``gpu.py``).
"""
