"""The inference HTTP API (KServe v2 / Open Inference protocol as Triton speaks it).

- ``server``: the aiohttp application, its endpoints, authentication and error mapping.
- ``codec``: request and response bodies (JSON and the binary tensor extension) to and from arrays.
- ``encoding``: compressed request bodies, decoded with a bound.
- ``shm``: system shared memory regions for zero-copy local clients.
"""
