"""afore's Prometheus metrics, one endpoint per pod (docs/metrics.md).

Every afore process of a replica (scheduler, FFN workers, the attention plugin inside vLLM's
processes) records into prometheus_client's multiprocess files under one directory
(``PROMETHEUS_MULTIPROC_DIR``, created by ``afore serve``); vLLM's own ``/metrics`` on the API
port aggregates that directory, so afore's families appear beside vLLM's. On the FFN node of
the two-node layout the admin port serves the same aggregation.

Modules:
  multiprocess  the shared directory: create, aggregate, mark a process dead, remove
  attention     the attention side's exchange figures (F2A wait, transport bytes)
  balance       max/mean tile load of a plan and of its primary-only placement
  conventions   the naming rules afore's families keep (checked by the tests)
  figures       an exposition -> the operator's figures (``afore status --watch/--plot``)
"""
