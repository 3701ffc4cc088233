"""Ed25519 keys and signatures for published policies and checkpoints (`cryptography`).

File names scripts can rely on: `generate_keys(DIR)` writes ``DIR/policy-signing.key`` (the
private key, PEM PKCS8, unencrypted, mode 0600) and ``DIR/policy-signing.pub`` (the public key,
PEM SubjectPublicKeyInfo). A signature is the raw 64-byte Ed25519 signature over the exact bytes
of the signed file, stored next to it as ``<file>.sig``. Torch-free and Ray-free: a policy
service imports this module to verify.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_ENV",
    "PUBLIC_KEY_FILE",
    "SIG_SUFFIX",
    "SignatureError",
    "generate_keys",
    "load_private_key",
    "load_public_key",
    "public_key_fingerprint",
    "sign",
    "verify",
]

PRIVATE_KEY_FILE = "policy-signing.key"
PUBLIC_KEY_FILE = "policy-signing.pub"
SIG_SUFFIX = ".sig"
#: environment variable naming the public key file `load_policy` verifies with by default
PUBLIC_KEY_ENV = "RLREC_POLICY_PUBLIC_KEY"


class SignatureError(ValueError):
    """A key cannot be read, or a signature does not verify."""


def generate_keys(directory: str | os.PathLike, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new key pair into `directory` (created if needed); (private key path, public key path).

    The private key file is created with mode 0600 (never readable by others, whatever the
    umask); an existing key is kept unless `overwrite` (FileExistsError otherwise)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = d / PRIVATE_KEY_FILE, d / PUBLIC_KEY_FILE
    if not overwrite and (priv_path.exists() or pub_path.exists()):
        raise FileExistsError(f"{priv_path} or {pub_path} exists already")
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if overwrite:
        priv_path.unlink(missing_ok=True)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, priv)
        os.fsync(fd)
    finally:
        os.close(fd)
    pub_path.write_bytes(pub)
    return priv_path, pub_path


def _pem(path_or_pem: Any, what: str) -> bytes:
    if isinstance(path_or_pem, (bytes, bytearray)):
        return bytes(path_or_pem)
    if isinstance(path_or_pem, str) and path_or_pem.lstrip().startswith("-----BEGIN"):
        return path_or_pem.encode()
    try:
        return Path(os.fspath(path_or_pem)).expanduser().read_bytes()
    except OSError as e:
        raise SignatureError(f"cannot read the {what} {path_or_pem}: {e}") from None


def load_private_key(path_or_pem: Any) -> Any:
    """An Ed25519 private key from a PEM PKCS8 file path or the PEM bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(_pem(path_or_pem, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise SignatureError(f"not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"the signing key is a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path_or_pem: Any) -> Any:
    """An Ed25519 public key from a PEM SubjectPublicKeyInfo file path, the PEM text or bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if isinstance(path_or_pem, Ed25519PublicKey):
        return path_or_pem
    try:
        key = serialization.load_pem_public_key(_pem(path_or_pem, "public key"))
    except (ValueError, TypeError) as e:
        raise SignatureError(f"not a PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"the public key is a {type(key).__name__}, not an Ed25519 key")
    return key


def public_key_fingerprint(public_key: Any) -> str:
    """sha256 of the raw public key (hex, first 16 characters): names a key in logs and specs."""
    import hashlib

    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(private_key: Any, data: bytes) -> bytes:
    """The 64-byte Ed25519 signature of `data`."""
    return private_key.sign(bytes(data))


def verify(public_key: Any, data: bytes, signature: bytes) -> None:
    """Raise `SignatureError` unless `signature` is `public_key`'s signature of exactly `data`."""
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(bytes(signature), bytes(data))
    except InvalidSignature:
        raise SignatureError("the signature does not verify with the configured public key") from None
