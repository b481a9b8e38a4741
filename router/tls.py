"""TLS for the front ends, from one :class:`TlsConfig`: gRPC credentials and an ``ssl`` context.

Both front ends present the same certificate; with ``client_ca_file`` set both require a client
certificate signed by that CA (mutual TLS), so a client without one is refused during the
handshake, before it can send a request.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from duet.config import TlsConfig


def _read(path: str) -> bytes:
    return Path(path).expanduser().read_bytes()


def grpc_server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    client_ca = _read(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def http_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(Path(tls.cert_file).expanduser()), str(Path(tls.key_file).expanduser()))
    if tls.client_ca_file:
        context.load_verify_locations(str(Path(tls.client_ca_file).expanduser()))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """A client's credentials: the CA to trust (None: the system's) and, for mutual TLS, its
    own certificate and key."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file) if ca_file else None,
        private_key=_read(key_file) if key_file else None,
        certificate_chain=_read(cert_file) if cert_file else None,
    )
