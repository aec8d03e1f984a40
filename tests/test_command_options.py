"""The commands' options records (auditor.command_options): made once by the CLI, validated as its
flags are when made from keywords, serialised once for a launch's ranks, --verify's re-runs and
the audited child, and refused in one line (exit 2) where they are wrong."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from auditor import app, cli
from auditor.command_options import AnalyzeOptions, OptionError, RunOptions, decode, encode


@pytest.mark.parametrize("given, option", [
    ({"steps": 0}, "steps"), ({"steps": 10 ** 12}, "steps"), ({"skip": -1}, "skip"),
    ({"profile_memory": float("nan")}, "profile_memory"), ({"device_memory": float("inf")}, "device_memory"),
    ({"device_memory": 1e-30}, "device_memory"), ({"trace_size": 0.0}, "trace_size"),
    ({"rank_timeout": 1e9}, "rank_timeout"), ({"fail_on": "fatal"}, "fail_on"), ({"stepz": 3}, "stepz"),
    ({"steps": "3"}, "steps"), ({"verify": "yes"}, "verify"),
])
def test_a_record_made_from_keywords_is_checked_as_the_flags_are(given: dict, option: str) -> None:
    with pytest.raises(OptionError) as e:
        RunOptions.checked(**given)
    assert e.value.option == option and "\n" not in str(e.value) and str(e.value).startswith(f"{option}: ")


def test_keywords_in_range_make_the_record() -> None:
    o = RunOptions.checked(steps=30, out="here", select=["host-sync"], device_memory=80, rehearse=True)
    assert (o.steps, o.out, o.select, o.device_memory, o.rehearse_mode) == (30, Path("here"), ("host-sync",), 80.0, "on")
    assert AnalyzeOptions.checked(source_roots=["src"], engine="dask").source_roots == (Path("src"),)
    with pytest.raises(OptionError):
        AnalyzeOptions.checked(engine="spark")


def test_the_record_travels_as_one_json_value_and_comes_back_equal() -> None:
    o = RunOptions(steps=7, skip=2, to_end=True, out=Path("o/p"), select=("a", "b"), profile=False, rehearse=False,
                   profile_memory=0.5, trace_size=12.0, device_memory=16.0, device="h100-sxm", digest=True)
    text = encode(o)
    assert json.loads(text)["out"] == "o/p" and "numerics" not in json.loads(text)  # (defaults left out)
    assert decode(text, RunOptions) == o
    assert decode("{}", RunOptions) == RunOptions()
    with pytest.raises(OptionError, match="no such option"):
        decode('{"nproc": 2}', RunOptions)


def _parsed(monkeypatch, *argv: str) -> tuple:
    """What `audit ARGV` hands app.run: (target, options, module, args)."""
    got: list = []
    monkeypatch.setattr(app, "run", lambda target, options, module=None, args=(): got.append(
        (target, options, module, tuple(args))) or 0)
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 0
    return got[0]


def test_the_cli_makes_the_record_its_defaults_are_the_records(monkeypatch) -> None:
    """Every flag is a field of the same name: no flag given is the record's defaults; flags given
    are their fields; `--options-json` hands the record over whole."""
    assert _parsed(monkeypatch, "run", "train.py") == ("train.py", RunOptions(), None, ())
    target, o, module, args = _parsed(monkeypatch, "run", "-m", "pkg.train", "--steps", "9", "--no-numerics",
                                      "--device-memory", "40", "--profile-memory", "2", "--trace-size", "64",
                                      "--select", "host-sync", "--out", "d", "--", "--lr", "1")
    assert (target, module, args) == ("--lr", "pkg.train", ("1",))  # (app.run joins them: click's split)
    assert o == RunOptions(steps=9, numerics=False, device_memory=40.0, profile_memory=2.0, trace_size=64.0,
                           select=("host-sync",), out=Path("d"))
    passed = _parsed(monkeypatch, "run", "train.py", "--options-json", encode(o), "--", "x")
    assert passed == ("train.py", o, None, ("x",))


@pytest.mark.parametrize("argv, line", [
    (["run", "t.py", "--options-json", '{"steps": 2}', "--steps", "3"],
     "audit: error: --options-json holds every option: --steps cannot go with it"),
    (["run", "t.py", "--options-json", '{"steps": 0}'], "audit: error: --options-json: steps: expected `int` >= 1"),
    (["run", "t.py", "--options-json", "{"], "audit: error: --options-json: Input data was truncated"),
    (["run", "t.py", "--trace-size", "inf"],
     "audit: error: Invalid value for '--trace-size': inf is out of range: a number of MB, from 0.001 to "
     "1073741824 (1 PiB)"),
])
def test_a_wrong_record_is_one_line_and_exit_2(argv: list[str], line: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == line + "\n"
