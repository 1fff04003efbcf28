"""The stress tool (``hylinker stress``): a trace or a synthetic agentic workload replayed through
the runtime, every restore verified. :mod:`.run` drives one run (``StressRun``, ``run_stress``),
:mod:`.cli` is the subcommand, :mod:`.inputs` opens the store and the workload, :mod:`.ranks` runs
several ranks that agree on every lookup.
"""
