"""Errors users see as one line: the CLI prints them without a traceback."""

from __future__ import annotations


class MeshoptError(Exception):
    """Base of every error meshopt reports to a user."""


class InputError(MeshoptError):
    """Bad user input: a file, an argument, a value. Names where the problem is."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None):
        self.message = message
        self.source = source
        self.line = line
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.source is not None:
            where = self.source if self.line is None else f"{self.source}:{self.line}"
            where += ": "
        return where + self.message


class TopologyError(InputError):
    """A topology file or generator request that cannot be used."""


class UnavailableError(MeshoptError):
    """A service the command needs (the broker, a running lab) cannot be reached: exit 3."""
