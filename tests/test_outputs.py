"""Output paths: only regular files are replaced, symlinks are followed, modes and umask are kept,
leftover temp files go, failed saves keep their data in a recovery file, locks time out."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from spark_cli.files import atomic, recovery
from spark_cli.files.atomic import atomic_write_text, check_output, check_folder, file_lock
from spark_cli.errors import LockTimeout, OutputError, SaveError, SparkError


def _one_line(e: SparkError) -> str:
    line = e.one_line()
    assert "\n" not in line
    return line


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "under_a_file", "missing_folder"])
def test_refused_outputs_are_one_line_and_untouched(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        want = "is a FIFO"
    elif kind == "device":
        path = tmp_path / "null-link"
        path.symlink_to("/dev/null")  # a link to a device: the device is the target
        want = "is a device"
    elif kind == "directory":
        path = tmp_path / "d"
        path.mkdir()
        want = "is a directory"
    elif kind == "under_a_file":
        (tmp_path / "f").write_text("x")
        path = tmp_path / "f" / "out.json"
        want = "is a file, not a folder"
    else:
        path = tmp_path / "no" / "such" / "out.json"
        want = "does not exist"
    before = os.lstat(path).st_mode if os.path.lexists(path) else None
    with pytest.raises(OutputError) as e:
        check_output(path, "-o")
    assert want in _one_line(e.value) and _one_line(e.value).startswith(f"-o {path}")
    with pytest.raises(OutputError):
        atomic_write_text(path, "data", "-o", make_parent=False)
    after = os.lstat(path).st_mode if os.path.lexists(path) else None
    assert before == after  # nothing replaced
    assert not (tmp_path / "no").exists()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_symlink_is_followed_and_kept(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    written = atomic_write_text(link, "new", "-o")
    assert written == target
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


def test_new_files_follow_the_umask_and_rewrites_keep_their_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "new.json", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o644
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.json", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "private.json").st_mode) == 0o600
        shared = tmp_path / "shared.json"
        shared.write_text("x")
        os.chmod(shared, 0o664)
        atomic_write_text(shared, "y")  # umask 077 must not make a shared file private
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o664 and shared.read_text() == "y"
    finally:
        os.umask(old)


def test_leftover_temp_files_are_removed_at_the_next_write(tmp_path):
    target = tmp_path / "plan.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".plan.json.{dead}.abc123.tmp"
    live = tmp_path / f".plan.json.{os.getpid()}.def456.tmp"
    old_style = tmp_path / ".plan.json.zz9x.tmp"
    for p in (stale, live, old_style):
        p.write_text("half")
    os.utime(old_style, (0, 0))
    other = tmp_path / ".other.json.1.x.tmp"
    other.write_text("not ours")
    atomic_write_text(target, "{}")
    assert not stale.exists() and not old_style.exists()
    assert live.exists() and other.exists()  # a live writer's file and another file's stay


def test_disk_full_is_a_save_error_and_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "p.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(SaveError) as e:
        atomic_write_text(target, "new", "--json")
    assert "the disk is full" in _one_line(e.value) and e.value.exit_code == 1
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left


def test_failed_save_writes_a_recovery_file_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    out = tmp_path / "out" / "merged.json"
    (tmp_path / "out").mkdir()
    beside = tmp_path / "models"
    beside.mkdir()

    def write(p):
        if p == out:
            raise SaveError(f"-o {p}: cannot write (the disk is full)")
        return atomic_write_text(p, "gathered")

    with pytest.raises(SaveError) as e:
        recovery.save_or_recover(write, out, beside=beside)
    kept = list(beside.glob("merged.recovered-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == "gathered"
    assert str(kept[0]) in _one_line(e.value) and "the disk is full" in _one_line(e.value)

    def nowhere(p):
        raise SaveError(f"{p}: cannot write (the disk is full)")

    with pytest.raises(SaveError, match="no recovery file could be written"):
        recovery.save_or_recover(nowhere, out, beside=beside)


def test_recovery_falls_back_to_spark_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    out = tmp_path / "merged.json"

    def write(p):
        if p.parent != tmp_path / "home" / "recovery":
            raise SaveError(f"{p}: cannot write (Read-only file system)")
        return atomic_write_text(p, "gathered")

    with pytest.raises(SaveError) as e:
        recovery.save_or_recover(write, out, beside=tmp_path)
    (kept,) = (tmp_path / "home" / "recovery").iterdir()
    assert kept.read_text() == "gathered" and str(kept) in e.value.one_line()


def test_lock_waits_with_a_message_then_times_out(tmp_path):
    path = tmp_path / "m.gguf.spark-profile.json"
    said = []
    with file_lock(path):
        with pytest.raises(LockTimeout) as e:
            with file_lock(path, timeout=0.3, on_wait=said.append):
                pass
    assert said and "waiting for" in said[0] and "another Spark process" in said[0]
    assert "still held by another process after 0 s" in _one_line(e.value) or "after" in _one_line(e.value)
    with file_lock(path, timeout=0.3):  # free again
        pass


def test_lock_of_another_user_is_opened_read_only(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    (tmp_path / "p.json.lock").write_text("")
    real_open = open

    def no_write(p, mode="r", *a, **k):
        if str(p).endswith(".lock") and mode != "r":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(p, mode, *a, **k)

    monkeypatch.setattr("builtins.open", no_write)
    with file_lock(path, timeout=1):
        pass
    (tmp_path / "p.json.lock").unlink()
    with pytest.raises(SaveError, match="cannot open"):
        with file_lock(path, timeout=1):
            pass


def test_out_dir_must_be_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_folder(f, "--out-dir")
    assert check_folder(tmp_path / "new", "--out-dir").is_dir()


def test_spark_home_pointing_at_a_file(tmp_path, monkeypatch):
    from spark_cli.files.paths import models_dir

    f = tmp_path / "home"
    f.write_text("x")
    monkeypatch.setenv("SPARK_HOME", str(f))
    with pytest.raises(SparkError) as e:
        models_dir()
    assert "SPARK_HOME" in _one_line(e.value) and "is a file" in _one_line(e.value)
    monkeypatch.setenv("SPARK_HOME", str(f / "below"))
    with pytest.raises(SparkError, match="cannot create folder"):
        models_dir()
