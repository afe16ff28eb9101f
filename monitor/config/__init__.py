"""The config: every key with its default and check (``schema``; the ``alert`` section in
``alert_section``), reading a config file (``files``), and the small value checks shared with the
other sections (``values``).

May import the shared modules at the top of ``monitor`` and the parsers of the sections it
validates (``monitor.alerts.config``, ``monitor.anomaly.rules``); nothing of a session.
"""
