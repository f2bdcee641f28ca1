"""An endpoint that asks for a TLS client certificate (mTLS): a real TLS server on 127.0.0.1 that
refuses connections without one, called through the delivery client as the dispatchers call it."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hookline.shared.contracts.models import MtlsAuth, StoredEndpoint
from hookline.shared.outbound.credentials import Credentials, certificate_problem, stored_auth
from hookline.shared.outbound.delivery import DeliveryClient, ErrorKind
from hookline.shared.outbound.sealing import Sealer

pytestmark = pytest.mark.integration


@dataclass
class Issued:
    certificate: str
    private_key: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _issue(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


@dataclass
class Pki:
    ca_file: Path
    server: ssl.SSLContext
    client: Issued


@pytest.fixture
def pki(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Pki:
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hookline test CA")])
    ca = _issue("hookline test CA", ca_key, ca_name, ca_key, ca=True)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_key, client_key = _key(), _key()
    server_cert = _issue("127.0.0.1", server_key, ca_name, ca_key, ca=False)
    client_cert = _issue("acme-webhooks", client_key, ca_name, ca_key, ca=False)
    (tmp_path / "server.pem").write_text(
        _pem_key(server_key) + server_cert.public_bytes(serialization.Encoding.PEM).decode()
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "server.pem")
    server.load_verify_locations(ca_file)
    server.verify_mode = ssl.CERT_REQUIRED  # no client certificate, no connection
    # The delivery client verifies servers against the default trust store: here, the test CA.
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    client = Issued(client_cert.public_bytes(serialization.Encoding.PEM).decode(), _pem_key(client_key))
    return Pki(ca_file, server, client)


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTPS endpoint that records the common name of each client certificate it was called with."""
    seen: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(item for rdn in (peer or {}).get("subject", ()) for item in rdn)
        seen.append(subject.get("commonName", ""))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=pki.server)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"https://127.0.0.1:{port}/hook", seen
    await runner.cleanup()


def _endpoint(url: str, sealed: dict[str, object]) -> StoredEndpoint:
    now = dt.datetime.now(dt.UTC)
    return StoredEndpoint.model_validate(
        {
            "id": "ep_01JDTESTMT0000000000000000", "tenant": "acme", "url": url, "event_types": ["order.*"],
            "created_at": now, "updated_at": now,
            "secrets": [{"value": "whsec_" + "A" * 32, "created_at": now}], **sealed,
        }
    )  # fmt: skip


async def test_a_client_certificate_is_presented_and_without_it_the_endpoint_refuses(
    pki: Pki, server: tuple[str, list[str]]
) -> None:
    url, seen = server
    sealer = Sealer("k" * 40)
    auth = MtlsAuth(type="mtls", certificate=pki.client.certificate, private_key=pki.client.private_key)
    assert certificate_problem(auth) is None
    sealed = stored_auth(sealer, auth)
    assert pki.client.private_key not in sealed["sealed_auth"].model_dump_json()  # the key is kept sealed
    async with DeliveryClient(
        max_connections=4, user_agent="t", allow_http=False, allow_private=True
    ) as client:
        credentials = Credentials(sealer, client)
        with_certificate = await credentials.post(
            _endpoint(url, sealed), b"{}", {"content-type": "application/json"}
        )
        without = await credentials.post(_endpoint(url, {}), b"{}", {"content-type": "application/json"})
    assert with_certificate.status == 204, with_certificate.detail
    assert seen == ["acme-webhooks"]
    assert without.status is None  # the handshake failed: no request reached the endpoint
    assert without.error in (ErrorKind.TLS, ErrorKind.NETWORK, ErrorKind.CONNECT), without.detail


def test_a_certificate_that_does_not_match_its_key_is_refused(pki: Pki) -> None:
    other = _pem_key(_key())
    problem = certificate_problem(
        MtlsAuth(type="mtls", certificate=pki.client.certificate, private_key=other)
    )
    assert problem is not None
    assert "do not load" in problem
