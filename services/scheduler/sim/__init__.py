"""The discrete-event simulator: replays workload traces against the scheduler's own core and
policies with a virtual clock (``simulator.py``), over generated or recorded traces
(``traces.py``), with one engine per kind of pool (``engines.py``) and the Kubernetes baseline
(``kube.py``, pods sharing cores)."""
