"""The KV endpoint's security flags of ``bucketserve serve``: where the decode workers' KV endpoint listens, its
token and its TLS files, turned into the cluster's :class:`TransferConfig` with errors that name the flag."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping

from kv_transfer.config import TransferConfig

# The token may come from the environment, so that it need not appear in the process list.
KV_TOKEN_ENV = "BUCKETSERVE_KV_TOKEN"


def add_kv_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address the decode workers' KV endpoint listens on; any other than a loopback one needs "
        "--kv-tls-cert and --kv-tls-key (0.0.0.0: every address, each worker advertising its node's IP)",
    )
    p.add_argument(
        "--kv-auth-token",
        default=None,
        help=f"secret every KV call between workers carries (default: ${KV_TOKEN_ENV}, else a random token "
        "made for each cluster)",
    )
    p.add_argument(
        "--kv-tls-cert",
        default=None,
        help="PEM certificate of the KV endpoints, with --kv-tls-key: KV travels over TLS (the same path on "
        "every node; it must name the address workers advertise)",
    )
    p.add_argument("--kv-tls-key", default=None, help="PEM private key of --kv-tls-cert")
    p.add_argument(
        "--kv-tls-server-name",
        default=None,
        help="name prefill workers expect in the KV certificate instead of the address they dial: one "
        "certificate made out to this name serves every node",
    )
    p.add_argument(
        "--no-kv-same-node-shm",
        action="store_true",
        help="KV between workers of one host over gRPC too, not shared memory (hosts whose containers do not "
        "share /dev/shm)",
    )
    p.add_argument(
        "--kv-tls-ca",
        default=None,
        help="PEM CA bundle prefill workers check the KV certificate with (default: --kv-tls-cert itself, "
        "for a self-signed one)",
    )


def _flags(token_from_env: bool) -> dict[str, str]:
    """TransferConfig field -> what the user set it with."""
    return {
        "TransferConfig.host": "--kv-host",
        "TransferConfig.auth_token": f"${KV_TOKEN_ENV}" if token_from_env else "--kv-auth-token",
        "TransferConfig.tls_cert_file": "--kv-tls-cert",
        "TransferConfig.tls_key_file": "--kv-tls-key",
        "TransferConfig.tls_ca_file": "--kv-tls-ca",
        "TransferConfig.tls_server_name": "--kv-tls-server-name",
    }


def _in_flag_terms(message: str, flags: Mapping[str, str]) -> str:
    for field, flag in flags.items():
        message = message.replace(field, flag)
    return message


def _check_tls_files(config: TransferConfig) -> None:
    """The certificate, key and CA load (not only exist), so a bad file fails now, not when KV first moves."""
    if config.tls_cert_file and config.tls_key_file:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.tls_cert_file, config.tls_key_file)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(
                f"--kv-tls-cert {config.tls_cert_file} with --kv-tls-key {config.tls_key_file}: cannot load them "
                f"({e.strerror or e})"
            ) from None
    if config.tls_ca_file:
        try:
            ssl.create_default_context(cafile=config.tls_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(
                f"--kv-tls-ca {config.tls_ca_file}: cannot load it ({e.strerror or e})"
            ) from None


def transfer_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> TransferConfig:
    """The cluster's KV transfer settings from the flags; a ``ValueError`` naming the flag when one is wrong.

    Without ``--kv-auth-token`` (or its variable) the token stays unset here: the launcher makes one per cluster.
    """
    token = args.kv_auth_token
    token_from_env = token is None and bool(environ.get(KV_TOKEN_ENV))
    if token_from_env:
        token = environ[KV_TOKEN_ENV]
    try:
        config = TransferConfig(
            host=args.kv_host,
            auth_token=token,
            tls_cert_file=args.kv_tls_cert,
            tls_key_file=args.kv_tls_key,
            tls_ca_file=args.kv_tls_ca,
            tls_server_name=args.kv_tls_server_name,
            same_node_fast_path=not args.no_kv_same_node_shm,
        )
    except ValueError as e:
        raise ValueError(_in_flag_terms(str(e), _flags(token_from_env))) from None
    _check_tls_files(config)
    return config
