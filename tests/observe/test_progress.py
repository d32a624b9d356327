import io
import sys
import warnings

import pytest

import torchpipe as tp
from torchpipe.observe.progress import ProgressBar, missing_tqdm_unwarned
from torchpipe.testing import as_in_a_fresh_process


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _terminal(monkeypatch):
    """sys.stderr as a terminal; patched in the test's body (pytest sets sys.stderr between phases)."""
    pytest.importorskip("tqdm")
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_cache_and_snapshot_fills_draw_a_bar_on_a_terminal(tmp_path, monkeypatch):
    terminal = _terminal(monkeypatch)
    assert list(tp.range(7).cache(tmp_path / "c")) == list(range(7))
    assert f"cache({tmp_path / 'c'})" in terminal.getvalue() and "7/7" in terminal.getvalue()
    assert list(tp.range(9).snapshot(tmp_path / "s")) == list(range(9))
    assert f"snapshot({tmp_path / 's'})" in terminal.getvalue() and "9/9" in terminal.getvalue()
    drawn = terminal.getvalue()
    # a read writes nothing: no bar
    assert list(tp.range(9).snapshot(tmp_path / "s")) == list(range(9))
    assert terminal.getvalue() == drawn


def test_unknown_totals_count_without_a_total(monkeypatch):
    terminal = _terminal(monkeypatch)
    with ProgressBar("work", tp.UNKNOWN) as bar:
        bar.update(3)
    assert "work: 3" in terminal.getvalue()


def test_silent_when_not_a_terminal(tmp_path, monkeypatch):
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    bar = ProgressBar("work", 10)
    bar.update(10)
    bar.close()
    assert not bar.active and piped.getvalue() == ""


def test_without_tqdm_one_warning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = Terminal()
    with as_in_a_fresh_process():
        with pytest.warns(UserWarning, match=r"pip install 'torchpipe\[progress\]'"):
            ProgressBar("work", 10, stream=stream).update()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not ProgressBar("work", 10, stream=stream).active
    assert stream.getvalue() == ""


def test_missing_tqdm_unwarned_warns_again_in_the_block_only(monkeypatch):
    """progress.missing_tqdm_unwarned(), the seam of testing.as_in_a_fresh_process."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = Terminal()
    with as_in_a_fresh_process():
        with pytest.warns(UserWarning, match="tqdm"):
            ProgressBar("work", 10, stream=stream).update()
        with missing_tqdm_unwarned(), pytest.warns(UserWarning, match="tqdm"):
            ProgressBar("work", 10, stream=stream).update()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said in this process already, as before the block
            ProgressBar("work", 10, stream=stream).update()
