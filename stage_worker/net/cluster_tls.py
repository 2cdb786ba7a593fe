"""TLS for every gRPC channel of the cluster, both ways, keyed by the cluster token.

The cluster's certificate authority is derived from the token (HKDF-SHA256 to a P-256 key), so the
token file (mode 600) is the CA's key material and every host that holds the token can rebuild the
same CA: nothing new to copy, and --cluster-token / METAL_CLUSTER_TOKEN keep working. Each process
issues itself a fresh key and certificate from that CA when it starts. A server asks for and checks
the client's certificate; a client checks the server's: mutual TLS is the proof that both sides
know the token, so the token itself never crosses the wire.

Names: peers are reached by IP on a LAN (DHCP, several interfaces, static --peers), and every token
holder can issue a certificate for any name, so a per-host name would add no check worth having. Every
certificate names the one host name `PEER_NAME` and clients ask for it (ssl_target_name_override):
what is verified is "issued by this cluster's CA". The common name carries the node id, for logs.

Every gRPC server and channel between hosts is made here (`add_port`, `channel`).
"""

import datetime
from dataclasses import dataclass

import grpc

PEER_NAME = "metal-cluster"
_HKDF_INFO = b"metal-cluster cluster CA v1"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# Fixed, long validity: hosts' clocks on a LAN disagree, and the CA certificate must be the same
# everywhere it is rebuilt. The token is what expires (make a new one), not the certificates.
_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)


class NoTokenError(ValueError):
    """No cluster token: nothing to build TLS credentials from."""


@dataclass(frozen=True)
class Identity:
    """PEM bytes: this process's key and certificate, and the cluster CA's certificate."""

    key: bytes
    cert: bytes
    ca: bytes


def _ca(token: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.x509.oid import NameOID

    # 48 bytes reduced mod the group order: a uniform scalar (bias < 2^-128).
    seed = HKDF(hashes.SHA256(), 48, salt=None, info=_HKDF_INFO).derive(token.encode())
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "metal-cluster CA")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def identity(token: str, common_name: str) -> Identity:
    """A fresh key and a certificate for it, issued by the token's CA."""
    if not token:
        raise NoTokenError("no cluster token: run `metal-cluster token` and copy the file to every host, "
                           "or pass --cluster-token / set METAL_CLUSTER_TOKEN")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_cert = _ca(token)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64] or "host")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return Identity(
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        cert=cert.public_bytes(pem),
        ca=ca_cert.public_bytes(pem),
    )


def fingerprint(token: str) -> str:
    """The cluster CA's public-key fingerprint: equal on two hosts exactly when their tokens are."""
    from cryptography.hazmat.primitives import hashes, serialization

    public = _ca(token)[0].public_key().public_bytes(serialization.Encoding.DER,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)
    digest = hashes.Hash(hashes.SHA256())
    digest.update(public)
    return digest.finalize().hex()[:16]


def server_credentials(token: str, common_name: str) -> grpc.ServerCredentials:
    """TLS that requires a client certificate from this cluster's CA; others fail the handshake."""
    me = identity(token, common_name)
    return grpc.ssl_server_credentials([(me.key, me.cert)], root_certificates=me.ca, require_client_auth=True)


def add_port(server: grpc.Server, address: str, token: str, common_name: str,
             credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on `address` with the cluster's TLS (`credentials`: made beforehand by
    server_credentials); the port bound (0: not bound), as add_secure_port."""
    return server.add_secure_port(address, credentials or server_credentials(token, common_name))


def channel(address: str, token: str, options=(), common_name: str = "coordinator") -> grpc.Channel:
    """A channel that shows this process's certificate and accepts only a server of this cluster."""
    me = identity(token, common_name)
    creds = grpc.ssl_channel_credentials(root_certificates=me.ca, private_key=me.key, certificate_chain=me.cert)
    return grpc.secure_channel(address, creds, options=[*options, ("grpc.ssl_target_name_override", PEER_NAME)])


def refusal(details: str | None) -> str | None:
    """What a failed TLS handshake means, from grpc's status details; None for any other failure."""
    text = details or ""
    if "CERTIFICATE_VERIFY_FAILED" in text or "unknown ca" in text.lower():
        return ("TLS refused: its certificate is not from this cluster's token (another cluster, or a different "
                "token: use the same --cluster-token, METAL_CLUSTER_TOKEN or token file on every host)")
    if "handshake failed" in text.lower() or "WRONG_VERSION_NUMBER" in text:
        return f"TLS handshake failed (a host of another version, or not a metal-cluster worker): {text}"
    return None
