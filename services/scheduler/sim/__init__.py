"""The discrete-event simulator: replays workload traces against the scheduler's own core and
policies with a virtual clock (``simulator.py``), over generated or recorded traces
(``traces.py``), with one engine per kind of pool (``engines.py``) and the Kubernetes baseline
(``kube.py``, pods sharing cores); ``deepsearch.py`` compares quota policies on a simulated
rate-limited provider; ``mopd_gpu.py`` runs Figure 8(b)'s GPU workload (``mopd_workload.py``)
through the core, ``mopd_baselines.py`` its SGLang and ServerlessLLM baselines; ``faults.py``
injects node failures (role-only recovery against restarting everything) into pools driven
through the core (``fault_pools.py``)."""
