"""The one error a transfer reports, on either end."""

from __future__ import annotations

from meshopt.errors import MeshoptError


class TransferError(MeshoptError):
    """A transfer that failed; ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, *, code: str = "error") -> None:
        self.code = code
        super().__init__(message)
