"""``edge-agent bench power``: energy and latency of max clocks, the stock governors and ours on
a SIMULATED board (issue 18's benchmark).

Modules: ``runner`` (the traces under each strategy and the figures), ``strategies`` (the
governor under test, the production controller over the production board layer), ``report``
(targets, the table, the calibration table), ``plot`` (frequency, power and latency over time, a
PNG; matplotlib optional). The simulator itself is ``power/sim/``.
"""
