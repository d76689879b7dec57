"""Fakes for the hardware and vendor-library seams that cannot run on a developer machine.

``fake_tensorrt`` stands in for the ``tensorrt`` module (which needs an NVIDIA GPU and JetPack);
``onnx_models`` builds the tiny real ONNX graphs that the fake and the real-TensorRT tests share;
``trt_stubs`` hands the tests the repaired ``tensorrt-stubs`` files (tools/trt_stubs.py).
"""
