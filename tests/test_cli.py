"""The two commands: ``python -m fxlora`` says what fxlora is and where to go next, and
``python -m fxlora.demo --help`` reads as a command's help."""

import pytest

import fxlora
from fxlora import __main__ as about
from fxlora import demo


def test_about_names_version_demo_and_docs(capsys):
    about.main()
    out = capsys.readouterr().out
    assert f"fxlora {fxlora.__version__}" in out
    assert "python -m fxlora.demo" in out
    assert "docs/usage.md" in out


def test_demo_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fxlora.demo ")
    assert "``" not in out
    for action in demo.parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


@pytest.mark.parametrize("argv", [["--rows", "1"], ["--length", "0"], ["--repeats", "0"], ["--rows", "x"]])
def test_demo_refuses_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and ("at least" in err or "whole number" in err), err
