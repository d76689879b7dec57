"""The updater's journal (agent/update/journal.py): a round trip, crash-safe writes, and journals
that are corrupt, empty, truncated or of a newer schema, which never stop the updater."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.update.journal import (
    JOURNAL_FILE,
    BundleAttempts,
    BundleId,
    Event,
    Journal,
    JournalDoc,
    Outcome,
    UpdateRecord,
)
from agent.update.states import UpdateState
from agent.update.updater import Updater, UpdateRequest
from tests.fakes.update_steps import FakeSteps, bundle_of, source

REPO_ROOT = Path(__file__).resolve().parent.parent
SHA = "ab" * 32


def full_doc() -> JournalDoc:
    bundle = BundleId(name="m", version=2, sha256=SHA)
    record = UpdateRecord(update_id="u1", kind="update", source="https://example/m-2.tar",
                          expected=BundleId(name="m"), bundle=bundle, attempt=2,
                          requested_at="2024-05-01T12:00:00.000Z", committed=False)
    outcome = Outcome(update_id="u0", kind="update", result="failed", reason="deadline",
                      state=UpdateState.WARMING, detail="too slow", at="2024-05-01T11:00:00.000Z",
                      bundle=bundle)
    return JournalDoc(
        state=UpdateState.CANARY, entered_at="2024-05-01T12:01:00.000Z", update=record,
        pending=None,
        history=[Event(at="2024-05-01T12:00:00.000Z", update_id="u1",
                       from_state=UpdateState.WARMING, to_state=UpdateState.CANARY)],
        bundles={SHA: BundleAttempts(name="m", version=2, sha256=SHA, attempts=2, failures=1,
                                     last_reason="deadline")},
        last_outcome=outcome)


def test_a_document_survives_a_round_trip(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.write(full_doc())
    loaded = journal.load()
    assert loaded.problem is None and loaded.existed
    assert loaded.doc == full_doc()
    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600
    assert json.loads(journal.path.read_text())["schema_version"] == 1


def test_no_journal_is_a_fresh_idle_one(tmp_path: Path) -> None:
    loaded = Journal(tmp_path).load()
    assert not loaded.existed and loaded.problem is None and loaded.moved_aside is None
    assert loaded.doc.state is UpdateState.IDLE and loaded.doc.update is None


def test_a_write_fsyncs_the_file_and_the_directory(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []  # whether each fsynced descriptor was a directory
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    Journal(tmp_path).write(full_doc())
    assert synced == [False, True]


def test_history_is_bounded_to_the_newest_entries(tmp_path: Path) -> None:
    journal = Journal(tmp_path, history_limit=3)
    doc = JournalDoc()
    for index in range(10):
        doc.history.append(Event(at=f"t{index}", update_id=None, from_state=UpdateState.IDLE,
                                 to_state=UpdateState.IDLE))
    journal.write(doc)
    assert [event.at for event in journal.load().doc.history] == ["t7", "t8", "t9"]


CRASH_BEFORE_RENAME = """
import os, sys
from pathlib import Path
from agent.update.journal import Journal, JournalDoc
from agent.update.states import UpdateState
os.replace = lambda *args: os._exit(9)  # the process dies between the temp write and the rename
Journal(Path(sys.argv[1])).write(JournalDoc(state=UpdateState.FAILED))
"""


def test_each_write_encodes_the_whole_document_as_it_is_now(tmp_path: Path) -> None:
    # The history entries are encoded once and kept: every write must still be the document
    # exactly as it is, through trims, repeats and awkward text.
    journal, doc = Journal(tmp_path, history_limit=5), full_doc()
    awkward = ['quote " backslash \\ newline \n tab \t', "\u00e9\u2603 \U0001f600", "", "}]"]
    for step in range(12):
        doc.history.append(Event(at=f"2024-05-01T12:00:{step:02d}.000Z", update_id=f"u{step}",
                                 from_state=UpdateState.DOWNLOADING,
                                 to_state=UpdateState.VERIFYING, reason="note",
                                 detail=awkward[step % len(awkward)]))
        if step % 3 == 0:
            doc.history.append(doc.history[-1])  # the same entry twice
        doc.state = UpdateState.VERIFYING if step % 2 else UpdateState.DOWNLOADING
        journal.write(doc)
        text = journal.path.read_text()
        assert json.loads(text) == doc.to_json()
        assert len(doc.history) <= 5 and journal.load().doc == doc
    doc.history.clear()
    journal.write(doc)
    assert json.loads(journal.path.read_text())["history"] == []


def test_a_crash_between_the_temporary_write_and_the_rename_keeps_the_old_journal(
        tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.write(full_doc())
    before = journal.path.read_bytes()
    child = subprocess.run([sys.executable, "-c", CRASH_BEFORE_RENAME, str(tmp_path)],
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=30)
    assert child.returncode == 9
    leftovers = [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    assert len(leftovers) == 1  # the complete temporary file the rename never moved
    assert journal.path.read_bytes() == before
    assert journal.load().doc == full_doc()  # a plain reader leaves the temporary file alone
    assert len([path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]) == 1
    loaded = journal.load(recover=True)
    assert loaded.problem is None and loaded.doc == full_doc()
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_a_reader_polling_the_journal_never_breaks_the_writer(tmp_path: Path) -> None:
    # A status command or a test may read while the daemon writes: the reader must not take the
    # writer's temporary file away between its write and its rename.
    journal, stop, problems = Journal(tmp_path), threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            loaded = Journal(tmp_path).load()
            if loaded.problem is not None:
                problems.append(loaded.problem)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(300):
            journal.write(full_doc())
    finally:
        stop.set()
        reader.join()
    assert problems == []
    assert journal.load().doc == full_doc()


def truncated(text: str) -> str:
    return text[: len(text) // 2]


def wrong_state(text: str) -> str:
    data = json.loads(text)
    data["state"] = "exploded"
    return json.dumps(data)


def bad_sha(text: str) -> str:
    data = json.loads(text)
    data["update"]["bundle"]["sha256"] = "not-a-digest"
    return json.dumps(data)


def working_without_update(text: str) -> str:
    data = json.loads(text)
    data["update"] = None
    return json.dumps(data)


def boolean_version(text: str) -> str:
    data = json.loads(text)
    data["bundles"][SHA]["version"] = True
    return json.dumps(data)


@pytest.mark.parametrize("damage", [
    lambda text: "", lambda text: "\x00\xff garbage", truncated, lambda text: "[]",
    lambda text: '{"schema_version": 0}', lambda text: json.dumps({"schema_version": "1"}),
    wrong_state, bad_sha, working_without_update, boolean_version,
], ids=["empty", "binary", "truncated", "not-an-object", "old-schema", "string-schema",
        "unknown-state", "bad-sha256", "working-without-update", "boolean-version"])
def test_an_unusable_journal_is_moved_aside_and_the_updater_starts_idle(tmp_path: Path,
                                                                        damage: object) -> None:
    journal = Journal(tmp_path)
    journal.write(full_doc())
    broken = damage(journal.path.read_text())  # type: ignore[operator]
    journal.path.write_text(broken)
    looked = journal.load()  # a plain reader names the problem and moves nothing
    assert looked.problem and looked.moved_aside is None and journal.path.read_text() == broken
    loaded = journal.load(recover=True)
    assert loaded.existed and loaded.problem
    assert loaded.doc.state is UpdateState.IDLE and loaded.doc.update is None
    assert loaded.moved_aside is not None and loaded.moved_aside.name.startswith(
        f"{JOURNAL_FILE}.corrupt-")
    assert loaded.moved_aside.read_text() == broken  # kept for forensics
    assert not journal.path.exists()


def test_a_journal_of_a_newer_schema_is_moved_aside_with_its_schema_named(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.path.write_text(json.dumps({"schema_version": 7, "state": "quantum"}))
    loaded = journal.load(recover=True)
    assert loaded.moved_aside is not None
    assert loaded.moved_aside.name.startswith(f"{JOURNAL_FILE}.schema-7-")
    assert "schema 7" in (loaded.problem or "") and loaded.doc.state is UpdateState.IDLE


def test_an_oversized_or_special_journal_is_moved_aside(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.path.write_bytes(b" " * (4 * 1024 * 1024 + 1))
    loaded = journal.load(recover=True)
    assert loaded.moved_aside is not None and "cannot be read" in (loaded.problem or "")


def test_the_updater_reports_a_corrupt_journal_and_still_updates(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_FILE).write_text('{"schema_version": 1, "state": "canary", "upd')
    steps = FakeSteps(tmp_path / "store")
    steps.set_serving(bundle_of(source("m", 1)))

    async def scenario() -> None:
        updater = Updater(state_dir=tmp_path, steps=steps)
        report = await updater.recover()
        assert report.action == "none" and report.found is UpdateState.IDLE
        assert report.journal_problem and "not valid JSON" in report.journal_problem
        assert report.moved_aside is not None and report.moved_aside.exists()
        status = updater.status()
        assert status["recovery"]["journal_problem"] == report.journal_problem
        assert status["history"][-1]["reason"] == "journal_unusable"
        answer = await updater.request(UpdateRequest(source=source("m", 2)))
        assert answer.result == "started"
        await updater.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    reloaded = Journal(tmp_path).load()
    assert reloaded.problem is None
    assert reloaded.doc.history[0].reason == "journal_unusable"
