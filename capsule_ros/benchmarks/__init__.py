"""`capsule-ros bench ...`: benchmarks that report ratios measured side by side in one run.

Each benchmark returns one JSON-able dict (``--json`` prints it) and a readable table.
Targets are compared in the output (``met``), never asserted in tests.
"""

__all__: list = []       # run through `capsule-ros bench NAME`; each module has run() and main()
