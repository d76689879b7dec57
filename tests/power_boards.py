"""Fake Jetson boards for the power tests: every profile in every JetPack release it runs,
written under ``tmp_path`` by ``power/sim/tree.py``."""

from __future__ import annotations

import threading
from pathlib import Path

from power.profiles import PROFILES, BoardProfile, profile
from power.sim.tree import FakeTree, write_tree

BOARD_RELEASES: list[tuple[str, int]] = [(name, jetpack) for name, board in PROFILES.items()
                                         for jetpack in board.jetpacks]
"""(profile name, JetPack major) for every layout the tree writer makes."""


def board_ids() -> list[str]:
    return [f"{name}-jp{jetpack}" for name, jetpack in BOARD_RELEASES]


def fake_board(tmp_path: Path, name: str = "orin-nano", jetpack: int = 6, **options: object
               ) -> FakeTree:
    board: BoardProfile = profile(name)
    return write_tree(tmp_path / f"{board.name}-jp{jetpack}", board, jetpack,
                      **options)  # type: ignore[arg-type]


def serve_helper(helper: object, path: Path) -> tuple[threading.Event, threading.Thread]:
    """Run a privileged power helper (``power.helper.PowerHelper``) on a thread, listening at
    ``path`` as the helper's own command does; set the event and join the thread to stop it."""
    from power.helper import listening_socket

    listener = listening_socket(path, environ={})
    stop = threading.Event()

    def serve() -> None:
        try:
            helper.serve(listener, stop=stop)  # type: ignore[attr-defined]
        finally:
            listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return stop, thread
