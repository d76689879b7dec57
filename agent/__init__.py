"""On-device daemon of the Jetson edge agent: config, store, backends, batcher, API, control.

Importing this package is cheap and never imports torch, TensorRT, pycuda or ONNX Runtime; those
are imported inside the module that needs them.
"""

__version__ = "0.1.0"
