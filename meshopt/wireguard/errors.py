"""WireGuard errors: one line each, so the CLI and the agent can report them as they are."""

from __future__ import annotations

from meshopt.errors import MeshoptError


class WireGuardError(MeshoptError):
    """A WireGuard interface could not be configured, read, started or stopped."""


class KeyFormatError(WireGuardError, ValueError):
    """A key is not 32 bytes of base64 (or hex, where UAPI wants hex)."""


class UapiError(WireGuardError):
    """The wireguard-go UAPI socket is missing, refused a request or answered garbage.

    ``errno`` is the (positive) error number when wireguard-go answered ``errno=-N``,
    otherwise None.
    """

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None):
        self.path = path
        self.errno = errno
        super().__init__(f"{path}: {message}" if path else message)


class WireGuardGoError(WireGuardError):
    """wireguard-go did not start, died, or did not stop."""


class KernelWireGuardError(WireGuardError):
    """The kernel's WireGuard generic-netlink family refused or is missing."""
