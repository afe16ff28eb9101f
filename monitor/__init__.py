"""trainmon: a training-state monitor with msprobe's monitor interface.

``import monitor`` needs neither torch nor mindspore; the adapter is chosen from the model's
type when ``TrainerMon.set_monitor`` is called.
"""

from monitor.config.schema import ConfigError, MonitorConfig, load_config
from monitor.errors import CollectivesLogged, StructurePrinted, TrainingStopped
from monitor.logs import configure_logging
from monitor.session.trainer import TrainerMon

__version__ = "0.1.0"
__all__ = [
    "CollectivesLogged",
    "ConfigError",
    "MonitorConfig",
    "StructurePrinted",
    "TrainerMon",
    "TrainingStopped",
    "__version__",
    "load_config",
]

configure_logging()
