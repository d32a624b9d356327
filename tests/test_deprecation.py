"""Renamed public names keep working: the new object, and one DeprecationWarning per old name."""

import warnings

import pytest

import torchpipe as tp
from torchpipe.deprecation import renamed_names


def test_an_old_name_gives_the_new_object_and_warns_the_first_time_only():
    new = object()
    getattr_ = renamed_names("pkg", {"old": "new"}, {"new": new})
    with pytest.warns(DeprecationWarning, match=r"pkg\.old is deprecated: it was renamed pkg\.new"):
        assert getattr_("old") is new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr_("old") is new


def test_a_name_neither_old_nor_defined_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'other'"):
        renamed_names("pkg", {"old": "new"}, {"new": 1})("other")
    with pytest.raises(AttributeError):
        tp.distributed.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "old, new",
    [
        ("Replica", "RankInfo"),
        ("current_replica", "current_rank_info"),
        ("current_shard", "current_share"),
        ("shard_files", "share_of_files"),
    ],
)
def test_distributed_names_renamed_for_one_word_per_idea(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # another test may have used it first
        assert getattr(tp.distributed, old) is getattr(tp.distributed, new)
    assert old not in tp.distributed.__all__ and new in tp.distributed.__all__
