"""From a trained model to a deployable bundle: zoo, data, export, INT8, TensorRT, bundle.

Importing this package imports nothing heavy: ``models.bundle`` and ``models.signing`` are used on
the device (no torch there); the torch-based modules are imported only by host commands.
"""
