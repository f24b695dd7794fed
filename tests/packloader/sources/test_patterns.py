"""packloader.sources.patterns: suffixes, brace / glob patterns, directories."""
from __future__ import annotations

import os

import pytest

from packloader.errors import DataError
from packloader.sources import expand_braces, resolve_sources, shard_format
from tests.packloader.conftest import random_sequences


def test_expand_braces():
    assert expand_braces("shard-{000..003}.tar") == [f"shard-00{i}.tar" for i in range(4)]
    assert expand_braces("s{8..11}") == ["s8", "s9", "s10", "s11"]
    assert expand_braces("{a,b}-{1,2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("x{a,b{c,d}}y") == ["xay", "xbcy", "xbdy"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("{0..10..5}") == ["0", "5", "10"]
    assert expand_braces("{a..c}") == ["a", "b", "c"]
    assert expand_braces("plain{}") == ["plain{}"]
    assert expand_braces("no-braces.arrow") == ["no-braces.arrow"]
    assert expand_braces("{1..010}") == [f"{i:03d}" for i in range(1, 11)]
    assert expand_braces("{abc}.arrow") == ["{abc}.arrow"]  # neither ',' nor '..': text
    assert expand_braces("a\\{1,2}") == ["a\\1", "a\\2"]  # a backslash is a path character, not an escape


def test_expand_braces_is_webdatasets():
    """The same patterns mean the same shards here and in webdataset (both use braceexpand)."""
    braceexpand = pytest.importorskip("braceexpand")
    for p in ["shard-{000..127}.tar", "{a,b}{1..3}", "s{0..20..5}-{x,y{1,2}}", "{z..w}"]:
        assert expand_braces(p) == list(braceexpand.braceexpand(p))


@pytest.mark.parametrize("pattern", ["shard-{000..003.arrow", "shard-000}.arrow"])
def test_unbalanced_braces_name_the_pattern(tmp_path, pattern):
    with pytest.raises(DataError, match="unbalanced braces") as e:
        resolve_sources(str(tmp_path / pattern))
    assert pattern in str(e.value)
    literal = tmp_path / pattern  # a file of that very name is taken as it is
    literal.write_bytes(b"")
    assert resolve_sources(str(literal)) == [str(literal)]


def test_resolve_sources(shard_factory):
    paths, _ = shard_factory.many("arrow", n_shards=4, n_seqs=3)
    root = shard_factory.root
    tar = shard_factory.tar("x/t.tar", random_sequences(2))
    (root / "notes.txt").write_text("not a shard")
    assert resolve_sources([str(root / "shard-{000..003}.arrow")]) == paths
    assert resolve_sources(str(root / "shard-00[12].arrow")) == paths[1:3]
    # a directory: its shards, sorted; duplicates dropped keeping the first
    assert resolve_sources([paths[3], str(root)]) == [paths[3]] + paths[:3]
    assert resolve_sources([str(root / "**" / "*.tar")]) == [tar]
    with pytest.raises(DataError, match="no such shard file"):
        resolve_sources([str(root / "shard-{000..009}.arrow")])
    with pytest.raises(DataError, match="matches no shard file"):
        resolve_sources([str(root / "*.parquet")])
    with pytest.raises(DataError, match="unsupported shard suffix"):
        resolve_sources([str(root / "notes.txt")])


def test_shard_format():
    assert shard_format("a.ARROW") == "arrow" and shard_format("a.feather") == "arrow"
    assert shard_format("a.parquet") == "parquet" and shard_format("x/a.tar") == "tar"
    with pytest.raises(DataError, match="a.csv"):
        shard_format("a.csv")


def test_one_file_under_several_names_is_read_once_with_a_warning(tmp_path, monkeypatch):
    """Issue 36, defect 3: ``pack b0.arrow ./b0.arrow`` (or absolute vs relative, a symlink, a hard link,
    overlapping globs) used to pack a 20-sequence file as 40 sequences, without a word."""
    import warnings

    from packloader.pack_writer import pack_dataset
    from tests.packloader.conftest import random_sequences, write_arrow

    monkeypatch.chdir(tmp_path)
    write_arrow("b0.arrow", random_sequences(20, seed=0, max_len=50))
    write_arrow("b1.arrow", random_sequences(7, seed=1, max_len=50))
    os.symlink("b0.arrow", "link.arrow")
    os.link("b0.arrow", "hard.arrow")
    cases = [  # (names, what is read, the other name of b0.arrow the warning must give)
        (["b0.arrow", "./b0.arrow", "b1.arrow"], ["b0.arrow", "b1.arrow"], "./b0.arrow"),
        (["b0.arrow", str(tmp_path / "b0.arrow"), "b1.arrow"], ["b0.arrow", "b1.arrow"], str(tmp_path / "b0.arrow")),
        (["link.arrow", "b1.arrow", "b0.arrow"], ["link.arrow", "b1.arrow"], "b0.arrow"),
        (["hard.arrow", "b0.arrow", "b1.arrow"], ["hard.arrow", "b1.arrow"], "b0.arrow"),
        (["b*.arrow", "./*0.arrow"], ["b0.arrow", "b1.arrow"], "./b0.arrow"),
    ]
    for names, read, other in cases:
        with pytest.warns(UserWarning, match="read once") as rec:
            assert resolve_sources(names) == read
        assert f"{other!r}" in str(rec[0].message), str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_sources(["b0.arrow", "b0.arrow", "b1.arrow"]) == ["b0.arrow", "b1.arrow"]  # one name: no warning
    with pytest.warns(UserWarning, match=r"'b0\.arrow' = '\./b0\.arrow'"):
        rep = pack_dataset(["b0.arrow", "./b0.arrow"], "out", capacity=64, quiet=True)
    assert rep.sequences == 20
