"""The inference HTTP API (KServe v2 / Open Inference protocol as Triton speaks it)."""
