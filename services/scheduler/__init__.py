"""The scheduler service: one owner of allocation decisions for the whole mesh.

``core/`` is the pure bookkeeping (queues, nodes, environments, running actions, the results it
decides), ``policies/`` the allocation policies it asks (elastic, fixed DoP, trajectory-static,
min), ``sim/`` the discrete-event simulator that drives the same core and policies over traces.
At the top: ``service.py`` (the async shell over NATS and Postgres), ``store.py`` (its SQL),
``config.py`` (its typed config).
"""
