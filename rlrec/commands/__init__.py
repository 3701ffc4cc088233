"""``rlrec`` subcommands: one module per command, each with ``register(subparsers)``.

See :mod:`rlrec.cli` for the contract (stdlib-only imports at module level).
"""
