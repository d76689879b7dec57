"""The device's model store (design §5.2): installed versions, their engine caches, the pointer.

Layout under the state directory::

    models/<name>/<version>/    an extracted, verified bundle: manifest.json, manifest.sig,
                                model.onnx, optional engines/<fingerprint>.plan, ...
                                Immutable once installed.
    engines/<name>/<version>/   plans and timing caches built on this device by the TensorRT
                                backend; the store only creates it and deletes it with the version
    current                     the pointer: {"schema_version": 1,
                                              "current": {"name": ..., "version": ...} | null,
                                              "previous": {"name": ..., "version": ...} | null}

Crash safety comes from doing every change as one rename:

- a version is extracted into a hidden staging directory beside its final name and renamed into
  place only when every member's hash matched (``VerifiedBundle.extract``);
- a version is deleted by renaming it to a hidden name first, then removing that;
- the pointer is written to a temporary file, fsynced, renamed over ``current`` and the directory
  fsynced (agent/fsutil.py).

So after a crash or power loss ``models/`` holds only complete versions; what a crash can leave is
hidden staging or deletion directories, a pointer temporary file, or an engine cache whose version is
gone, and opening the store removes them. Bytes can still rot on disk: :meth:`ModelStore.load`
re-hashes every file and re-checks the signature before a version is served.

A fresh state directory gets a pointer naming nothing; after that a missing or unreadable pointer is
an error, never "no model", so a damaged store is reported instead of silently serving nothing.

Modules: ``store`` (the :class:`ModelStore` API), ``pointer`` (the ``current`` file and checked
model references), ``verify`` (re-verifying an installed version), ``lock`` (one owner per state
directory), ``files`` (file operations that fail as ``StoreError``).
"""

from agent.store.lock import LOCK_FILE, remove_store
from agent.store.pointer import POINTER_FILE, ModelRef
from agent.store.store import ENGINE_CACHE_DIR, MIN_KEEP_VERSIONS, MODELS_DIR, ModelStore

__all__ = [
    "ENGINE_CACHE_DIR",
    "LOCK_FILE",
    "MIN_KEEP_VERSIONS",
    "MODELS_DIR",
    "POINTER_FILE",
    "ModelRef",
    "ModelStore",
    "remove_store",
]
