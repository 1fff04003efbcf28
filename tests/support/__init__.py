"""What only hylinker's own suites use, never shipped: the suite checks every pytest.ini loads
(:mod:`.suite_checks`), the engine suites' shared fixtures, the DCP and SGLang rank children the
suites start, the SGLang server harness and the tiny Qwen3 builder. What tools run as well (engine
runners, tiny hybrid models, the reference engine, fleet hosts) is :mod:`hylinker.tools.harness`.

``tests/`` has no ``__init__.py`` (pytest imports each test file by its own folder), so this package
imports as ``hylinker.tests.support`` from a checkout, through ``tests`` as a namespace package.
"""
