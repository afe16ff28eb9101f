"""Collective calls (cc_distribution), framework-free: the monitor half each adapter's collective
monitor extends (``base``), the reference-counted owner of the wrappers (``registry``), exact
per-step totals of the tensors passed (``totals``) and call stacks with cc_codeline matching
(``callsites``).

May import the config and the shared modules at the top of ``monitor``.
"""
