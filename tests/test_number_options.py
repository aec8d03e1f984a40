"""The command line's numbers are checked where they are given: inf, nan, negative and absurd
values of --profile-memory, --device-memory, --steps, --skip, --rank-timeout and
--fail-on-regression are refused with one line naming the flag, exit 2, before anything runs.
(`--profile-memory inf` was accepted, then raised OverflowError inside the audited program, blamed
on it: exit 3; `--device-memory inf|nan|1e-30` was accepted and silently ignored.)"""
from __future__ import annotations

import pytest

from auditor import cli


@pytest.mark.parametrize("args, flag", [
    (["run", "examples/clean.py:step", "--profile-memory", "inf"], "--profile-memory"),
    (["run", "examples/clean.py:step", "--profile-memory", "nan"], "--profile-memory"),
    (["run", "examples/clean.py:step", "--profile-memory", "-1"], "--profile-memory"),
    (["run", "examples/clean.py:step", "--profile-memory", "1e300"], "--profile-memory"),
    (["run", "examples/clean.py:step", "--device-memory", "inf"], "--device-memory"),
    (["run", "examples/clean.py:step", "--device-memory", "1e-30"], "--device-memory"),
    (["analyze", "x.json", "--device-memory", "nan"], "--device-memory"),
    (["run", "examples/clean.py:step", "--steps", str(10 ** 12)], "--steps"),
    (["run", "examples/clean.py:step", "--skip", "-1"], "--skip"),
    (["run", "examples/clean.py:step", "--rank-timeout", "inf"], "--rank-timeout"),
    (["diff", "a", "b", "--fail-on-regression", "nan"], "--fail-on-regression"),
])
def test_impossible_numbers_are_refused_naming_the_flag(args: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("audit: error: Invalid value for ") and f"'{flag}'" in err


def test_sizes_in_range_are_taken() -> None:
    """1 MiB and 1 PiB are the ends of what --device-memory takes (what the allocator simulator
    is given: auditor.command_options' bounds)."""
    for given in ("0.0009765625", "1048576", "80"):
        assert cli.Measure(cli.MIN_GIB, cli.MAX_GIB, "GiB").convert(given, None, None) == float(given)
