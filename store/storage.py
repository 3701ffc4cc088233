"""Output storage for episode shards and the manifest: any pyarrow filesystem.

:class:`Storage` wraps a ``pyarrow.fs.FileSystem`` plus a base path (the output
root) and offers the few operations the consumer, the manifest and the
maintenance commands need, on paths *relative to the output root*:

* ``write(path, data)`` -- atomic for readers (local: temp file + ``os.replace``;
  object stores: a PUT is atomic).
* ``create_once(path, data) -> bool`` -- create *path* only if it does not exist
  (``False`` if it does).  This is what makes the manifest log (and with it writer
  fencing) safe:

  ========================  ==================================================
  local filesystem          temp file + ``os.link`` to the final name (atomic,
                            fails if the name exists), temp removed
  ``s3://`` (AWS, MinIO,    boto3 ``put_object(..., IfNoneMatch="*")``; HTTP 412
  moto, ...)                ``PreconditionFailed`` / 409
                            ``ConditionalRequestConflict`` -> ``False``
  ``gs://`` (GCS,           google-cloud-storage multipart upload with
  fake-gcs-server)          ``ifGenerationMatch=0``; HTTP 412 -> ``False``
                            (:mod:`rlrec.store.gcs`)
  ``az://``, ``abfs://``    azure-storage-blob Put Blob with ``If-None-Match: *``;
  (Azure Blob, Azurite)     HTTP 409 / 412 -> ``False`` (:mod:`rlrec.store.azure`)
  anything else (hdfs, ...) exists-check + write: NOT atomic.  A zombie writer
                            can then overwrite a manifest entry; a warning is
                            logged once.  See docs/GUARANTEES.md.
  ========================  ==================================================

* ``read``, ``exists``, ``list``, ``move`` (publish), ``delete``, ``uri``.
* :func:`require_conditional_writes` -- refuse to write to a store whose create-once is not
  enforced (checked on object stores by a probe: two create-once writes of one key).
* ``upload_dir`` / ``download_dir`` / ``delete_tree``: a whole directory tree (e.g. a
  checkpoint) between a local directory and the storage, and its deletion.

Transient errors (``OSError`` from pyarrow other than not-found / exists /
permission errors, botocore connection errors, HTTP 5xx / throttling) are retried
with exponential backoff and full jitter for a bounded number of attempts
(:class:`rlrec.store.retry.RetryPolicy`, the one retry schedule), then :class:`StorageError` is raised.  pyarrow's and
botocore's own retries would run *inside* each of our attempts, so the boto3
client made here makes a single attempt per call (our loop sees, and can
disambiguate, every failed conditional PUT) and S3 filesystems built by
:meth:`Storage.from_uri` make one attempt per request (``s3_request_attempts``).
An explicitly passed filesystem keeps its own retry strategy.

S3 configuration comes from the standard AWS environment, for pyarrow
(``FileSystem.from_uri``) and boto3 alike: ``AWS_ENDPOINT_URL`` (MinIO, moto),
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION`` (default ``us-east-1``).  When a
``Storage`` is built from an explicit ``S3FileSystem``, the boto3 client for
conditional puts is configured from that filesystem's endpoint, credentials and
region (falling back to the environment for what it leaves unset).

GCS and Azure configuration comes from their standard environments too
(``STORAGE_EMULATOR_HOST``, application default credentials; ``AZURE_STORAGE_CONNECTION_STRING``,
account name + key, ``DefaultAzureCredential``): see :mod:`rlrec.store.gcs` and
:mod:`rlrec.store.azure`.  Credentials that are missing, wrong or lack a permission end in
:class:`StorageAccessError` at once (never retried).

Only pyarrow is imported at module level; boto3, google-cloud-storage and azure-storage-blob
are imported when the first conditional put on their store happens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rlrec.store import azure, gcs
from rlrec.store.localfs import LocalRoot, read_at_most
from rlrec.store.retry import RetryPolicy

__all__ = [
    "ConditionalWritesError",
    "FileInfo",
    "RetryPolicy",
    "Storage",
    "StorageAccessError",
    "StorageError",
    "is_refusal",
    "require_conditional_writes",
]

log = logging.getLogger("rlrec.storage")

T = TypeVar("T")

#: Schemes whose conditional create (create_once) is atomic.
CONDITIONAL_WRITE_KINDS = frozenset({"local", "s3", "gcs", "abfs"})

#: what to check when a store refuses our credentials, per kind
_CREDENTIAL_HINTS = {
    "gcs": "check GOOGLE_APPLICATION_CREDENTIALS / application default credentials and the bucket's IAM roles",
    "abfs": "check AZURE_STORAGE_CONNECTION_STRING, the account key or the DefaultAzureCredential sign-in "
    "and the container's role assignments",
}


class StorageError(Exception):
    """A storage operation failed after all retry attempts (or for good).

    ``__cause__`` is the last underlying error; ``attempts`` how many were made.
    """

    def __init__(self, message: str, *, attempts: int = 0) -> None:
        super().__init__(message)
        self.attempts = attempts


class StorageAccessError(PermissionError):
    """The store refused our credentials (missing, wrong, or without the permission): not
    retried, and a configuration error (`rlrec` exits with 2, one line)."""

    exit_code = 2


class ConditionalWritesError(RuntimeError):
    """The storage does not enforce create-once writes (S3 and Azure ``If-None-Match: *``, GCS
    ``ifGenerationMatch=0``): writer fencing and episode deduplication would silently be off."""

    #: a configuration error: `rlrec` exits with 2 (rlrec.errors)
    exit_code = 2


@dataclass(frozen=True)
class FileInfo:
    """One listed file or directory; *path* is relative to the output root."""

    path: str
    size: int | None
    mtime: float | None  # seconds since the epoch (storage's clock), None if unknown
    is_dir: bool = False

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


# ----------------------------------------------------------------- transient?

_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EEXIST,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ENOSPC,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.EINVAL,
    errno.ENOTEMPTY,
}
# Substrings of pyarrow's S3/GCS error messages that mean "retrying will not help".
_PERMANENT_MARKERS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "NO_SUCH_KEY",
    "NoSuchKey",
    "NO_SUCH_BUCKET",
    "NoSuchBucket",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "HTTP status 400",
    "HTTP status 401",
    "HTTP status 403",
    "HTTP status 404",
    "HTTP status 405",
    "BadScheme",
    # pyarrow's GCS (google-cloud-cpp) and Azure errors
    "Permanent error",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "INVALID_ARGUMENT",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
    "ContainerNotFound",
    "BlobNotFound",
    "InvalidResourceName",
    # Azure: "Azure Error: [Code] STATUS Reason"
    "] 400 ",
    "] 401 ",
    "] 403 ",
    "] 404 ",
    "] 409 ",
    "] 412 ",
)
# pyarrow messages that say our credentials were refused or missing (GCS, Azure)
_ACCESS_MARKERS = (
    "OAuth2 access token",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
)
_TRANSIENT_S3_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "503",
    "500",
    "502",
    "504",
}


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, StorageError):
        return False
    if isinstance(
        exc,
        (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError),
    ):
        return False
    for cloud in (gcs, azure):
        verdict = cloud.is_transient_error(exc)
        if verdict is not None:
            return verdict
    mod = type(exc).__module__ or ""
    if mod.startswith("botocore") or mod.startswith("urllib3"):
        try:
            from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
        except ImportError:  # pragma: no cover
            return False
        if isinstance(exc, (ConnectionError, HTTPClientError)):
            return True
        if isinstance(exc, ClientError):
            resp = exc.response or {}
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            code = str(resp.get("Error", {}).get("Code", ""))
            return status >= 500 or status == 429 or code in _TRANSIENT_S3_CODES
        return False
    if isinstance(exc, OSError):
        if exc.errno is not None and exc.errno in _PERMANENT_ERRNOS:
            return False
        msg = str(exc)
        return not any(m in msg for m in _PERMANENT_MARKERS)
    return False


_REFUSAL_MARKERS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "NO_SUCH_BUCKET",
    "NoSuchBucket",
    "HTTP status 401",
    "HTTP status 403",
)


def is_refusal(exc: BaseException) -> bool:
    """Whether `exc` is the store refusing the caller (permission, credentials, no such bucket):
    retrying the same call answers the same until someone changes the store's configuration.

    Args:
        exc: an exception a `Storage` call raised.

    Example:
        >>> is_refusal(PermissionError("denied")), is_refusal(OSError("AWS Error ACCESS_DENIED during GetObject"))
        (True, True)
        >>> is_refusal(StorageError("read s3://b/k: failed after 5 attempts: HTTP status 503"))
        False
    """
    if isinstance(exc, PermissionError):
        return True
    if isinstance(exc, StorageError) or not isinstance(exc, OSError) or isinstance(exc, FileNotFoundError):
        return False
    if exc.errno in (errno.EACCES, errno.EPERM):
        return True
    msg = str(exc)
    return any(m in msg for m in _REFUSAL_MARKERS)


def _is_access_error(exc: BaseException) -> bool:
    """The GCS or Azure client, or pyarrow's filesystem for them, refused our credentials."""
    if isinstance(exc, StorageAccessError):
        return False  # already said
    mod = type(exc).__module__ or ""
    if mod.startswith("google"):
        return gcs.is_access_error(exc)
    if mod.startswith("azure"):
        return azure.is_access_error(exc)
    return isinstance(exc, (OSError, pa.ArrowException)) and any(m in str(exc) for m in _ACCESS_MARKERS)


def _is_precondition_failure(exc: BaseException) -> bool:
    """boto3: HTTP 412 PreconditionFailed or 409 ConditionalRequestConflict."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return False
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(resp.get("Error", {}).get("Code", ""))
    return status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")


# -------------------------------------------------------------------- Storage


def _clean_rel(path: str) -> str:
    """Normalise a path relative to the output root; reject escapes."""
    if not isinstance(path, str):
        raise TypeError(f"path must be str, got {type(path).__name__}")
    p = path.replace("\\", "/")
    if p.startswith("/"):
        raise ValueError(f"path must be relative to the output root: {path!r}")
    parts = [c for c in p.split("/") if c not in ("", ".")]
    if any(c == ".." for c in parts):
        raise ValueError(f"path must not contain '..': {path!r}")
    return "/".join(parts)


def _unclean_rel(p: str) -> bool:
    """Whether `_clean_rel` might change or refuse `p` (a component that is empty or starts with
    a dot, a backslash): then it is passed through `_clean_rel`."""
    return not p or p[0] in "/." or p[-1] == "/" or "//" in p or "/." in p or "\\" in p


#: the schemes of object stores and file systems written with one slash or none after the colon
_MALFORMED = re.compile(r"(?i)(s3|s3a|gs|gcs|az|abfs|abfss):(?!//)")


def _split_uri(uri: str) -> tuple[str, str]:
    """('scheme', rest) -- scheme '' for plain local paths (incl. Windows drives)."""
    if "://" in uri:
        scheme = uri.split("://", 1)[0].lower()
        return scheme, uri
    return "", uri


class Storage:
    """A pyarrow filesystem + output root, with retries and conditional creates.

    Build with :meth:`from_uri` (``"s3://bucket/prefix"``, ``"/tmp/x"``,
    ``"file:///tmp/x"``, ``"gs://..."``) or ``Storage(filesystem, base)``.

    Attributes: ``filesystem`` (the ``pyarrow.fs.FileSystem``), ``base`` (the
    output root inside it, no trailing slash), ``kind`` (``"local"``, ``"s3"``,
    ``"gcs"``, ``"abfs"``, ...), ``retry`` (:class:`RetryPolicy`).
    """

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        base: str,
        *,
        retry: RetryPolicy | None = None,
        fsync: bool = True,
        s3_client: Any = None,
        uri: str | None = None,
        azure_settings: azure.AzureSettings | None = None,
    ) -> None:
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError("filesystem must be a pyarrow.fs.FileSystem")
        # Unwrap SubTreeFileSystem so that the kind (and conditional writes) are known.
        while isinstance(filesystem, pafs.SubTreeFileSystem):
            inner = filesystem.base_path.rstrip("/")
            base = f"{inner}/{base.lstrip('/')}" if base.strip("/") else inner
            filesystem = filesystem.base_fs
        self.filesystem: pafs.FileSystem = filesystem
        self.kind: str = filesystem.type_name
        if self.kind == "local":
            base = os.path.abspath(base or ".")
            self.base = base.rstrip("/") or "/"
        else:
            self.base = base.strip("/")
            if not self.base:
                raise ValueError(f"{self.kind} storage needs a base path (at least a bucket)")
        self.retry = retry or RetryPolicy()
        if self.retry.attempts is None:
            raise ValueError("Storage retries in place: its RetryPolicy needs a bounded number of attempts")
        self.fsync = fsync
        #: local files: every write, move, read and delete stays inside the root (no symlink steers it)
        self._local = LocalRoot(self.base, fsync=fsync) if self.kind == "local" else None
        self._s3_client = s3_client
        self._s3_lock = threading.Lock()
        #: the client library of the store for what pyarrow cannot do (create-once; GCS listings)
        self._gcs = gcs.GcsClient() if self.kind == "gcs" else None
        self._azure = (
            azure.AzureClient(azure_settings or _azure_settings_of(filesystem)) if self.kind == "abfs" else None
        )
        self._uri = self._uri_template(uri)
        self._warned_unsafe = False

    # ------------------------------------------------------------ construction
    @classmethod
    def from_uri(
        cls,
        uri: str | os.PathLike[str],
        *,
        retry: RetryPolicy | None = None,
        s3_request_attempts: int = 1,
        **kw: Any,
    ) -> Storage:
        """A Storage for a local path or any URI ``pyarrow.fs.FileSystem.from_uri`` accepts.

        For ``s3://`` the endpoint and credentials come from the standard AWS
        environment (``AWS_ENDPOINT_URL`` etc.) unless given as URI parameters; for
        ``gs://`` from Google's (:func:`rlrec.store.gcs.gcs_filesystem`), for ``az://`` /
        ``abfs://`` from Azure's (:class:`rlrec.store.azure.AzureSettings`).
        The S3 filesystem is rebuilt with the same settings plus: an explicit
        region (URI > ``AWS_REGION`` > ``AWS_DEFAULT_REGION`` > ``us-east-1``),
        ``allow_delayed_open=True`` (small objects go up in one PUT instead of a
        3-request multipart upload) and pyarrow's own retries limited to
        *s3_request_attempts* per request, so that :class:`RetryPolicy` alone
        decides how long transient errors are retried (pyarrow's default
        strategy, combined with region lookups, was seen making 30-100 requests
        over 6-20 s against a failing endpoint before giving up).
        """
        uri = os.fspath(uri)
        scheme, _ = _split_uri(uri)
        bad = _MALFORMED.match(uri)
        if scheme == "" and bad:  # s3:/bucket/x, gs:bucket: a URI missing a slash, not a local path
            raise ValueError(f"cannot open {uri!r}: a malformed URI (write {bad.group(1)}://bucket/prefix)")
        if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
            return cls(pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri)), retry=retry, **kw)
        if scheme in ("gs", "gcs"):
            parts = urlsplit(uri)
            path = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
            return cls(gcs.gcs_filesystem(), path, retry=retry, uri=uri, **kw)
        if scheme in azure.AZURE_SCHEMES:
            account, path = azure.split_azure_uri(uri)
            settings = azure.AzureSettings.from_env(account)
            fs = azure.azure_filesystem(settings)
            return cls(fs, path, retry=retry, uri=uri, azure_settings=settings, **kw)
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except pa.ArrowInvalid as e:
            if "Unrecognized filesystem type" in str(e):
                raise ValueError(
                    f"cannot open {uri!r}: unknown URI scheme {scheme!r} (give a path, file:///path, "
                    "s3://bucket/prefix, gs://bucket/prefix or az://container/prefix)"
                ) from None
            raise ValueError(f"cannot open {uri!r}: {e}") from None
        if fs.type_name == "s3":
            fs = _rebuild_s3(fs, s3_request_attempts)
        return cls(fs, path, retry=retry, uri=uri, **kw)

    def _uri_template(self, uri: str | None) -> tuple[str, str] | None:
        """(prefix, query) for uri(); None -> derive from kind + base."""
        if uri is None or self.kind == "local":
            return None
        parts = urlsplit(uri)
        netloc = parts.netloc.rsplit("@", 1)[-1]  # never echo credentials
        if parts.scheme.lower() == "s3" or self.kind == "s3":
            prefix = f"s3://{self.base}"
        elif self.kind == "gcs":
            prefix = f"gs://{self.base}"
        elif self.kind == "abfs":  # abfs://CONTAINER@ACCOUNT.HOST/...: the account stays
            container, path = self.base.split("/", 1) if "/" in self.base else (self.base, "")
            account = parts.netloc.partition("@")[2]
            prefix = f"{parts.scheme.lower()}://{container}{'@' + account if account else ''}/{path}".rstrip("/")
            return prefix, ""
        else:
            prefix = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        return prefix, parts.query

    def __repr__(self) -> str:
        return f"Storage({self.uri('')!r})"

    # ------------------------------------------------------------------ paths
    def full_path(self, path: str = "") -> str:
        """*path* (relative to the output root) as a path inside ``self.filesystem``."""
        rel = _clean_rel(path)
        if not rel:
            return self.base
        if self.kind == "local":
            return os.path.join(self.base, *rel.split("/"))
        return f"{self.base}/{rel}"

    def uri(self, path: str = "") -> str:
        """A URI (``s3://bucket/prefix/...``) or absolute local path pyarrow can open.

        For a Storage built from a URI with query parameters (e.g.
        ``?endpoint_override=...``) the parameters are carried over; credentials
        embedded in a URI are not.  For a Storage built from an explicit
        filesystem whose settings are not in the environment, open the returned
        path with ``self.filesystem`` / :meth:`full_path` instead.
        """
        rel = _clean_rel(path)
        if self.kind == "local":
            return self.full_path(rel)
        if self._uri is not None:
            prefix, query = self._uri
        else:
            scheme = {"s3": "s3", "gcs": "gs", "abfs": "abfs", "hdfs": "hdfs"}.get(self.kind)
            prefix, query = (f"{scheme}://{self.base}" if scheme else self.base), ""
        out = f"{prefix}/{rel}" if rel else prefix
        return f"{out}?{query}" if query else out

    def uris(self, paths: Iterable[str]) -> list[str]:
        """`uri` of each of `paths`, many at a time (a local store's joined directly where a
        path is already clean: what `uri` would return for it).

        Example:
            >>> Storage.from_uri("/tmp/x").uris(["pol/a.parquet"]) == [Storage.from_uri("/tmp/x").uri("pol/a.parquet")]
            True
        """
        if self.kind != "local" or os.sep != "/":
            return [self.uri(p) for p in paths]
        prefix = os.path.join(self.base, "")
        return [self.uri(p) if _unclean_rel(p) else prefix + p for p in paths]

    def location(self) -> str:
        """What names this store, whatever URI opened it: the kind and base path (``s3://``
        bucket/prefix, ``gcs://``, an absolute local path; Azure's ``abfs://`` with the account,
        for ``az://`` and ``abfs[s]://`` alike), without query parameters or credentials.

        Example:
            >>> Storage.from_uri("/tmp/x/").location() == Storage.from_uri("file:///tmp/x").location()
            True
        """
        if self.kind == "local":
            return self.base
        account = f"@{self._azure.settings.account_name}" if self._azure is not None else ""
        return f"{self.kind}://{self.base}{account}"

    @property
    def conditional_writes(self) -> bool:
        """True if :meth:`create_once` is atomic on this storage (local, S3, GCS, Azure)."""
        return self.kind in CONDITIONAL_WRITE_KINDS

    # ------------------------------------------------------------------ retry
    def _retry(self, what: str, fn: Callable[[int], T]) -> T:
        """Run fn(attempt) with retries on transient errors; StorageError at the end."""
        policy = self.retry
        attempt = 0
        while True:
            try:
                return fn(attempt)
            except Exception as e:
                if _is_access_error(e):
                    hint = _CREDENTIAL_HINTS.get(self.kind, "check the store's credentials and permissions")
                    raise StorageAccessError(f"{what}: access denied ({_one_line(e)}): {hint}") from e
                if not _is_transient(e):
                    raise
                if policy.gives_up(attempt + 1):
                    log.warning("%s: giving up after %d attempts: %s", what, attempt + 1, e)
                    raise StorageError(f"{what}: failed after {attempt + 1} attempts: {e}", attempts=attempt + 1) from e
                d = policy.delay(attempt)
                log.debug(
                    "%s: transient error (attempt %d/%d), retrying in %.3fs: %s",
                    what,
                    attempt + 1,
                    policy.attempts,
                    d,
                    e,
                )
                time.sleep(d)
                attempt += 1

    # --------------------------------------------------------------- S3 helpers
    def _bucket_key(self, path: str) -> tuple[str, str]:
        full = self.full_path(path)
        bucket, _, key = full.partition("/")
        return bucket, key

    def s3_client(self) -> Any:
        """The boto3 S3 client used for conditional puts (made on first use)."""
        with self._s3_lock:
            if self._s3_client is None:
                self._s3_client = self._make_s3_client()
            return self._s3_client

    def _make_s3_client(self) -> Any:
        import boto3
        from botocore.config import Config

        settings: dict[str, Any] = {}
        try:
            settings = dict(self.filesystem.__reduce__()[1][0])
        except Exception:  # not an S3FileSystem we can introspect
            settings = {}
        kwargs: dict[str, Any] = {}
        endpoint = (
            settings.get("endpoint_override")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        if endpoint:
            if "://" not in endpoint:
                endpoint = f"{settings.get('scheme') or 'https'}://{endpoint}"
            kwargs["endpoint_url"] = endpoint
        if settings.get("access_key"):
            kwargs["aws_access_key_id"] = settings["access_key"]
            kwargs["aws_secret_access_key"] = settings.get("secret_key") or None
            if settings.get("session_token"):
                kwargs["aws_session_token"] = settings["session_token"]
        region = (
            settings.get("region")
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        cfg = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=10,
            read_timeout=30,
            s3={"addressing_style": "virtual" if settings.get("force_virtual_addressing") else "auto"},
        )
        session = boto3.session.Session()
        return session.client("s3", region_name=region, config=cfg, **kwargs)

    # ------------------------------------------------------------------ write
    def write(self, path: str, data: bytes) -> None:
        """Write *data* to *path* (replacing it), atomically for readers."""
        data = bytes(data)
        full = self.full_path(path)
        if self._local is not None:

            def op(_: int) -> None:
                self._local.write(_clean_rel(path), data)

        elif self._azure is not None:  # one upload: see AzureClient.put
            bucket, key = self._bucket_key(path)

            def op(_: int) -> None:
                self._azure.put(bucket, key, data)

        else:

            def op(_: int) -> None:
                with self.filesystem.open_output_stream(full) as out:
                    out.write(data)

        self._retry(f"write {self.uri(path)}", op)

    def create_once(self, path: str, data: bytes) -> bool:
        """Create *path* with *data* unless it exists; ``True`` if this call created it.

        Atomic on local filesystems and S3.  If an attempt fails ambiguously (the
        request may have been applied, e.g. a 5xx or lost connection) and a retry
        then finds the object, the object's content is compared with *data*: equal
        bytes mean our earlier attempt created it (``True``).
        """
        data = bytes(data)
        full = self.full_path(path)
        if self._local is not None:
            return self._retry(f"create_once {full}", lambda _: self._local.create_once(_clean_rel(path), data))
        bucket, key = self._bucket_key(path)
        if self.kind == "s3":
            client = self.s3_client()

            def put(data: bytes) -> bool:
                try:
                    client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                    return True
                except Exception as e:
                    if _is_precondition_failure(e):
                        return False
                    raise

            return self._create_once_conditional(path, data, put)
        if self._gcs is not None:
            return self._create_once_conditional(path, data, lambda d: self._gcs.create_once(bucket, key, d))
        if self._azure is not None:
            return self._create_once_conditional(path, data, lambda d: self._azure.create_once(bucket, key, d))
        return self._create_once_unsafe(path, data)

    def _create_once_conditional(self, path: str, data: bytes, put: Callable[[bytes], bool]) -> bool:
        """Retry *put* (True: created, False: the object exists, else raises); after an
        ambiguous failure, an existing object with our bytes is ours."""
        ambiguous = False

        def op(attempt: int) -> bool:
            nonlocal ambiguous
            try:
                if put(data):
                    return True
                return bool(ambiguous and self._same_content(path, data))
            except Exception as e:
                if _is_transient(e):
                    ambiguous = True
                raise

        return self._retry(f"create_once {self.uri(path)}", op)

    def _same_content(self, path: str, data: bytes) -> bool:
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False

    def _create_once_unsafe(self, path: str, data: bytes) -> bool:
        if not self._warned_unsafe:
            self._warned_unsafe = True
            log.warning(
                "storage %s (%s) has no conditional writes in pyarrow: create_once falls back to "
                "exists-check + write, which is NOT atomic -- zombie-writer fencing of the manifest "
                "needs conditional writes (local filesystem or S3); see docs/GUARANTEES.md",
                self.uri(""),
                self.kind,
            )
        if self.exists(path):
            return False
        self.write(path, data)
        return True

    # ------------------------------------------------------------------- read
    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """The content of *path*; ``FileNotFoundError`` if it does not exist.

        Args:
            path: the file, relative to the root.
            limit: read at most ``limit + 1`` bytes (in one read of the object's size when it
                is known, else in growing pieces: what is allocated follows what is there), so
                that a caller with a size budget sees a file over it (``len(data) > limit``)
                without the file deciding what this process allocates; None reads the whole
                file.

        Example::

            >>> import tempfile
            >>> s = Storage.from_uri(tempfile.mkdtemp())
            >>> s.write("a.json", b"0123456789")
            >>> len(s.read("a.json", limit=4))
            5
        """
        if limit is not None and int(limit) < 0:
            raise ValueError(f"limit must be at least 0, not {limit}")
        full = self.full_path(path)
        size = -1 if limit is None else int(limit) + 1
        if self._local is not None:

            def op(_: int) -> bytes:
                return self._local.read(_clean_rel(path), size)

        else:

            def op(_: int) -> bytes:
                with self.filesystem.open_input_stream(full) as f:
                    if size < 0:
                        return f.read()
                    try:
                        known = f.size()  # S3 and Azure know it from opening the object
                    except Exception:  # a stream of unknown length: pieces
                        return read_at_most(f, size)
                    return read_at_most(f, size, first=known + 1)

        return self._retry(f"read {self.uri(path)}", op)

    def exists(self, path: str) -> bool:
        """True if *path* is a file or a directory."""
        full = self.full_path(path)
        info = self._retry(f"stat {self.uri(path)}", lambda _: self.filesystem.get_file_info(full))
        return info.type != pafs.FileType.NotFound

    def info(self, path: str) -> FileInfo | None:
        """Size/mtime of *path*, or None if it does not exist."""
        full = self.full_path(path)
        info = self._retry(f"stat {self.uri(path)}", lambda _: self.filesystem.get_file_info(full))
        if info.type == pafs.FileType.NotFound:
            return None
        return self._file_info(info)

    def _rel(self, full: str) -> str:
        base = self.base
        if self.kind == "local":
            return os.path.relpath(full, base).replace(os.sep, "/")
        if full == base:
            return ""
        if full.startswith(base + "/"):
            return full[len(base) + 1 :]
        return full

    def _file_info(self, info: pafs.FileInfo) -> FileInfo:
        is_dir = info.type == pafs.FileType.Directory
        mtime_ns = info.mtime_ns
        return FileInfo(
            path=self._rel(info.path),
            size=None if is_dir else info.size,
            mtime=None if mtime_ns is None else mtime_ns / 1e9,
            is_dir=is_dir,
        )

    def list(self, prefix: str = "", recursive: bool = False) -> list[FileInfo]:
        """Files and directories under the directory *prefix* (``[]`` if it does not exist).

        Sorted by path.  Includes hidden temp files (``.name.tmp-*``) of
        interrupted local writes.
        """
        full = self.full_path(prefix)
        if self._gcs is not None and not recursive:
            return self._list_gcs(full, prefix)
        sel = pafs.FileSelector(full, recursive=recursive, allow_not_found=True)

        def op(_: int) -> list[pafs.FileInfo]:
            for _attempt in range(3):
                try:
                    return self.filesystem.get_file_info(sel)
                except FileNotFoundError:
                    # pyarrow (local): the directory appeared between its failed
                    # listing and its existence check (a concurrent makedirs), or
                    # a subdirectory vanished mid-walk.  Listing again settles it.
                    continue
            return self.filesystem.get_file_info(sel)

        infos = self._retry(f"list {self.uri(prefix)}", op)
        return sorted((self._file_info(i) for i in infos), key=lambda f: f.path)

    def _list_gcs(self, full: str, prefix: str) -> list[FileInfo]:
        """One level of a GCS directory through the client: pyarrow lists no directory that
        has no marker object."""
        bucket, _, key = full.partition("/")
        entries = self._retry(f"list {self.uri(prefix)}", lambda _: self._gcs.list_dir(bucket, key))
        out = [FileInfo(self._rel(f"{bucket}/{e.name}"), e.size, e.mtime, e.is_dir) for e in entries]
        return sorted(out, key=lambda f: f.path)

    def check_inside(self, path: str) -> None:
        """Before another library (pyarrow, Ray Data) opens *path*: on a local store, raise
        :class:`~rlrec.store.localfs.EscapesRoot` if a symlink (or a special file) is on its
        way, since that library would follow it out of the root; ``FileNotFoundError`` if it is
        missing. Object stores have no links: nothing to check."""
        if self._local is not None:
            self._local.check(_clean_rel(path))

    # ------------------------------------------------------------------- move
    def move(self, src: str, dst: str) -> None:
        """Move *src* to *dst* (replacing *dst*); used to publish staged shards.

        Local: ``os.replace`` (atomic).  S3, GCS: server-side copy then delete (the
        copy appears atomically).  Azure: pyarrow has no move without a hierarchical
        namespace, so :meth:`copy` (an upload of the bytes, atomic for readers) then
        :meth:`delete` here (a crash between them leaves both; the manifest, not the
        publish, is the commit point).  ``FileNotFoundError`` if *src* does not exist.
        """
        fsrc, fdst = self.full_path(src), self.full_path(dst)
        if self._azure is not None:
            self.copy(src, dst)
            self.delete(src)
            return
        if self._local is not None:

            def op(_: int) -> None:
                self._local.replace(_clean_rel(src), _clean_rel(dst))

        else:

            def op(_: int) -> None:
                with _not_found_as_fnf():
                    self.filesystem.move(fsrc, fdst)

        self._retry(f"move {self.uri(src)} -> {self.uri(dst)}", op)

    def copy(self, src: str, dst: str) -> None:
        """Copy *src* to *dst* (server-side on S3 and GCS; local and Azure: read, then
        :meth:`write`, atomic for readers)."""
        fsrc, fdst = self.full_path(src), self.full_path(dst)
        if self.kind == "local" or self._azure is not None:
            self.write(dst, self.read(src))
            return

        def op(_: int) -> None:
            with _not_found_as_fnf():
                self.filesystem.copy_file(fsrc, fdst)

        self._retry(f"copy {self.uri(src)} -> {self.uri(dst)}", op)

    # ----------------------------------------------------------------- delete
    def delete(self, path: str, *, missing_ok: bool = True) -> bool:
        """Delete the file *path*; returns False if it did not exist (and *missing_ok*)."""
        full = self.full_path(path)
        if self._local is not None:

            def op(_: int) -> bool:
                try:
                    self._local.unlink(_clean_rel(path))
                    return True
                except FileNotFoundError:
                    if missing_ok:
                        return False
                    raise

        elif self._azure is not None:
            bucket, key = self._bucket_key(path)

            def op(_: int) -> bool:
                if self._azure.delete(bucket, key):
                    return True
                if missing_ok:
                    return False
                raise FileNotFoundError(errno.ENOENT, "no such blob", self.uri(path))

        else:

            def op(_: int) -> bool:
                try:
                    self.filesystem.delete_file(full)
                    return True
                except FileNotFoundError:
                    if missing_ok:
                        return False
                    raise

        return self._retry(f"delete {self.uri(path)}", op)

    # ------------------------------------------------------------ directory trees
    def _is_dir(self, path: str) -> bool:
        """True for a directory, False if *path* does not exist; ``NotADirectoryError`` for a file."""
        info = self.info(path)
        if info is None:
            return False
        if not info.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.uri(path))
        return True

    def upload_dir(self, local_dir: str | os.PathLike[str], prefix: str) -> int:
        """Copy every file under the local directory *local_dir* to *prefix*/...; the number of files.

        What was under *prefix* is deleted first, so afterwards *prefix* holds exactly the
        files of *local_dir* (a re-upload never mixes old and new files).  Not atomic as a
        whole: publish the tree to readers with a pointer written afterwards.  Local: the
        tree is copied with ``shutil.copytree`` (not fsynced); object stores: one
        :meth:`write` per file.  ``FileNotFoundError`` if *local_dir* is not a directory;
        ``ValueError`` for the output root itself (``prefix=""``).
        """
        src = os.fspath(local_dir)
        if not os.path.isdir(src):
            raise FileNotFoundError(errno.ENOENT, "not a directory", src)
        files = _local_files(src)
        self.delete_tree(prefix)
        if self.kind == "local":
            dst = self.full_path(prefix)

            def op(_: int) -> None:
                shutil.copytree(src, dst, dirs_exist_ok=True)

            self._retry(f"upload_dir {src} -> {self.uri(prefix)}", op)
        else:
            for rel in files:
                with open(os.path.join(src, *rel.split("/")), "rb") as f:
                    self.write(f"{prefix}/{rel}", f.read())
        return len(files)

    def download_dir(self, prefix: str, local_dir: str | os.PathLike[str]) -> int:
        """Copy every file under *prefix* into the local directory *local_dir*; the number of files.

        *local_dir* is created if needed; files already there with the same relative
        path are replaced, others are left alone.  ``FileNotFoundError`` if *prefix* does
        not exist, ``NotADirectoryError`` if it is a file.
        """
        base = _clean_rel(prefix)
        dst = os.fspath(local_dir)
        if not self._is_dir(base):
            raise FileNotFoundError(errno.ENOENT, "no such directory", self.uri(base))
        files = [f for f in self.list(base, recursive=True) if not f.is_dir]
        if self.kind == "local":
            src = self.full_path(base)

            def op(_: int) -> None:
                shutil.copytree(src, dst, dirs_exist_ok=True)

            self._retry(f"download_dir {self.uri(base)} -> {dst}", op)
        else:
            for f in files:
                rel = f.path[len(base) + 1 :] if base else f.path
                target = os.path.join(dst, *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                data = self.read(f.path)
                with open(target, "wb") as out:
                    out.write(data)
        return len(files)

    def delete_tree(self, prefix: str) -> int:
        """Delete every file under *prefix*, and the directory itself; the number of files deleted.

        A missing *prefix* is fine (0); ``NotADirectoryError`` if it is a file.  On object
        stores the directory markers pyarrow leaves behind are deleted too, so the directory
        no longer shows up in :meth:`list`.  ``ValueError`` for the output root itself
        (``prefix=""``).
        """
        rel = _clean_rel(prefix)
        if not rel:
            raise ValueError("delete_tree needs a directory below the output root, not the root itself")
        if self._local is not None:  # never through a symlink, never a link's target
            return self._retry(f"delete_tree {self.uri(rel)}", lambda _: self._local.remove_tree(rel))
        if not self._is_dir(rel):
            return 0
        files = [f for f in self.list(rel, recursive=True) if not f.is_dir]
        if self._azure is not None:  # blob by blob: see AzureClient.delete
            for f in files:
                self.delete(f.path)
            return len(files)
        full = self.full_path(rel)

        def op(_: int) -> None:
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                self.filesystem.delete_dir(full)

        self._retry(f"delete_tree {self.uri(rel)}", op)
        return len(files)


#: where the probe writes (dot-prefixed: manifest readers skip it), relative to the output root
PROBE_PREFIX = "_manifest/.probe-conditional-writes-"


def probe_conditional_writes(storage: Storage) -> bool:
    """True if the storage enforces create-once writes.

    Local filesystems do (``os.link`` / ``O_EXCL``); object stores (``s3://``, ``gs://``,
    ``az://``) are probed: one dot-prefixed key under ``_manifest/`` is created twice with
    ``create_once`` -- the very request that writes manifest entries (S3 ``If-None-Match: *``,
    a GCS multipart upload with ``ifGenerationMatch=0``, an Azure Put Blob with
    ``If-None-Match: *``) -- the second must be refused, and the key is deleted afterwards.
    Other stores (hdfs, ...) have no conditional create in pyarrow: False.  Storage errors
    propagate.
    """
    if storage.kind == "local":
        return True
    if storage.kind not in CONDITIONAL_WRITE_KINDS:
        return False
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        if not storage.create_once(key, b"first"):
            raise StorageError(f"create_once probe {storage.uri(key)}: a fresh key already exists")
        return not storage.create_once(key, b"second")
    finally:
        try:
            storage.delete(key)
        except Exception as e:  # leave it: a few bytes, ignored by every reader
            log.warning("cannot delete the probe %s: %s", storage.uri(key), e)


def require_conditional_writes(storage: Storage, *, allow_unfenced: bool = False) -> bool:
    """Refuse to write a manifest to a store that ignores create-once writes.

    The one place that rule is enforced (``RecorderConsumer.run`` calls it before anything
    else).  Returns whether the store enforces them; raises :class:`ConditionalWritesError`
    if it does not, unless *allow_unfenced* (``rlrec consume --allow-unfenced-storage``),
    which only logs an error: fencing and deduplication are then off.
    """
    if probe_conditional_writes(storage):
        return True
    ignored = {"s3": "If-None-Match", "gcs": "ifGenerationMatch=0", "abfs": "If-None-Match"}.get(storage.kind)
    why = (
        f"a second create-once write of one key succeeded: the store ignores {ignored}"
        if ignored
        else f"pyarrow offers no conditional create for {storage.kind} storage"
    )
    msg = (
        f"storage {storage.uri('')} does not enforce create-once writes ({why}). Without them a "
        "zombie consumer is not fenced and an episode can be committed twice (docs/GUARANTEES.md, "
        "section 6). Use a store that enforces them (AWS S3 or an S3-compatible store with "
        "conditional writes, Google Cloud Storage, Azure Blob Storage), or pass --allow-unfenced-storage to run without fencing and "
        "deduplication (only if one consumer per partition is guaranteed by other means)."
    )
    if not allow_unfenced:
        raise ConditionalWritesError(msg)
    log.error("%s -- continuing: --allow-unfenced-storage is set", msg)
    return False


def _local_files(root: str) -> list[str]:
    """Paths (``/``-separated, relative to *root*) of the files under the local directory *root*, sorted."""
    out = []
    for d, _dirs, names in os.walk(root):
        for n in names:
            out.append(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/"))
    return sorted(out)


def _one_line(exc: BaseException) -> str:
    """The gist of *exc*'s message on one line: cloud client errors carry whole HTTP responses,
    google-cloud-cpp's wrap the cause in retry metadata."""
    text = str(exc)
    m = re.search(r"The underlying error message was: (.*?)(?: error_info=|\)\)|$)", text, re.S)
    if m:
        text = m.group(1)
    lines = [part.strip() for part in text.splitlines() if part.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _azure_settings_of(fs: pafs.FileSystem) -> azure.AzureSettings:
    """The account settings of an AzureFileSystem (for its create-once client)."""
    kw = dict(fs.__reduce__()[1][0])
    name = kw["account_name"]
    scheme = kw.get("blob_storage_scheme") or "https"
    authority = kw.get("blob_storage_authority") or ".blob.core.windows.net"
    endpoint = f"{scheme}://{name}{authority}" if authority.startswith(".") else f"{scheme}://{authority}/{name}"
    return azure.AzureSettings(name, endpoint, kw.get("account_key") or None, kw.get("sas_token") or None)


def _rebuild_s3(fs: pafs.FileSystem, request_attempts: int) -> pafs.FileSystem:
    """The same S3FileSystem with an explicit region, delayed open and bounded retries."""
    try:
        kw = dict(fs.__reduce__()[1][0])
    except Exception:  # pragma: no cover - unknown pyarrow internals: keep as is
        return fs
    for k in ("connect_timeout", "request_timeout"):
        if kw.get(k) is not None and kw[k] < 0:
            kw[k] = None
    kw["region"] = (
        kw.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    )
    kw["allow_delayed_open"] = True
    try:
        return pafs.S3FileSystem(
            **kw, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max(1, int(request_attempts)))
        )
    except TypeError:  # pragma: no cover - a pyarrow without one of these options
        log.debug("cannot rebuild S3FileSystem with %s; using it as is", sorted(kw))
        return fs


_MISSING_SOURCE_MARKERS = ("NO_SUCH_KEY", "NoSuchKey", "does not exist", "BlobNotFound")


@contextlib.contextmanager
def _not_found_as_fnf() -> Iterator[None]:
    """pyarrow reports a missing copy or move source as a plain OSError (S3: NO_SUCH_KEY, GCS:
    "does not exist", Azure: BlobNotFound)."""
    try:
        yield
    except OSError as e:
        if not isinstance(e, FileNotFoundError) and any(m in str(e) for m in _MISSING_SOURCE_MARKERS):
            raise FileNotFoundError(errno.ENOENT, str(e)) from e
        raise
