"""Byte sizes: decimal and binary units, plain bytes, and clear errors; durations as the
commands print them."""
import pytest

from netdsl.errors import NetdslError
from netdsl.sizes import SizeError, format_bytes, format_seconds, parse_size


@pytest.mark.parametrize("text,expected", [
    ("12GB", 12 * 10**9), ("300MB", 300 * 10**6), ("1.5GiB", 3 * 2**29),
    ("512KiB", 512 * 1024), ("4096", 4096), ("4096B", 4096), ("12gb", 12 * 10**9),
    (" 2 MiB ", 2 * 2**20), ("1KB", 1000), ("1TiB", 2**40), ("2e9", 2 * 10**9),
    (".5GB", 5 * 10**8), (7, 7),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("12", None), ("", "cannot read"), ("GB", "cannot read"), ("-1GB", "cannot read"),
    ("12XB", "unknown unit"), ("12G", "did you mean GB or GiB"), ("0", "positive"),
    ("0.1B", "less than one byte"), ("1.2.3MB", "cannot read"), (0, "positive"),
    (True, "expected a size"),
])
def test_bad_sizes(text, fragment):
    if fragment is None:
        assert parse_size(text) == 12
        return
    with pytest.raises(SizeError, match=fragment) as e:
        parse_size(text, "--mem")
    assert isinstance(e.value, NetdslError)
    assert "--mem" in e.value.message


def test_format():
    assert format_bytes(1536) == "1.54 kB"  # decimal, as --mem takes budgets
    assert format_bytes(12 * 10**9) == "12.00 GB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize("s,text", [
    (0.0, "0.000 s"), (2.5, "2.500 s"), (1234.5, "1,234.500 s"), (0.2514, "0.251 s"),
    (0.0999, "99.90 ms"), (0.004123, "4.12 ms"), (0.00054, "0.540 ms"),
    (3.2e-5, "32.0 us"),
])
def test_durations_keep_their_digits(s, text):
    """A small network's step on a GPU profile is microseconds: printed so, not 0.000 s."""
    assert format_seconds(s) == text
