"""Ed25519 keys for signed seals (the ``cryptography`` library): generate, load, fingerprint, sign, check.

Key files are PEM: the private key PKCS8, unencrypted, mode 0600 (``h3gate keygen --out KEY``); the public key
SubjectPublicKeyInfo in ``KEY.pub``. A seal records its signer as the raw 32-byte public key (base64) and its
fingerprint, the sha256 of those 32 bytes in hex. A key file that is missing, unreadable or not an Ed25519 key of
the expected kind is one :class:`InputError` line naming the file.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from h3gate.errors import InputError
from h3gate.evidence.writer import new_file_mode
from h3gate.paths import display

ALGORITHM = "ed25519"
PUB_SUFFIX = ".pub"
_MAX_KEY_BYTES = 1 << 16  # a PEM Ed25519 key is ~120 bytes; anything this large is not one


def _read_key_file(path: Path, what: str) -> bytes:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = fh.read(_MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot read {what} ({exc.strerror or exc})") from None
    if len(data) > _MAX_KEY_BYTES:
        raise InputError(f"{display(path)}: not a {what} (larger than {_MAX_KEY_BYTES} bytes)")
    return data


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (unencrypted PEM PKCS8, as ``h3gate keygen`` writes it)."""
    data = _read_key_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted (password required)
        raise InputError(f"{display(path)}: encrypted private key; h3gate reads unencrypted PEM PKCS8") from None
    except (ValueError, UnsupportedAlgorithm):
        raise InputError(f"{display(path)}: not an Ed25519 private key (PEM PKCS8 expected)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"{display(path)}: not an Ed25519 private key (found {type(key).__name__})")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """The Ed25519 public key in ``path`` (PEM SubjectPublicKeyInfo, as ``h3gate keygen`` writes ``KEY.pub``)."""
    data = _read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise InputError(f"{display(path)}: not an Ed25519 public key (PEM SubjectPublicKeyInfo expected)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InputError(f"{display(path)}: not an Ed25519 public key (found {type(key).__name__})")
    return key


def raw_public(key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key: Ed25519PublicKey) -> str:
    """sha256 (hex) of the raw public key bytes."""
    return hashlib.sha256(raw_public(key)).hexdigest()


def signer_record(key: Ed25519PrivateKey) -> dict[str, str]:
    """What a signed seal records about its key: algorithm, raw public key (base64) and fingerprint."""
    public = key.public_key()
    return {
        "algorithm": ALGORITHM,
        "public_key": base64.b64encode(raw_public(public)).decode("ascii"),
        "fingerprint": fingerprint(public),
    }


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    """The Ed25519 signature of ``message``, base64."""
    return base64.b64encode(key.sign(message)).decode("ascii")


def embedded_public_key(signer: dict) -> Ed25519PublicKey | None:
    """The public key a signer record names, or None when it is not a well-formed Ed25519 key matching its
    recorded fingerprint."""
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(signer["public_key"], validate=True))
    except (KeyError, TypeError, ValueError):
        return None
    return key if signer.get("fingerprint") == fingerprint(key) else None


def signature_valid(key: Ed25519PublicKey, signature: str, message: bytes) -> bool:
    """Whether base64 ``signature`` is ``key``'s Ed25519 signature of ``message``."""
    try:
        key.verify(base64.b64decode(signature, validate=True), message)
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True


def _create(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a new file ``path`` with ``mode``: temp file, then ``os.link`` (which never replaces)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)
    except FileExistsError:
        raise InputError(f"{display(path)}: already exists; refusing to overwrite") from None
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot write ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _private_folders(folder: Path) -> None:
    """Create ``folder`` and any missing folder above it, each with mode 0700 (InputError when one is a file)."""
    missing = [p for p in (folder, *folder.parents) if not p.is_dir()][::-1]
    for path in missing:
        try:
            path.mkdir(mode=0o700)
            path.chmod(0o700)  # mkdir's mode is filtered through the umask
        except FileExistsError:
            raise InputError(f"{display(path)}: exists and is not a folder; cannot hold the key") from None
        except OSError as exc:
            raise InputError(f"{display(path)}: cannot create the key's folder ({exc.strerror or exc})") from None


def write_keypair(out: Path) -> tuple[Path, Ed25519PublicKey]:
    """A new Ed25519 key: ``out`` (PEM PKCS8, mode 0600) and ``out.pub`` (PEM, the umask's mode).

    Refuses (InputError naming the file, nothing written) when either file exists; creates the missing folders
    above ``out`` with mode 0700 (a key's folder is private; folders that exist are left as they are).
    """
    out = Path(out)
    pub = out.with_name(out.name + PUB_SUFFIX)
    for path in (out, pub):
        if path.exists() or path.is_symlink():
            raise InputError(f"{display(path)}: already exists; refusing to overwrite")
    _private_folders(out.parent)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _create(out, private_pem, 0o600)
    try:
        _create(pub, public_pem, new_file_mode())
    except BaseException:
        with contextlib.suppress(OSError):
            out.unlink()
        raise
    return pub, key.public_key()
