"""Tooling that runs beside the daemon, never inside it on a board in service.

- ``demo``: ``edge-agent demo``, the whole path on one machine (build, install, serve, query).
- ``bench_serve``: ``edge-agent bench serve``, the daemon as its own process against its raw
  backend.
- ``loadgen``: the KServe v2 load generator both use (and ``tools/pytriton_bench.py`` for Triton),
  with ``httpconn``, its small keep-alive HTTP client.

The daemon never imports this package.
"""
