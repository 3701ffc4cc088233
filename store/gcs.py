"""Google Cloud Storage for :class:`rlrec.store.storage.Storage`: the filesystem, create-once, listing.

Data goes through pyarrow's ``GcsFileSystem``. Two things it cannot do go through the
``google-cloud-storage`` client (the ``gcs`` extra), made on first use:

* create-once: an upload with ``if_generation_match=0`` (HTTP 412 when the object exists). The
  client sends a small object as ONE multipart upload (``uploadType=multipart``); fake-gcs-server
  enforces the precondition on exactly that request and ignores it on ``uploadType=media``, so
  the start-up probe (``probe_conditional_writes``) exercises this very call.
* listing one level (``delimiter="/"``): pyarrow lists only objects, so directories without a
  marker object (every directory rlrec writes) would be missing.

Settings come from Google's standard environment, for pyarrow and the client alike:
``STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:PORT``: an emulator, anonymous access),
else application default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server,
``gcloud auth application-default login``); ``GOOGLE_CLOUD_PROJECT`` names the project.
The client makes one attempt per call: :class:`rlrec.store.retry.RetryPolicy` alone retries.
"""

from __future__ import annotations

import datetime
import errno
import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

__all__ = ["GcsClient", "Listed", "gcs_filesystem", "is_access_error", "is_exists_error", "is_transient_error"]

#: seconds pyarrow's GCS client retries a request itself (0 would make no attempt at all)
REQUEST_RETRY_LIMIT_S = 1

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _emulator() -> tuple[str, str] | None:
    """(scheme, host:port) of ``STORAGE_EMULATOR_HOST``, or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    if "://" not in host:
        host = f"http://{host}"
    parts = urlsplit(host)
    return parts.scheme or "http", parts.netloc


def _project() -> str | None:
    return os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT") or None


def gcs_filesystem(retry_limit_s: float = REQUEST_RETRY_LIMIT_S) -> pafs.GcsFileSystem:
    """pyarrow's GcsFileSystem configured from Google's standard environment.

    Args:
        retry_limit_s: how long pyarrow retries one request itself (whole seconds, at least 1).

    Example::

        >>> os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:4443"
        >>> gcs_filesystem().type_name
        'gcs'
    """
    limit = datetime.timedelta(seconds=max(1, int(retry_limit_s)))
    emulator = _emulator()
    if emulator is not None:
        scheme, netloc = emulator
        return pafs.GcsFileSystem(
            anonymous=True,
            scheme=scheme,
            endpoint_override=netloc,
            project_id=_project() or "rlrec",
            retry_time_limit=limit,
        )
    return pafs.GcsFileSystem(project_id=_project(), retry_time_limit=limit)


@dataclass(frozen=True)
class Listed:
    """One entry of a one-level listing: *name* relative to the bucket."""

    name: str
    size: int | None
    mtime: float | None
    is_dir: bool


class GcsClient:
    """The google-cloud-storage client for create-once writes and one-level listings.

    Args:
        timeout_s: the timeout of each HTTP request.

    Example::

        >>> c = GcsClient()
        >>> c.create_once("bucket", "_manifest/x", b"entry")  # doctest: +SKIP
        True
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    from google.cloud import storage
                except ImportError:
                    from rlrec.errors import UsageError

                    raise UsageError("gs:// stores need google-cloud-storage: pip install 'rlrec[gcs]'") from None

                if _emulator() is not None:
                    from google.auth.credentials import AnonymousCredentials

                    # the client reads STORAGE_EMULATOR_HOST itself
                    self._client = storage.Client(project=_project() or "rlrec", credentials=AnonymousCredentials())
                else:
                    self._client = storage.Client(project=_project())
            return self._client

    def create_once(self, bucket: str, key: str, data: bytes) -> bool:
        """Upload *data* to *key* unless it exists (``ifGenerationMatch=0`` on a multipart
        upload); False if it exists. Other errors are raised (classify them with
        :func:`is_transient_error`)."""
        from google.api_core import exceptions as gexc

        blob = self.client().bucket(bucket).blob(key)
        try:
            blob.upload_from_string(
                data,
                content_type="application/octet-stream",
                if_generation_match=0,
                retry=None,
                timeout=self.timeout_s,
            )
        except gexc.PreconditionFailed:
            return False
        except gexc.NotFound as e:
            raise FileNotFoundError(errno.ENOENT, f"GCS bucket {bucket!r} does not exist ({e.code})") from None
        return True

    def list_dir(self, bucket: str, prefix: str) -> list[Listed]:
        """Objects and sub-prefixes directly under *prefix* (a directory, no trailing slash;
        ``""`` for the bucket's top)."""
        p = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        pages = self.client().list_blobs(bucket, prefix=p, delimiter="/", retry=None, timeout=self.timeout_s)
        out = []
        for blob in pages:
            if blob.name == p:  # a directory marker object
                continue
            mtime = blob.updated.timestamp() if blob.updated is not None else None
            out.append(Listed(blob.name, int(blob.size or 0), mtime, False))
        out.extend(Listed(d.rstrip("/"), None, None, True) for d in pages.prefixes)
        return out


def is_exists_error(exc: BaseException) -> bool:
    """HTTP 412 (precondition failed): the object exists."""
    return getattr(exc, "code", None) == 412 and type(exc).__module__.startswith("google")


def is_access_error(exc: BaseException) -> bool:
    """Credentials missing, wrong or without the permission: retrying will not help."""
    mod = type(exc).__module__ or ""
    if mod.startswith("google.auth"):
        name = type(exc).__name__
        return name in ("DefaultCredentialsError", "RefreshError", "MalformedError", "InvalidValue")
    return mod.startswith("google.api_core") and getattr(exc, "code", None) in (401, 403)


def is_transient_error(exc: BaseException) -> bool | None:
    """True/False for an error of the Google client stack, None for anything else."""
    mod = type(exc).__module__ or ""
    if mod.startswith("google.api_core"):
        code = getattr(exc, "code", None)
        return code in _TRANSIENT_STATUS or type(exc).__name__ in ("RetryError", "ServerError")
    if mod.startswith("google.auth"):
        return type(exc).__name__ == "TransportError"
    if mod.startswith(("requests", "urllib3")):
        import requests

        return isinstance(exc, (requests.ConnectionError, requests.Timeout)) or mod.startswith("urllib3")
    if mod.startswith("google.resumable_media"):
        code = getattr(getattr(exc, "response", None), "status_code", None)
        return code in _TRANSIENT_STATUS
    return None
