"""Writing a new Ed25519 key file for ``agent keygen`` and ``controller keygen``."""

from __future__ import annotations

from pathlib import Path

from meshopt.errors import InputError


def write_new_key(out: str, force: bool, consequence: str) -> str:
    """Make a key at ``out`` (its directory too, mode 0700); return the public key."""
    from meshopt.bus.signing import generate_signing_key, save_private_key

    path = Path(out)
    if path.is_dir():
        raise InputError(f"{path} is a directory; give the key file's name")
    if path.exists() and not force:
        raise InputError(f"{path} exists; use --force to replace it ({consequence})")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"cannot write {path}: {parent} is not a directory")
            break
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key, public = generate_signing_key()
        save_private_key(path, key)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}") from None
    return public
