"""PendingFile and DiskFullError: publish when complete, nothing left after a full disk, errors
that survive being sent between processes."""

import errno
import os
import pickle

import pytest

import torchpipe as tp
from tests.disk_limits import MORE_THAN_LIMIT, no_room  # noqa: F401 - no_room is a fixture
from torchpipe.errors import add_note
from torchpipe.storage.pending_file import PendingFile, write_file


def test_a_file_appears_under_its_name_only_when_published(tmp_path):
    path = str(tmp_path / "f")
    pending = PendingFile.create(path, "test")
    pending.write(b"abc")
    pending.flush(sync=True)
    assert os.listdir(tmp_path) == [os.path.basename(pending.temp)] and pending.temp.startswith(
        path + ".tmp-"
    )
    pending.publish()
    assert os.listdir(tmp_path) == ["f"] and open(path, "rb").read() == b"abc"
    discarded = PendingFile.create(path, "test")
    discarded.write(b"xyz")
    discarded.discard()
    assert os.listdir(tmp_path) == ["f"] and open(path, "rb").read() == b"abc"


def test_write_file_on_a_full_disk_leaves_the_old_file_and_no_temporary_one(no_room):
    path = os.path.join(no_room.directory, "manifest.json")
    write_file(path, b"old", "test(manifest)")
    no_room.check(
        no_room.run(write_file, path, b"x" * MORE_THAN_LIMIT, "test(manifest)"), "test(manifest)"
    )
    assert no_room.files() == ["manifest.json"] and open(path, "rb").read() == b"old"


def test_disk_full_error_keeps_its_fields_and_notes_through_pickle():
    error = tp.DiskFullError(
        "save(/d): disk full after writing 3 bytes to /d/f: [Errno 28] No space left on device",
        errno.ENOSPC,
        "save(/d)",
        "/d/f",
        3,
    )
    add_note(error, "raised in torchpipe save(/d) while writing element 4 to shard 0")
    copy = pickle.loads(pickle.dumps(error))
    assert (
        isinstance(copy, OSError)
        and copy.errno == errno.ENOSPC
        and copy.strerror == os.strerror(errno.ENOSPC)
    )
    assert (copy.stage, copy.filename, copy.written, str(copy)) == (
        "save(/d)",
        "/d/f",
        3,
        str(error),
    )
    assert copy.__notes__ == error.__notes__


def test_disk_full_error_rebuilt_from_its_text_keeps_its_errno():
    # torch's DataLoader re-raises a worker's exception as type(e)(text around str(e)).
    text = "Caught DiskFullError in DataLoader worker process 0.\nOriginal Traceback ...: [Errno 27] File too large"
    assert tp.DiskFullError(text).errno == errno.EFBIG and str(tp.DiskFullError(text)) == text
    assert tp.DiskFullError("no number").errno is None


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_other_errors_are_not_disk_full_errors(tmp_path, code):
    class Failing:
        closed = False

        def write(self, data):
            raise OSError(code, os.strerror(code))

    with pytest.raises(OSError) as raised:
        PendingFile(Failing(), str(tmp_path / "t"), str(tmp_path / "f"), "test").write(b"x")
    assert not isinstance(raised.value, tp.DiskFullError) and raised.value.errno == code
