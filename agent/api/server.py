"""The HTTP server: KServe v2 endpoints on aiohttp, as Triton implements them.

Endpoints (docs/reference/serving.md §2): health, server and model metadata, model readiness and
configuration, ``infer`` (JSON and the binary tensor extension both ways), the statistics and model
repository index extensions, system shared memory (register, status, unregister) and Prometheus
text at ``/metrics``. Errors are ``{"error": "..."}`` with 4xx for bad input and 503 when the queue
is full or the model is not ready. An optional bearer token protects everything but the health
probes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from agent import __version__
from agent.api.codec import HEADER_LENGTH, RequestError, decode_request, encode_response, parse_json
from agent.api.encoding import ENCODINGS, decode_body
from agent.api.shm import SystemSharedMemory
from agent.batcher import DeadlineExceeded, NotServing, QueueFull
from agent.errors import AgentError, InputError, first_line
from agent.metrics import CONTENT_TYPE_LATEST
from agent.scattered import Body
from agent.serving import ModelService

log = logging.getLogger(__name__)

EXTENSIONS = ["binary_tensor_data", "system_shared_memory", "model_repository", "statistics"]
_OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Received pieces smaller than this are joined: a normal client's pieces are 64 KiB to several
# hundred KiB and stay views; a trickling client's are joined into pieces of at least this size.
_SMALL_PIECE_BYTES = 64 * 1024


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class _ClientFaults(logging.Filter):
    """aiohttp logs a client's malformed HTTP or dropped connection as an error with a
    traceback; anyone who can reach the port could fill the log that way. Such records become
    one line at INFO."""

    _CLIENT_FAULTS = (HttpProcessingError, ConnectionError, RequestPayloadError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self._CLIENT_FAULTS):
            record.msg = " ".join(f"{record.getMessage()}: {type(exc).__name__}: {exc}".split())
            record.args = ()
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_client_faults = _ClientFaults()


def _status_of(exc: AgentError) -> int:
    if isinstance(exc, RequestError):
        return exc.status
    if isinstance(exc, QueueFull | NotServing | DeadlineExceeded):
        return 503
    if isinstance(exc, InputError):
        return 400
    return 500


class InferenceServer:
    """Serves the models in ``services`` (name -> service; the mapping may change while running,
    which is how a later blue-green swap replaces a model)."""

    def __init__(self, services: MutableMapping[str, ModelService], *, host: str = "127.0.0.1",
                 port: int = 8000, token: str | None = None, max_body_bytes: int = 64 << 20,
                 metrics_render: Callable[[], bytes] | None = None,
                 shm_root: Path = Path("/dev/shm"), access_log: bool = False) -> None:
        self.services = services
        self.host = host
        self.port = port
        self._token = token.encode() if token else None
        self._metrics_render = metrics_render
        self.shm = SystemSharedMemory(shm_root)
        self._access_log = access_log
        self._max_body_bytes = max_body_bytes
        self._stopping = False
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._errors, self._auth])
        self._routes()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        server_log = logging.getLogger("aiohttp.server")
        if _client_faults not in server_log.filters:
            server_log.addFilter(_client_faults)
        # handler_cancellation: a client that goes away cancels its handler, and with it its
        # queued request (the batcher drops it), instead of holding a queue place and compute.
        # shutdown_timeout and lingering_time bound how long stop() waits for a client that
        # stalls mid-upload or keeps sending on a connection that is closing (60 s and 10 s by
        # default: past systemd's stop timeout together with the drain).
        self._runner = web.AppRunner(self.app, access_log=log if self._access_log else None,
                                     handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=5.0, lingering_time=1.0,
                                     auto_decompress=False)  # decode_body decodes
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise AgentError("cannot listen for HTTP", host=self.host, port=self.port,
                             reason=exc.strerror or str(exc)) from None
        server = site._server  # aiohttp keeps the asyncio server here; no public accessor
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("serving KServe v2 on http://%s:%d", self.host, self.port)
        return self.port

    async def stop(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Stop: the listener closes (new connections are refused), models stop taking requests
        (503, and the connection closes), queued and running ones finish (with ``drain``), then
        the open connections close."""
        self._stopping = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
        await asyncio.gather(*(service.stop(drain=drain, timeout_s=timeout_s)
                               for service in list(self.services.values())))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.shm.close()

    # -- plumbing -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except AgentError as exc:
            status = _status_of(exc)
            if status >= 500 and status != 503:
                log.error("request %s %s failed: %s", request.method, request.path, exc)
            response = _error(status, str(exc))
            if self._stopping:
                response.force_close()  # a client on this connection reconnects elsewhere
            return response
        except web.HTTPRequestEntityTooLarge as exc:
            return _error(413, f"request body too large: {exc.text}")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, exc.reason)
            if "Allow" in exc.headers:  # 405 says which methods the path takes
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except RequestPayloadError as exc:  # a compressed body that does not decompress, ...
            reason = exc.__cause__ or exc
            return _error(400, f"request body cannot be read: {type(reason).__name__}: {reason}")
        except Exception as exc:  # a server fault: JSON like every other answer, logged once
            log.error("request %s %s failed", request.method, request.path, exc_info=exc)
            return _error(500, f"internal error: {type(exc).__name__}: {first_line(exc)}")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token is not None and request.path not in _OPEN_PATHS:
            supplied = request.headers.get("Authorization", "")
            scheme, _, credential = supplied.partition(" ")
            # aiohttp hands undecodable header bytes over as surrogates: compare the raw bytes.
            supplied_bytes = credential.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(supplied_bytes, self._token):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def _routes(self) -> None:
        router = self.app.router
        get = router.add_get  # answers HEAD too

        def add(path: str, handler: Handler) -> None:
            router.add_post(path, handler, expect_handler=self._expect)

        # The router tries routes in order: inference, the hot path, comes first.
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            add(prefix + "/infer", self._infer)
        get("/v2/health/live", self._live)
        get("/v2/health/ready", self._ready)
        get("/v2", self._server_metadata)
        add("/v2/repository/index", self._repository_index)
        add("/v2/repository/models/{model}/load", self._repository_control)
        add("/v2/repository/models/{model}/unload", self._repository_control)
        get("/v2/models/stats", self._all_stats)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            get(prefix, self._model_metadata)
            get(prefix + "/ready", self._model_ready)
            get(prefix + "/config", self._model_config)
            get(prefix + "/stats", self._model_stats)
        get("/v2/systemsharedmemory/status", self._shm_status)
        get("/v2/systemsharedmemory/region/{name}/status", self._shm_status)
        add("/v2/systemsharedmemory/region/{name}/register", self._shm_register)
        add("/v2/systemsharedmemory/unregister", self._shm_unregister)
        add("/v2/systemsharedmemory/region/{name}/unregister", self._shm_unregister)
        get("/metrics", self._metrics)

    async def _expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: a body over the limit is refused before the client sends
        it (aiohttp's default answers 100 Continue whatever the size)."""
        # aiohttp calls this before the middlewares, so errors are answered here, as JSON.
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return _error(417, f"unsupported Expect header (only 100-continue): {ascii(expect)}")
        length = request.content_length
        if length is not None and length > self._max_body_bytes:
            return _error(413, f"request body too large (limit={self._max_body_bytes}, "
                               f"found={length})")
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the 100 is not the answer's start
        return None

    def _service(self, request: web.Request) -> ModelService:
        name = request.match_info["model"]
        service = self.services.get(name)
        if service is None:
            raise RequestError("unknown model", status=404, model=name,
                               available=sorted(self.services))
        version = request.match_info.get("version")
        if version not in (None, "", str(service.version)):
            raise RequestError("model version is not served", status=404, model=name,
                               version=version, served=service.version)
        return service

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await self._read_whole_body(request)
        if not raw.strip():
            return {}
        value = parse_json(raw)
        if not isinstance(value, dict):
            raise RequestError("request body must be a JSON object")
        return value

    # -- health and metadata ------------------------------------------------------------

    async def _live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        ready = bool(self.services) and all(s.ready for s in self.services.values())
        return web.Response(status=200 if ready else 400)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "edge-agent", "version": __version__,
                                  "extensions": EXTENSIONS})

    async def _model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._service(request).metadata())

    async def _model_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._service(request).ready else 400)

    async def _model_config(self, request: web.Request) -> web.Response:
        return web.json_response(self._service(request).config())

    async def _model_stats(self, request: web.Request) -> web.Response:
        return web.json_response({"model_stats": [self._service(request).stats()]})

    async def _all_stats(self, request: web.Request) -> web.Response:
        return web.json_response({"model_stats": [s.stats() for s in self.services.values()]})

    async def _repository_index(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        only_ready = body.get("ready", False)
        if not isinstance(only_ready, bool):
            raise RequestError("'ready' must be true or false", found=repr(only_ready))
        entries = []
        for service in self.services.values():
            if only_ready and not service.ready:
                continue
            entries.append({"name": service.name, "version": str(service.version),
                            "state": "READY" if service.ready else "UNAVAILABLE",
                            "reason": "" if service.ready else "not ready"})
        return web.json_response(entries)

    async def _repository_control(self, request: web.Request) -> web.Response:
        # As Triton with model control mode "none": the served set is fixed by configuration.
        service = self._service(request)
        raise RequestError("explicit model load and unload are not allowed: the daemon serves "
                           "the model store's current version (install a bundle to change it)",
                           model=service.name)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._metrics_render is not None:
            body = self._metrics_render()
        else:
            body = b"".join(s.metrics.render() for s in self.services.values())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- inference ----------------------------------------------------------------------

    async def _infer(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        service = self._service(request)
        metrics = service.metrics
        if not service.ready:
            service.rejected("rejected")
            raise NotServing("model is not ready", model=service.name)
        try:
            body = await self._read_body(request)
        except (RequestError, web.HTTPRequestEntityTooLarge, RequestPayloadError):
            service.rejected("invalid")  # counted like any refused request (chunked too large)
            raise
        metrics.inflight(1)
        try:
            try:
                decoded = decode_request(body, request.headers.get(HEADER_LENGTH), service.inputs,
                                         service.outputs, self.shm)
                future = service.batcher.submit(decoded.inputs, priority=decoded.priority,
                                                timeout_us=decoded.timeout_us)
            except (RequestError, InputError):
                service.rejected("invalid")
                raise
            except (QueueFull, NotServing):
                service.rejected("rejected")
                raise
            except Exception:
                service.rejected("failure")  # a fault of ours, still counted
                raise
            result = await future
            # The version that computed it: during a swap, the old one may still answer.
            version = result.version if result.version is not None else service.version
            payload, headers = encode_response(decoded, result.outputs, model_name=service.name,
                                               model_version=str(version))
        finally:
            metrics.inflight(-1)
        metrics.observe_request(time.perf_counter() - started)
        return web.Response(body=payload, headers=headers)

    async def _read_whole_body(self, request: web.Request) -> bytes:
        """The whole body as bytes, decompressed when it was sent compressed."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ENCODINGS:
            raise RequestError("unsupported Content-Encoding", status=415, found=encoding,
                               supported=list(ENCODINGS))
        raw = await request.read()
        return raw if encoding == "identity" else decode_body(raw, encoding, self._max_body_bytes)

    async def _read_body(self, request: web.Request) -> bytes | Body:
        """The request body. With a Content-Length, the pieces the parser hands over (bytes
        objects made for this request, so nothing else writes to them) are kept by reference
        (:mod:`agent.scattered`: joining them would copy the whole body once more on the event
        loop); chunked and compressed bodies go through aiohttp's reader, which enforces the
        size limit itself."""
        length = request.content_length
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity" or length is None:
            # Compressed (tritonclient's request_compression_algorithm): aiohttp's own decoding
            # is off (it answered encodings it knows but cannot decode, zstd or br without
            # Brotli, with a plain-text 400 before any handler ran); the compressed size is
            # bounded by aiohttp's reader, the decompressed one by decode_body. Chunked: the
            # reader enforces the size limit.
            return await self._read_whole_body(request)
        if length > self._max_body_bytes:
            raise RequestError("request body too large", status=413, limit=self._max_body_bytes,
                               found=length)
        pieces: list[bytes] = []
        small = bytearray()  # consecutive small pieces, joined as they arrive
        received = 0
        content = request.content
        while received < length:
            chunk, _ = await content.readchunk()  # one received piece, never a join of several
            if not chunk:
                raise RequestError("request body ended early", expected=length, found=received)
            received += len(chunk)
            if received > length:
                raise RequestError("request body longer than its Content-Length",
                                   expected=length)
            if len(chunk) >= _SMALL_PIECE_BYTES and not small:
                pieces.append(chunk)
                continue
            # A client that trickles its body (a byte per TCP segment) would otherwise leave one
            # piece per segment: hundreds of thousands of objects, and views of each to decode.
            small += chunk
            if len(small) >= _SMALL_PIECE_BYTES:
                pieces.append(bytes(small))
                small.clear()
        if small:
            pieces.append(bytes(small))
        return Body(pieces)

    # -- system shared memory -----------------------------------------------------------

    async def _shm_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.shm.status(request.match_info.get("name")))

    async def _shm_register(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        key, offset, byte_size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str) or not isinstance(byte_size, int):
            raise RequestError("register needs 'key' (a string) and 'byte_size' (an integer)",
                               found=body)
        self.shm.register(request.match_info["name"], key, offset, byte_size)
        return web.Response(status=200)

    async def _shm_unregister(self, request: web.Request) -> web.Response:
        self.shm.unregister(request.match_info.get("name"))
        return web.Response(status=200)
