"""The dashboard: the mesh in a browser, and the store of its spans.

``service.py`` is the shell (the span subscription, the HTTP server); ``spans.py`` writes the
shipped spans to Postgres and bounds them; ``queries.py`` reads actions, spans and the live
state; ``waterfall.py`` and ``act.py`` are pure (a trace's bars, ACT over time);
``pages.py`` renders HTML; ``web.py`` holds the routes and their parameters.
"""
