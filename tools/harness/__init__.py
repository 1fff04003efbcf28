"""What hylinker's own suites and tools run on, never the runtime: engine fixtures and child-process
runners for SGLang and vLLM, tiny-model builders, the reference engine on transformers models
(``reference/``), the fleet in network namespaces and the DCP and real-shape helpers.

The user-facing test kit (fake device events, a fake clock, a gated store, synthetic content and
the pytest plugin) is :mod:`hylinker.testing`.
"""
