"""The linker: a radix tree of its own with COMMIT, for engines without a tree; its facade
(:class:`~hylinker.runtime.linker.facade.Linker`), the rooms that run each phase and the tree writer."""
