"""What hylinker's tools run engines with, never the runtime (the suites use it too): child-process
runners and servers for SGLang's cache and vLLM, the tiny hybrid model builder, the metrics scrape,
the reference engine on transformers models (``reference/``), the fleet's hosts in network
namespaces and the real-shape helpers. What only the suites use is ``tests/support/``.

The user-facing test kit (fake device events, a fake clock, a gated store, synthetic content and
the pytest plugin) is :mod:`hylinker.testing`.
"""
