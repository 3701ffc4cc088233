"""``rlrec keys generate DIR``: an Ed25519 key pair for signing published policies and checkpoints.

Writes ``DIR/policy-signing.key`` (private key, PEM PKCS8, mode 0600: give it to `rlrec train
--signing-key`) and ``DIR/policy-signing.pub`` (public key, PEM SubjectPublicKeyInfo: give it to
every policy service, `load_policy(uri, public_key=PATH)` or ``RLREC_POLICY_PUBLIC_KEY=PATH``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from rlrec.options import OptionSet, option


@dataclass
class KeysGenerate:
    """Options of `rlrec keys generate`."""

    dir: str = option(positional=True, metavar="DIR", help="directory for the key pair (created if needed)")
    force: bool = option(False, help="replace an existing key pair")
    if_missing: bool = option(False, help="do nothing (exit 0) if the key pair exists")
    export_public: str | None = option(
        None,
        metavar="PUBDIR",
        help="also copy the public key to PUBDIR/policy-signing.pub (a place policy services may read "
        "without seeing the private key)",
    )


#: the options of `rlrec keys generate`
OPTIONS = OptionSet("keys generate", KeysGenerate)


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
    OPTIONS.add_arguments(g)
    g.set_defaults(func=_generate, options=OPTIONS)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])


def _generate(args: argparse.Namespace) -> int:
    import os

    from rlrec.trainer.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys, load_private_key

    opts = OPTIONS.build(KeysGenerate, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    priv, pub = os.path.join(opts.dir, PRIVATE_KEY_FILE), os.path.join(opts.dir, PUBLIC_KEY_FILE)
    if opts.if_missing and os.path.exists(priv) and os.path.exists(pub):
        load_private_key(priv)  # a broken key must not pass silently
        print(f"rlrec keys: keeping {priv} and {pub}", file=sys.stderr)
    else:
        try:
            priv, pub = (str(p) for p in generate_keys(opts.dir, overwrite=opts.force))
        except FileExistsError as e:
            print(f"rlrec keys: {e} (use --force to replace it, --if-missing to keep it)", file=sys.stderr)
            return 1
        print(f"private key (keep secret; rlrec train --signing-key): {priv}")
        print(f"public key (policy services; RLREC_POLICY_PUBLIC_KEY): {pub}")
    if opts.export_public:
        import shutil

        os.makedirs(opts.export_public, exist_ok=True)
        shutil.copyfile(pub, os.path.join(opts.export_public, PUBLIC_KEY_FILE))
    return 0
