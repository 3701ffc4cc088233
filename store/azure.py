"""Azure Blob Storage for :class:`rlrec.store.storage.Storage`: URIs, settings, create-once.

URIs: ``az://CONTAINER/prefix`` (fsspec's spelling; pyarrow 26 does not parse it),
``abfs://CONTAINER/prefix`` and ``abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/prefix``.
Reads and listings go through pyarrow's ``AzureFileSystem``; writes, create-once and deletes
through the ``azure-storage-blob`` client (the ``azure`` extra): create-once is an upload with
``If-None-Match: *`` (HTTP 409 ``BlobAlreadyExists`` or 412 when the blob exists), a write one
upload (pyarrow's output stream shows readers an empty blob until it closes). Without a
hierarchical namespace (Azurite, most accounts) Azure has no rename: pyarrow's ``move`` is not
implemented there, so a publish is an upload of the staged bytes, then a delete.

Settings come from Azure's standard environment, for pyarrow and the client alike:

* ``AZURE_STORAGE_CONNECTION_STRING`` (account name and key or SAS, endpoint; ``UseDevelopmentStorage=true``
  means Azurite on 127.0.0.1:10000), else
* ``AZURE_STORAGE_ACCOUNT_NAME`` (or the account in an ``abfs://`` URI) with
  ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``, else
  ``DefaultAzureCredential`` (managed identity, workload identity, ``az login``, ...).

The client makes one attempt per call: :class:`rlrec.store.retry.RetryPolicy` alone retries.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

__all__ = [
    "AZURE_SCHEMES",
    "AzureClient",
    "AzureSettings",
    "azure_filesystem",
    "is_access_error",
    "is_exists_error",
    "is_transient_error",
    "split_azure_uri",
]

#: URI schemes of Azure Blob Storage
AZURE_SCHEMES = frozenset({"az", "abfs", "abfss"})

#: Azurite's well-known development account (public, documented by Microsoft)
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class AzureSettings:
    """Where an Azure storage account is and how to sign in to it.

    ``blob_endpoint`` is the Blob service URL (``https://ACCOUNT.blob.core.windows.net``, or an
    emulator's ``http://127.0.0.1:10000/devstoreaccount1``); no key and no SAS token means
    ``DefaultAzureCredential``.
    """

    account_name: str
    blob_endpoint: str
    account_key: str | None = None
    sas_token: str | None = None
    connection_string: str | None = None

    @classmethod
    def from_env(cls, account: str | None = None) -> AzureSettings:
        """The settings in the environment; *account* (from a URI) wins over the environment's.

        Example::

            >>> os.environ["AZURE_STORAGE_CONNECTION_STRING"] = "UseDevelopmentStorage=true"
            >>> AzureSettings.from_env().blob_endpoint
            'http://127.0.0.1:10000/devstoreaccount1'
        """
        cs = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
        if cs:
            fields = _connection_fields(cs)
            if fields.get("usedevelopmentstorage", "").lower() == "true":
                fields = {
                    "accountname": _DEV_ACCOUNT,
                    "accountkey": _DEV_KEY,
                    "blobendpoint": f"http://127.0.0.1:10000/{_DEV_ACCOUNT}",
                }
                cs = ";".join(f"{k}={v}" for k, v in (("AccountName", _DEV_ACCOUNT), ("AccountKey", _DEV_KEY)))
                cs += f";BlobEndpoint=http://127.0.0.1:10000/{_DEV_ACCOUNT};"
            name = fields.get("accountname") or _account_of_endpoint(fields.get("blobendpoint", "")) or account
            if not name:
                raise ValueError("AZURE_STORAGE_CONNECTION_STRING names no AccountName")
            if account and account != name:
                raise ValueError(f"the URI names storage account {account!r}, the connection string {name!r}")
            protocol = fields.get("defaultendpointsprotocol", "https")
            suffix = fields.get("endpointsuffix", "core.windows.net")
            endpoint = fields.get("blobendpoint") or f"{protocol}://{name}.blob.{suffix}"
            return cls(
                name,
                endpoint.rstrip("/"),
                fields.get("accountkey"),
                fields.get("sharedaccesssignature"),
                cs,
            )
        name = account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT")
        if not name:
            raise ValueError(
                "no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
                "(with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or a DefaultAzureCredential sign-in), "
                "or write abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/prefix"
            )
        key = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY") or os.environ.get("AZURE_STORAGE_KEY") or None
        sas = os.environ.get("AZURE_STORAGE_SAS_TOKEN") or None
        return cls(name, f"https://{name}.blob.core.windows.net", key, None if key else sas)


def _account_of_endpoint(endpoint: str) -> str | None:
    """The account a Blob endpoint names: ``https://ACCOUNT.blob...`` or an emulator's
    ``http://HOST:PORT/ACCOUNT``."""
    parts = urlsplit(endpoint)
    path = parts.path.strip("/")
    if path:
        return path.split("/", 1)[0]
    host = parts.hostname or ""
    return host.split(".", 1)[0] if ".blob." in host else None


def _connection_fields(cs: str) -> dict[str, str]:
    out = {}
    for part in cs.split(";"):
        k, sep, v = part.partition("=")
        if sep:
            out[k.strip().lower()] = v.strip()
    return out


def split_azure_uri(uri: str) -> tuple[str | None, str]:
    """(the account named in the URI or None, ``container/prefix``).

    Example::

        >>> split_azure_uri("az://runs/exp1")
        (None, 'runs/exp1')
        >>> split_azure_uri("abfss://runs@acct.dfs.core.windows.net/exp1/")
        ('acct', 'runs/exp1')
    """
    parts = urlsplit(uri)
    if parts.scheme.lower() not in AZURE_SCHEMES:
        raise ValueError(f"not an Azure URI: {uri!r}")
    container, _, host = parts.netloc.partition("@")
    account = host.split(".", 1)[0] if host else None
    if not container:
        raise ValueError(f"{uri!r} names no container (write az://CONTAINER/prefix)")
    path = "/".join(p for p in parts.path.split("/") if p)
    return account, f"{container}/{path}" if path else container


def azure_filesystem(settings: AzureSettings) -> pafs.AzureFileSystem:
    """pyarrow's AzureFileSystem for *settings*.

    Example::

        >>> azure_filesystem(AzureSettings("acct", "https://acct.blob.core.windows.net", "a2V5")).type_name
        'abfs'
    """
    ep = urlsplit(settings.blob_endpoint)
    kw: dict[str, Any] = {"blob_storage_scheme": ep.scheme or "https", "dfs_storage_scheme": ep.scheme or "https"}
    host = ep.netloc
    if host.startswith(f"{settings.account_name}."):  # ACCOUNT.blob.SUFFIX: pyarrow prepends the account
        suffix = host[len(settings.account_name) :]
        kw["blob_storage_authority"] = suffix
        kw["dfs_storage_authority"] = suffix.replace(".blob.", ".dfs.", 1)
    else:  # an emulator: http://HOST:PORT/ACCOUNT
        kw["blob_storage_authority"] = kw["dfs_storage_authority"] = host
    if settings.account_key:
        kw["account_key"] = settings.account_key
    elif settings.sas_token:
        kw["sas_token"] = "?" + settings.sas_token.lstrip("?")  # pyarrow appends it as is
    return pafs.AzureFileSystem(settings.account_name, **kw)


class AzureClient:
    """The azure-storage-blob client for create-once writes.

    Args:
        settings: the account and its credentials.
        timeout_s: the timeout of each HTTP request.

    Example::

        >>> c = AzureClient(AzureSettings.from_env())  # doctest: +SKIP
        >>> c.create_once("container", "_manifest/x", b"entry")  # doctest: +SKIP
        True
    """

    def __init__(self, settings: AzureSettings, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._service: Any = None
        self._lock = threading.Lock()

    def service(self) -> Any:
        with self._lock:
            if self._service is None:
                try:
                    from azure.storage.blob import BlobServiceClient
                except ImportError:
                    from rlrec.errors import UsageError

                    raise UsageError(
                        "az:// and abfs:// stores need azure-storage-blob: pip install 'rlrec[azure]'"
                    ) from None

                s = self.settings
                kw = {"retry_total": 0, "connection_timeout": 10, "read_timeout": self.timeout_s}
                if s.connection_string:
                    self._service = BlobServiceClient.from_connection_string(s.connection_string, **kw)
                else:
                    credential: Any = s.account_key or s.sas_token
                    if credential is None:
                        from azure.identity import DefaultAzureCredential

                        credential = DefaultAzureCredential()
                    elif s.account_key:
                        credential = {"account_name": s.account_name, "account_key": s.account_key}
                    self._service = BlobServiceClient(s.blob_endpoint, credential=credential, **kw)
            return self._service

    def create_once(self, container: str, key: str, data: bytes) -> bool:
        """Upload *data* to *key* unless it exists (one Put Blob with ``If-None-Match: *``);
        False if it exists. Other errors are raised (classify them with :func:`is_transient_error`)."""
        from azure.core.exceptions import ResourceNotFoundError

        blob = self.service().get_blob_client(container, key)
        try:
            blob.upload_blob(data, overwrite=False, timeout=int(self.timeout_s))
        except ResourceNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"Azure container {container!r} does not exist") from None
        except Exception as e:
            if is_exists_error(e):
                return False
            raise
        return True

    def put(self, container: str, key: str, data: bytes) -> None:
        """Write *data* to *key*, replacing it, atomically for readers: one Put Blob (or, over
        64 MiB, staged blocks and one Put Block List). (pyarrow's output stream creates an empty
        blob when it opens and fills it at close: readers could see 0 bytes meanwhile.)"""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self.service().get_blob_client(container, key).upload_blob(
                data, overwrite=True, timeout=int(self.timeout_s)
            )
        except ResourceNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"Azure container {container!r} does not exist") from None

    def delete(self, container: str, key: str) -> bool:
        """Delete the blob *key*; False if it does not exist. (pyarrow's delete, on an account
        without a hierarchical namespace, also writes a marker blob for the emptied directory
        and first probes the account's namespace kind, which Azurite answers only after the
        Azure SDK's retries: seconds per filesystem.)"""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self.service().get_blob_client(container, key).delete_blob(timeout=int(self.timeout_s))
        except ResourceNotFoundError:
            return False
        return True


def is_exists_error(exc: BaseException) -> bool:
    """HTTP 409 (``BlobAlreadyExists``) or 412 (condition not met): the blob exists."""
    return (type(exc).__module__ or "").startswith("azure") and getattr(exc, "status_code", None) in (409, 412)


def is_access_error(exc: BaseException) -> bool:
    """Credentials missing, wrong or without the permission: retrying will not help."""
    from azure.core.exceptions import ClientAuthenticationError

    return isinstance(exc, ClientAuthenticationError) or (
        (type(exc).__module__ or "").startswith("azure") and getattr(exc, "status_code", None) in (401, 403)
    )


def is_transient_error(exc: BaseException) -> bool | None:
    """True/False for an error of the Azure client stack, None for anything else."""
    if not (type(exc).__module__ or "").startswith("azure"):
        return None
    from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError, ServiceResponseError

    if isinstance(exc, ClientAuthenticationError):
        return False
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return True
    return getattr(exc, "status_code", None) in _TRANSIENT_STATUS
