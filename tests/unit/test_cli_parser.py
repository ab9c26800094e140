"""The command line's own parsing (no run): ``convert`` hands every argument to the conversion tools, --help included
(argparse's REMAINDER let a leading option escape, so ``megatron-dppo convert --help`` failed with exit 2), while
other commands still refuse arguments they do not know."""
import pytest

from megatron_dppo import cli


def test_convert_help_lists_the_tools(capsys):
    assert cli.main(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert "megatron-to-hf" in out and "megatron-to-peft" in out and "gguf-to-hf" in out


def test_other_commands_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
