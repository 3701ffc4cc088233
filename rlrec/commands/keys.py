"""``rlrec keys generate DIR``: an Ed25519 key pair for signing published policies and checkpoints.

Writes ``DIR/policy-signing.key`` (private key, PEM PKCS8, mode 0600: give it to `rlrec train
--signing-key`) and ``DIR/policy-signing.pub`` (public key, PEM SubjectPublicKeyInfo: give it to
every policy service, `load_policy(uri, public_key=PATH)` or ``RLREC_POLICY_PUBLIC_KEY=PATH``).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "keys",
        help="signing keys for published policies (rlrec keys generate DIR)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="keys_command", metavar="COMMAND")
    g = sub.add_parser(
        "generate",
        help="write DIR/policy-signing.key (mode 0600) and DIR/policy-signing.pub",
        description="Generate an Ed25519 key pair: DIR/policy-signing.key (PEM PKCS8, mode 0600) and "
        "DIR/policy-signing.pub (PEM SubjectPublicKeyInfo). Refuses to overwrite an existing key unless "
        "--force; with --if-missing an existing pair is kept and the command succeeds.",
    )
    g.add_argument("dir", metavar="DIR", help="directory for the key pair (created if needed)")
    g.add_argument("--force", action="store_true", help="replace an existing key pair")
    g.add_argument("--if-missing", action="store_true", help="do nothing (exit 0) if the key pair exists")
    g.add_argument(
        "--export-public",
        metavar="PUBDIR",
        help="also copy the public key to PUBDIR/policy-signing.pub (a place policy services may read "
        "without seeing the private key)",
    )
    g.set_defaults(func=_generate)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])


def _generate(args: argparse.Namespace) -> int:
    import os

    from rlrec.trainer.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys, load_private_key

    priv, pub = os.path.join(args.dir, PRIVATE_KEY_FILE), os.path.join(args.dir, PUBLIC_KEY_FILE)
    if args.if_missing and os.path.exists(priv) and os.path.exists(pub):
        load_private_key(priv)  # a broken key must not pass silently
        print(f"rlrec keys: keeping {priv} and {pub}", file=sys.stderr)
    else:
        try:
            priv, pub = (str(p) for p in generate_keys(args.dir, overwrite=args.force))
        except FileExistsError as e:
            print(f"rlrec keys: {e} (use --force to replace it, --if-missing to keep it)", file=sys.stderr)
            return 1
        print(f"private key (keep secret; rlrec train --signing-key): {priv}")
        print(f"public key (policy services; RLREC_POLICY_PUBLIC_KEY): {pub}")
    if args.export_public:
        import shutil

        os.makedirs(args.export_public, exist_ok=True)
        shutil.copyfile(pub, os.path.join(args.export_public, PUBLIC_KEY_FILE))
    return 0
