"""Every command's --help at 80 columns: each flag's names whole, its help text all there, no line
past 80 (the commands and their options are enumerated from the Typer app)."""

from __future__ import annotations

import re

import pytest
import typer

from spark_cli import cli
from spark_cli.commands.help import SparkCommand

WIDTH = 80


def _commands() -> list[tuple[tuple[str, ...], object]]:
    """(path, click command) of the app and every command and subcommand under it."""
    cli._register()
    out = []

    def walk(path: tuple[str, ...], command) -> None:
        out.append((path, command))
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk((*path, name), sub)

    walk((), typer.main.get_command(cli.app))
    return out


COMMANDS = _commands()


def _help(path: tuple[str, ...], monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert cli.main([*path, "--help"]) == 0
    return capsys.readouterr().out


def _whole(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def test_every_command_is_listed() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"serve", "chat", "bench", "plan", "profile", "profile run", "profile simulate", "demo"} <= names


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "spark" for p, _ in COMMANDS])
def test_help_shows_every_flag_whole_at_80_columns(path, command, monkeypatch, capsys) -> None:
    out = _help(path, monkeypatch, capsys)
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    assert "…" not in out
    words = set(re.sub(r"[│╭╮╰╯─]", " ", out).split())
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("-"):
                assert _whole(name, out), f"spark {' '.join(path)} --help: {name} not whole"
        for word in (param.help or "").split():  # the help text wraps, nothing of it is cut
            assert word in words, f"spark {' '.join(path)} --help: {word!r} of {param.opts[0]}'s help missing"


def test_commands_render_their_help_with_spark_command() -> None:
    """A new command that forgets cls=SparkCommand gets typer's panels, which cut names at 80 columns."""
    leaves = {" ".join(p): c for p, c in COMMANDS if not hasattr(c, "commands")}
    assert [name for name, c in leaves.items() if not isinstance(c, SparkCommand)] == []
