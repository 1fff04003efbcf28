"""The runtime: its two layers, the data plane (:mod:`.dataplane`: objects between device pools and
a store) and the linker on top of it (:mod:`.linker`: our own tree with COMMIT). docs/structure.md
maps them; the public API is the package root's ``hylinker``.
"""
