"""Sub-commands of the CLI: one module each, with ``register(subparsers)``."""
