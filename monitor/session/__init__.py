"""A monitoring session, framework-free: ``TrainerMon`` (``trainer``; the checks of
``set_monitor``'s arguments in ``attach_arguments``), what every adapter's
session shares (``lifecycle``: start, stop, ending a step; what stop() says of a session that saw
no step in ``unseen``, where a resumed run's steps go on from in ``resume``), its collections
(``collection``; steps of another number of micro-batches in ``micro_batches``), which
steps are collected (``schedule``), live reconfiguration (``dynamic``), and the core that turns a
step's records into files, detection and the latest values (``core``; what ran, for the readers,
in ``monitor.run_info``); msprobe's
older method names live apart (``old_names``).

The top of the core: may import every other part of ``monitor``; only ``trainer`` names an
adapter, lazily, when ``set_monitor`` sees the model's type.
"""
