"""Tangram gpu_manager: model services pooled over GPUs by evict-on-execution (§5.3).

``service.py`` is the node agent on the shared runtime (``tangram.agent``); ``executor.py`` its
GPU executor (lanes of calls, one batch per device at a time, torch in worker threads). Pure
parts: ``services.py`` (the user contract: a factory returning ``(model, handle)``),
``catalog.py`` (prepared services and their reports), ``host_copy.py`` (the invariant host copy
and its restore), ``slices.py`` (a restore onto k devices as k slices, one through each device's
link), ``devices.py`` (NVML GPUs or CPU stand-ins, and the host links they share),
``residency.py`` (LRU eviction, one action per device, on the buddy chunks of
``tangram.chunks``), ``batching.py`` (coalescing calls), ``outcomes.py`` (a call's facts, output
capped). ``state/``: the tiers below the devices (host memory and a disk store, content-keyed so
services sharing tensors store them once), ``prefetch.py``: the scheduler's hints acted on.
``examples.py``: small models built in code, shared by the docs, the demo, the bench and the
tests.
"""
