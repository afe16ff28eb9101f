"""From an incident to people and to the run: alert sinks, callbacks and the ``stop`` action.

msprobe prints anomalies to the console only. Here each new incident (see
``monitor.anomaly.incidents``) becomes one JSON message delivered, off the training thread, to the
sinks of ``alert.sinks`` (webhook, command, file) and to the callbacks of
``TrainerMon.on_incident``; ``alert.actions: ["stop"]`` ends the run at the next step boundary on
every rank at the same step. Framework-free: the adapters supply only the cross-rank agreement of
the stop. A sink that fails, hangs or floods never blocks or stops training.

May import the shared modules at the top of ``monitor``, ``monitor.config.values`` and
``monitor.anomaly.ordering`` (which rank's root comes first in a step); nothing of a session.
"""
