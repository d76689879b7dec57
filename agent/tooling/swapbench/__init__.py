"""``edge-agent bench swap``: the blue-green swap under load, a misbehaving version caught by the
canary and by the watch window, and a soak of many swaps (issue 16's benchmark).

Modules: ``bench`` (the phases and the figures), ``load`` (a closed loop paced to a rate, every
request recorded), ``daemon`` (the daemon under test as its own process), ``bundles`` (the
signing key and the versions), ``onnx_writer`` (the tiny classifier as ONNX without the ``onnx``
package, so the benchmark runs with the device extra alone).
"""
