"""Tangram gpu_manager: model services pooled over GPUs by evict-on-execution (§5.3).

Pure parts so far: ``services.py`` (the user contract: a factory returning ``(model, handle)``),
``host_copy.py`` (the invariant host copy of a service's state and its restore onto a device),
``devices.py`` (inventory: NVML GPUs or CPU stand-ins, grouped into buddy chunks),
``residency.py`` (which services are resident where; LRU eviction, one action per device) and
``batching.py`` (coalescing concurrent calls into one forward pass).
"""
