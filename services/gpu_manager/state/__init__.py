"""Model state in tiers below the device arenas: host memory and disk (plexrl §4.5).

``tiers.py`` is the pure core (admission, eviction, budgets, pins); ``keys.py`` names a tensor
by its content; ``disk.py`` is the crash-safe safetensors store; ``copy.py`` a service's state
as keyed tensors and its restore into a device arena; ``manager.py`` the thread-safe shell the
executor calls (capture, promote, pin, prefetch, report).
"""
