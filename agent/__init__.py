"""The Jetson edge agent: the on-device daemon, and the CLI that also fronts the host-side tools.

Layers, from the bottom up (an import only ever goes down):

1. The base layer: ``agent.errors``, ``agent.deps``, ``agent.fsutil``, ``agent.log`` and this
   package's ``__version__``. It imports nothing else of the project. ``models/``, ``pruning/``
   and ``power/`` may import these modules of ``agent`` and no other (tests/test_layout.py checks
   it), so the host pipeline and the board's power layer never depend on the daemon.
2. ``models/`` (the bundle format, the engine builder, the host pipeline), ``pruning/``,
   ``power/``.
3. The daemon: ``config/``, ``store/``, ``backends/``, ``runtime``, ``batcher``, ``observers``,
   ``serving``, ``metrics``, ``scattered``, ``api/``, ``supervisor``, ``daemon``, ``run``.
4. ``tooling/`` (the demo, the serve benchmark, the load generator) and ``cli/``: the daemon
   never imports them.

Importing this package is cheap and never imports torch, TensorRT, pycuda or ONNX Runtime; those
are imported inside the module that needs them, and the daemon's modules never import torch.
"""

__version__ = "0.1.0"
