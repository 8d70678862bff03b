"""torchrun entry points and the infini-dist CLI."""
