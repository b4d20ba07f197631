"""The scheduler's pure core: no I/O, no clock of its own (every call takes ``now``).

``scheduler.py`` owns the books (queue, nodes, environments, running actions) and returns
effects; ``books.py`` holds their records; ``effects.py`` the effects and the one builder of
``ActionResult``; ``views.py`` how queued and running actions look to a policy;
``placement.py`` which concrete cores an action gets.
"""
